"""GPU training throughput: bf16 against fp8 Linear layers at 124M-like and ~1B-like shapes.

    pip install -e .
    python benchmarks/gpu_train.py [--index DIR] [--steps 200] [--shapes 124m,1b] [--no-compile]

B x T = 32 x 1024 byte tokens with index features (the index of the Python standard library is
built first when no --index is given). For each shape and precision: tokens/s after warm-up, peak
GPU memory and the loss after --steps steps. Prints a table, writes benchmarks/results/gpu_train.json.
Needs a CUDA GPU; fp8 uses torch._scaled_mm on compute capability >= 8.9.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import CACHE, save, table

SHAPES = {
    "124m": {"n_layer": 12, "n_head": 12, "d_model": 768},
    "1b": {"n_layer": 16, "n_head": 16, "d_model": 2048},
}


def run(index, shape: str, precision: str, steps: int, compile_model: bool) -> dict:
    from teralm.infer.precision import autocast
    from teralm.model import ModelConfig, Transformer
    from teralm.model.transformer import lm_loss
    from teralm.train.config import TrainConfig
    from teralm.train.data import FragmentSampler
    from teralm.train.optim import make_optimizer

    device = torch.device("cuda")
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=index.vocab_size,
        max_match=index.max_match,
        max_seq_len=1024,
        precision=precision,
        **SHAPES[shape],
    )
    model = Transformer(cfg).to(device)
    forward = torch.compile(model) if compile_model else model
    train_cfg = TrainConfig(batch_size=32, seq_len=1024, lr=6e-4 if shape == "1b" else 1.5e-3)
    optimizer = make_optimizer(model, train_cfg)
    sampler = FragmentSampler(index, dataclasses.replace(train_cfg, index_dropout=0.0))
    torch.cuda.reset_peak_memory_stats()
    losses, timed_from, began = [], 10, 0.0
    for step in range(steps):
        if step == timed_from:
            torch.cuda.synchronize()
            began = time.perf_counter()
        batch = sampler.batch(step).to(device)
        with autocast(device, precision):
            logits = forward(batch.tokens, batch.next_token, batch.match_len)
        loss = lm_loss(logits, batch.targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - began
    return {
        "shape": shape,
        "precision": precision,
        "params_m": model.num_parameters() / 1e6,
        "tok_per_s": (steps - timed_from) * 32 * 1024 / elapsed,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "loss": sum(losses[-10:]) / 10,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--index", type=Path)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--shapes", default="124m,1b")
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_train.py needs a CUDA GPU")
    from teralm.index import Index

    index_dir = args.index or CACHE / "gpu" / "stdlib-index"
    if args.index is None:
        cmd = [
            sys.executable,
            "-m",
            "teralm.cli",
            "build-index",
            "stdlib",
            "--out",
            str(index_dir),
            "--quiet",
        ]
        subprocess.run(cmd, check=True)
    index = Index.open(index_dir)
    rows = []
    for shape in args.shapes.split(","):
        for precision in ("bf16", "fp8"):
            rows.append(run(index, shape, precision, args.steps, not args.no_compile))
            print(rows[-1], flush=True)
    for shape in args.shapes.split(","):
        bf16, fp8 = (r for r in rows if r["shape"] == shape)
        fp8["speedup"] = fp8["tok_per_s"] / bf16["tok_per_s"]
        fp8["loss_vs_bf16"] = fp8["loss"] / bf16["loss"] - 1
    print(f"{torch.cuda.get_device_name()}; B x T = 32 x 1024; {args.steps} steps")
    print(
        table(
            rows,
            [
                ("shape", "shape", "s"),
                ("precision", "precision", "s"),
                ("params_m", "params M", ".0f"),
                ("tok_per_s", "tokens/s", ",.0f"),
                ("speedup", "fp8/bf16", ".2f"),
                ("peak_gib", "peak GiB", ".1f"),
                ("loss", "loss", ".4f"),
                ("loss_vs_bf16", "loss vs bf16", "+.2%"),
            ],
        )
    )
    print(f"wrote {save('gpu_train', {'rows': rows})}")


if __name__ == "__main__":
    main()
