#!/usr/bin/env bash
# The GPU checks in one run, on a machine with a CUDA build of PyTorch in the active Python:
#   bash benchmarks/gpu_check.sh [options of gpu_train.py, e.g. --steps 200 --shapes 124m,1b]
# 1. installs teralm into that Python (its CUDA torch is kept: the project asks for torch>=2.4);
# 2. checks fp8 on the GPU (torch._scaled_mm) against the CPU emulation, and the model tests;
# 3. times bf16 against fp8 training at 124M-like and ~1B-like shapes (benchmarks/gpu_train.py).
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU')"
python -m pip install -q -e '.[dev]'
python -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
python -m pytest -q tests/test_fp8.py tests/test_model.py
python benchmarks/gpu_train.py "$@"
