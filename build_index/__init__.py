"""The build-index batch job: corpus -> sharded, resumable causal lookup index."""

from teralm.build_index.builder import BuildConfig, BuildResult, build

__all__ = ["BuildConfig", "BuildResult", "build"]
