"""The docs cite files and code that exist."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_every_repository_path_the_readme_cites_exists():
    """A backticked path whose first part is one of the repository's top-level entries (a
    module folder, ``tests``, ``benchmarks``, ...) names a file or folder that is there."""
    top = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")}
    cited = set(re.findall(r"`([A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)+)`", README))
    ours = sorted(p for p in cited if p.split("/")[0] in top)
    assert len(ours) >= 5  # the README does cite files
    assert not [p for p in ours if not (ROOT / p).exists()]


def test_every_module_and_name_the_readme_cites_exists():
    """A backticked ``teralm.module.name`` is a module, or a name inside one."""
    cited = sorted(set(re.findall(r"`(teralm(?:\.\w+)+)", README)))
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
