#!/usr/bin/env bash
# The GPU checks in one run, on a machine with a CUDA build of PyTorch in the active Python:
#   bash benchmarks/gpu_check.sh [options of gpu_train.py, e.g. --steps 200 --shapes 124m,1b]
# 1. installs teralm into that Python (its CUDA torch is kept: the project asks for torch>=2.4);
# 2. checks fp8 on the GPU (torch._scaled_mm) against the CPU emulation, and the model tests;
# 3. times bf16 against fp8 training at 124M-like and ~1B-like shapes (benchmarks/gpu_train.py);
# 4. trains the tiny preset on one GPU under torchrun (NCCL) with --comm allreduce and demo, and
#    prints each one's tokens/s (benchmarks/cache/gpu_comm/);
# 5. trains the tiny preset with AdamW, GaLore, 8-bit GaLore and galore-torch's GaLoreAdamW on the
#    GPU (benchmarks/bench_optimizers.py --steps 100: state bytes, held-out bpb, tokens/s).
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU')"
python -m pip install -q -e '.[dev]'
python -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
python -m pytest -q tests/test_fp8.py tests/test_model.py
python benchmarks/gpu_train.py "$@"
work=benchmarks/cache/gpu_comm
rm -rf "$work" && mkdir -p "$work"
python -m teralm.cli build-index stdlib --out "$work/index" --quiet
for comm in allreduce demo; do
  torchrun --nproc-per-node 1 -m teralm.cli train --index "$work/index" --out "$work/$comm" \
    --preset tiny --max-steps 100 --comm "$comm" --quiet
  python -c "import json, sys; r = [json.loads(l) for l in open(sys.argv[1])][-1]; print(sys.argv[2], f\"{r['tok_per_s']:,.0f} tokens/s, {r['sent_bytes']} bytes sent in the last step\")" "$work/$comm/metrics.jsonl" "$comm"
done
python -c "import galore_torch" 2>/dev/null || python -m pip install -q galore-torch bitsandbytes \
  || echo "galore-torch cannot be installed here: bench_optimizers runs without its rows"
python benchmarks/bench_optimizers.py --steps 100
