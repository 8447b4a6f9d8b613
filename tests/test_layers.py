"""The layers hold: lint-imports (import-linter) on the package laid out as its import tree."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def import_tree(into: Path) -> Path:
    """Copy the package's folders to ``into`` as Python imports them (pyproject's package-dir)."""
    folders = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for package, folder in folders["package-dir"].items():
        shutil.copytree(
            ROOT / folder,
            into / package.replace(".", "/"),
            ignore=shutil.ignore_patterns("__pycache__"),
            dirs_exist_ok=True,
        )
    return into


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    """lint-imports of the repository's contracts, run on ``tree``."""
    return subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports")), str(ROOT / ".importlinter")],
        cwd=tree,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )


def test_imports_go_down_the_layers_and_never_round_in_a_circle(tmp_path):
    result = lint_imports(import_tree(tmp_path / "tree"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 2 kept, 0 broken." in result.stdout


def test_an_upward_import_breaks_the_layers(tmp_path):
    """The contract is not vacuous: a kernel that imports the server is caught."""
    tree = import_tree(tmp_path / "tree")
    (tree / "teralm/kernels/upward.py").write_text("import teralm.server.app\n")
    result = lint_imports(tree)
    assert result.returncode != 0 and "teralm.kernels.upward -> teralm.server.app" in result.stdout
