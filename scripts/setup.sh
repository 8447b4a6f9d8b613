#!/usr/bin/env bash
# Create .venv if missing and install teralm (editable) into it: the core package, or with the
# extras named (e.g. `bash scripts/setup.sh dev`). One line per step with its time; pip's own
# output goes to .venv/setup.log. A venv set up already for these extras from this pyproject.toml
# is left as it is (code changes need no reinstall: the install is editable).
# PyTorch: an existing install is kept (e.g. a CUDA build); otherwise the CPU wheel 2.13.0.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
target="."
[ -z "$extras" ] || target=".[$extras]"
step() {  # step MESSAGE COMMAND...: run it, then say how long it took
  local message="$1" began=$SECONDS
  shift
  printf 'setup: %s ... ' "$message"
  "$@"
  echo "$((SECONDS - began)) s"
}
[ -x .venv/bin/python ] || step "creating .venv" python3 -m venv .venv
. .venv/bin/activate
stamp=".venv/setup${extras:+-$extras}.done"
for done in $([ -z "$extras" ] && ls .venv/setup*.done 2>/dev/null || echo "$stamp"); do
  # any install covers the core package
  if [ "$done" -nt pyproject.toml ] && python -c "import teralm.cli" 2>/dev/null; then
    exit 0
  fi
done
log=.venv/setup.log
pip_install() {
  python -m pip install -q "$@" >"$log" 2>&1 || { echo; cat "$log"; echo "setup: pip install $* failed" >&2; exit 1; }
}
step "upgrading pip" pip_install --upgrade pip
python -c "import torch" 2>/dev/null || step "installing PyTorch 2.13.0 (CPU)" pip_install torch==2.13.0
step "installing teralm${extras:+ with [$extras]} (editable)" pip_install -e "$target"
touch "$stamp"
