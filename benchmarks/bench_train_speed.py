"""Training speed: the tiny preset's tokens/s with the index, without it, and as a plain loop.

    pip install -e .
    python benchmarks/bench_train_speed.py [--steps 40] [--warmup 10] [--repeats 2]

Builds (or reuses) the byte index of pydocs that bench_quality.py uses, then measures steady-state
training tokens/s, skipping the first ``--warmup`` steps, of:
  - ``teralm train --preset tiny`` with the index input (features, ∞-gram mixture);
  - the same with ``--no-index-input``;
  - a plain PyTorch loop written here (a nanoGPT-style model: LayerNorm, GELU, learned positions,
    tied embeddings, no biases) of the same layers, width, heads, vocabulary, context and batch,
    AdamW with the same settings, at the precision teralm's ``auto`` chose, on random fragments of
    the same bytes.
Each runs ``--repeats`` times, interleaved; the table shows each one's best (the least disturbed by
other work on the machine). Prints a table and writes benchmarks/results/bench_train_speed.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from common import CACHE, corpus_index, save, table, teralm_cli
from torch import nn

from teralm.train.config import PRESETS, TrainConfig
from teralm.train.report import read_metrics

WORK = CACHE / "train_speed"
TINY = {**PRESETS["tiny"]["model"], **PRESETS["tiny"]["train"]}


def steady_rate(records: list[dict], warmup: int) -> float:
    """Tokens/s between the first metrics record at or past step ``warmup`` and the last."""
    first = next(r for r in records if r["step"] >= warmup)
    last = records[-1]
    return (last["tokens"] - first["tokens"]) / (last["elapsed_s"] - first["elapsed_s"])


def teralm_run(index: Path, extra: list[str], args: argparse.Namespace) -> dict:
    """One ``teralm train --preset tiny`` run: steady tokens/s and the precision it chose."""
    run = WORK / "run"
    shutil.rmtree(run, ignore_errors=True)
    teralm_cli(
        "train", "--index", index, "--out", run, "--preset", "tiny", "--quiet",
        "--precision", args.precision, "--max-steps", args.steps,
        "--checkpoint-every", args.steps, *extra,
    )  # fmt: skip
    chosen = json.loads((run / "config.json").read_text())["precision"]["precision"]
    return {"tok_per_s": steady_rate(read_metrics(run), args.warmup), "precision": chosen}


class Block(nn.Module):
    """nanoGPT's block: pre-LayerNorm causal self-attention and a GELU MLP."""

    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(d_model, bias=False)
        self.c_attn = nn.Linear(d_model, 3 * d_model, bias=False)
        self.attn_proj = nn.Linear(d_model, d_model, bias=False)
        self.ln_2 = nn.LayerNorm(d_model, bias=False)
        self.c_fc = nn.Linear(d_model, 4 * d_model, bias=False)
        self.mlp_proj = nn.Linear(4 * d_model, d_model, bias=False)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.attn_proj(y.transpose(1, 2).reshape(B, T, C))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class PlainGPT(nn.Module):
    """nanoGPT's model without dropout or biases; the output layer shares the token embedding."""

    def __init__(self, vocab: int, context: int, n_layer: int, n_head: int, d_model: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def plain_run(data: np.ndarray, precision: str, args: argparse.Namespace) -> dict:
    """A plain PyTorch training loop of the tiny preset's shape: steady tokens/s."""
    B, T = TINY["batch_size"], TINY["seq_len"]
    torch.manual_seed(0)
    model = PlainGPT(256, T, TINY["n_layer"], TINY["n_head"], TINY["d_model"])
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=TINY["lr"],
        betas=(0.9, 0.95),
    )
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else nullcontext()
    rng = np.random.default_rng(0)
    for step in range(args.steps):
        if step == args.warmup:
            began = time.perf_counter()
        starts = rng.integers(0, len(data) - T - 1, size=B)
        chunk = torch.from_numpy(np.stack([data[s : s + T + 1] for s in starts]).astype(np.int64))
        lr = TINY["lr"] * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        with amp:
            loss = model(chunk[:, :-1], chunk[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    loss.item()
    wall = time.perf_counter() - began
    return {"tok_per_s": B * T * (args.steps - args.warmup) / wall, "precision": precision}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="first steps not timed")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each, interleaved")
    parser.add_argument("--precision", default="auto", help="teralm's --precision")
    args = parser.parse_args()
    every = TrainConfig.log_every  # teralm's metrics come every this many steps
    if not 0 < args.warmup < args.steps or args.warmup % every or args.steps % every:
        sys.exit(f"--warmup and --steps: multiples of {every}, warmup below steps")
    jsonl, index = corpus_index("pydocs")
    data = np.fromfile(jsonl, dtype=np.uint8)

    runs: dict[str, list[dict]] = {"with index": [], "without index": [], "plain PyTorch": []}
    load = [os.getloadavg()[0]]
    for _ in range(args.repeats):
        for name, extra in (("with index", []), ("without index", ["--no-index-input"])):
            runs[name].append(teralm_run(index, extra, args))
        precision = runs["without index"][-1]["precision"]
        runs["plain PyTorch"].append(plain_run(data, precision, args))
        print(", ".join(f"{k} {v[-1]['tok_per_s']:,.0f}" for k, v in runs.items()), "tok/s")
        load.append(os.getloadavg()[0])

    rows = []
    for name, results in runs.items():
        best = max(r["tok_per_s"] for r in results)
        rows.append(
            {
                "run": name,
                "precision": results[0]["precision"],
                "tok_per_s": best,
                "s_per_step": TINY["batch_size"] * TINY["seq_len"] / best,
                "all_tok_per_s": [round(r["tok_per_s"]) for r in results],
            }
        )
    with_index, without, plain = (r["tok_per_s"] for r in rows)
    ratios = {
        "with / without index": with_index / without,
        "without index / plain": without / plain,
    }
    print(
        f"tiny preset (B{TINY['batch_size']} x T{TINY['seq_len']}), steps {args.warmup + 1}.."
        f"{args.steps} timed, best of {args.repeats}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}; "
        f"1-min load {', '.join(f'{x:.1f}' for x in load)}"
    )
    print(
        table(
            rows,
            [
                ("run", "run", "s"),
                ("precision", "precision", "s"),
                ("tok_per_s", "tok/s", ",.0f"),
                ("s_per_step", "s/step", ".3f"),
            ],
        )
    )
    print(
        f"with / without index: {ratios['with / without index']:.3f} (target >= 0.9); "
        f"without index / plain: {ratios['without index / plain']:.3f} (target >= 0.95)"
    )
    payload = {"rows": rows, "ratios": ratios, "load": load, "args": vars(args)}
    print(f"wrote {save('bench_train_speed', payload)}")


if __name__ == "__main__":
    main()
