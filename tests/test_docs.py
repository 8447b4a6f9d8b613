"""The docs cite files and code that exist."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "ARCHITECTURE.md", "benchmarks/README.md"]


@pytest.mark.parametrize("doc", DOCS)
def test_every_repository_path_the_docs_cite_exists(doc):
    """A path in backticks (alone, or a word of a command) whose first part is one of the repository's top-level entries (a
    module folder, ``tests``, ``benchmarks``, ...) names a file or folder that is there."""
    top = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")}
    spans = re.findall(r"`([^`\n]+)`", (ROOT / doc).read_text())
    words = [w.strip(".,;:()'\"") for span in spans for w in span.split()]
    cited = {w for w in words if re.fullmatch(r"[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)+", w)}
    ours = sorted(p for p in cited if p.split("/")[0] in top)
    assert len(ours) >= 5  # the README does cite files
    assert not [p for p in ours if not (ROOT / p).exists()]


@pytest.mark.parametrize("doc", DOCS)
def test_every_module_and_name_the_docs_cite_exists(doc):
    """A backticked ``teralm.module.name`` is a module, or a name inside one."""
    cited = sorted(set(re.findall(r"`(teralm(?:\.\w+)+)", (ROOT / doc).read_text())))
    assert cited
    missing = []
    for dotted in cited:
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):  # the longest prefix that imports
            try:
                thing = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for name in parts[cut:]:
                thing = getattr(thing, name, None)
            if thing is None:
                missing.append(dotted)
            break
    assert not missing, missing
