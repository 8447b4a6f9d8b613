"""The project's own errors: one base class, so that a caller (the CLI, the server) can tell a
problem the user can fix from a bug. Every message says what is wrong and what to do."""

from __future__ import annotations

from pathlib import Path


class TeralmError(Exception):
    """A problem the user can act on; the command line prints its message as one line."""


class ConfigError(TeralmError, ValueError):
    """A flag, a configuration value or an argument that cannot be used as given."""


class InputError(TeralmError, ValueError):
    """Input that cannot be used: a request, a text, tokens outside the vocabulary."""


class CheckpointError(TeralmError, ValueError):
    """A run or checkpoint that cannot be read, saved or used for what was asked."""


class BuildError(TeralmError):
    """An index build cannot go on."""


class SourceError(TeralmError):
    """A problem with a corpus source (missing, unreadable, not what its name says)."""


class FolderBusy(TeralmError, ValueError):
    """Another process is writing the folder."""


class IndexDamaged(TeralmError, ValueError):
    """An index file is missing, has the wrong size, or holds a value its format rules out."""


def damaged(directory: Path, problem: str) -> IndexDamaged:
    """The error for a damaged index: what is wrong, and what to do about it."""
    return IndexDamaged(
        f"index {directory} is damaged: {problem}; run `teralm verify-index {directory}` "
        "for a full check, and rebuild the index with build-index --force"
    )
