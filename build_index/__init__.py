"""The build-index batch job: corpus -> sharded, resumable causal lookup index."""

from teralm.build_index.builder import BuildConfig, BuildError, BuildResult, build

__all__ = ["BuildConfig", "BuildError", "BuildResult", "build"]
