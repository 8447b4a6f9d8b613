#!/usr/bin/env bash
# Set up (if needed) and run the default test suite; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
. .venv/bin/activate
python -m pytest -q "$@"
