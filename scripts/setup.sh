#!/usr/bin/env bash
# Create .venv if missing and install teralm (editable) with its dev tools; a venv already set up
# from this pyproject.toml is left as it is (code changes need no reinstall: the install is editable).
# PyTorch: an existing install is kept (e.g. a CUDA build); otherwise the CPU wheel 2.13.0.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
stamp=.venv/setup.done
if [ "$stamp" -nt pyproject.toml ] && python -c "import teralm.cli" 2>/dev/null; then
  exit 0
fi
log=.venv/setup.log
pip_install() {
  python -m pip install -q "$@" >"$log" 2>&1 || { cat "$log"; echo "setup: pip install $* failed" >&2; exit 1; }
}
pip_install --upgrade pip
python -c "import torch" 2>/dev/null || pip_install torch==2.13.0
pip_install -e '.[dev]'
touch "$stamp"
