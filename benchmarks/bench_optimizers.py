"""Memory-lean training: AdamW, GaLore and 8-bit GaLore beside galore-torch, in one run.

    pip install -e '.[bench]'
    python benchmarks/bench_optimizers.py [--steps 300] [--max-tokens 100000]

Part 1, optimizer state: the bytes of every tensor each optimizer keeps (moments, projections,
scales, steps), after one step with random gradients, for the ``tiny``, ``125m`` and ``1.5b``
shapes at GaLore rank = width / 4. ``125m`` and ``tiny`` are measured whole; ``1.5b`` from a
2-block model of its width, its block matrices' state times its block count (every block has the
same shapes), so that the machine need not hold 1.5B parameters and their AdamW moments.

Part 2, loss and speed: the ``tiny`` preset trained on pydocs with the index for ``--steps``
steps with each optimizer, offloaded and per layer (``VARIANTS``; per layer without clipping),
and galore-torch's GaLoreAdamW given the same parameter groups, rank, gap and scale; then held-out bits per byte (``teralm eval``), tokens/s and peak memory of the
training process. galore-torch's GaLoreAdamW8bit needs CUDA (bitsandbytes), so it is in part 1
and 2 only where a GPU is.

Prints tables and writes benchmarks/results/bench_optimizers.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from common import CACHE, corpus_index, run_measured, save, table, teralm_cli

from teralm.index import Index
from teralm.model import Transformer
from teralm.train.config import PRESETS, RunConfig
from teralm.train.optim import galore_groups, make_optimizer
from teralm.train.report import read_metrics

WORK = CACHE / "optimizers"
OURS = ("adamw", "galore", "galore8bit")
PEERS = ("galore-torch",)
MIB = 2**20


def peer_optimizer(model: torch.nn.Module, cfg) -> torch.optim.Optimizer:
    """galore-torch's GaLoreAdamW on teralm's GaLore groups (its own key names)."""
    from galore_torch import GaLoreAdamW

    groups = []
    for group in galore_groups(model, cfg):
        if "rank" in group:
            group = {
                "params": group["params"], "weight_decay": group["weight_decay"],
                "rank": group["rank"], "update_proj_gap": group["gap"],
                "scale": group["scale"], "proj_type": "std",
            }  # fmt: skip
        groups.append(group)
    optimizer = GaLoreAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)
    # its projector objects are not tensors: the run's checkpoints keep no optimizer state
    plain = torch.optim.Optimizer.state_dict
    optimizer.state_dict = lambda: {**plain(optimizer), "state": {}}
    return optimizer


def state_bytes(optimizer: torch.optim.Optimizer, params) -> int:
    """Bytes of the tensors ``optimizer`` keeps for ``params`` (galore-torch's projections
    included)."""
    total = 0
    for p in params:
        for value in optimizer.state.get(p, {}).values():
            if torch.is_tensor(value):
                total += value.numel() * value.element_size()
            elif hasattr(value, "ortho_matrix") and value.ortho_matrix is not None:
                total += value.ortho_matrix.numel() * value.ortho_matrix.element_size()
    return total


def measured_state(preset: str, vocab: int, blocks: int | None) -> dict:
    """Per optimizer, its state bytes for ``preset``'s shape (``blocks``: build that many
    blocks and scale the block matrices' state to the preset's count)."""
    raw = PRESETS[preset]
    model_cfg = {**raw["model"], "precision": "fp32", "vocab_size": vocab}
    if blocks:
        model_cfg["n_layer"] = blocks
    config = RunConfig.from_dict({**raw, "model": model_cfg})
    config.train.galore_rank = 0.25
    torch.manual_seed(0)
    model = Transformer(config.model)
    factor = raw["model"]["n_layer"] / blocks if blocks else 1
    out = {"parameters": 0}
    for name in (*OURS, *PEERS):
        config.train.optimizer = name if name != "galore-torch" else "galore"
        opt = (
            peer_optimizer(model, config.train)
            if name == "galore-torch"
            else make_optimizer(model, config.train)
        )
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        inside = [p for n, p in model.named_parameters() if n.startswith("blocks.")]
        outside = [p for n, p in model.named_parameters() if not n.startswith("blocks.")]
        out[name] = state_bytes(opt, inside) * factor + state_bytes(opt, outside)
        out["parameters"] = sum(p.numel() for p in inside) * factor + sum(
            p.numel() for p in outside
        )
        del opt
    return out


def part_one(vocab: int) -> list[dict]:
    rows = []
    for preset, blocks in (("tiny", None), ("125m", None), ("1.5b", 2)):
        state = measured_state(preset, vocab, blocks)
        row = {"preset": preset, "parameters": state["parameters"]}
        for name in (*OURS, *PEERS):
            row[f"{name}_mib"] = state[name] / MIB
            row[f"{name}_share"] = state[name] / state["adamw"]
        rows.append(row)
        print(f"  {preset}: {state['parameters']:,.0f} parameters", flush=True)
    return rows


def peer_run(index: Path, run: Path, steps: int) -> None:
    """Train the tiny preset with galore-torch's optimizer, in this process."""
    import teralm.train.loop as loop
    from teralm.train.config import load_config

    config = load_config("tiny", None)
    config.train.max_steps, config.train.checkpoint_every = steps, steps
    config.train.optimizer = "galore"  # for its groups and settings; the optimizer is the peer's
    loop.make_optimizer = lambda model, cfg, world=None: peer_optimizer(model, cfg)
    loop.train(Index.open(index), config, run, progress=False)


# training runs of part 2 beside the three optimizers: (label, teralm train flags)
VARIANTS = (
    ("adamw, offload", ["--optimizer", "adamw", "--offload", "optimizer+master"]),
    ("galore8bit, offload", ["--optimizer", "galore8bit", "--offload", "optimizer+master"]),
    ("galore8bit, per layer", ["--optimizer", "galore8bit", "--per-layer-update"]),
)


def finished(run: Path, steps: int) -> bool:
    """Whether ``run`` holds a finished run of ``steps`` steps."""
    try:
        return json.loads((run / "latest.json").read_text())["step"] == steps
    except (OSError, ValueError, KeyError):
        return False


def scored_row(name: str, run: Path, index: Path, max_tokens: int, peak_rss: int | None) -> dict:
    """Held-out bpb, tokens/s and training time of a finished run."""
    scored = json.loads(
        teralm_cli("eval", run, "--index", index, "--max-tokens", max_tokens, "--json", "--quiet")
    )
    metrics = read_metrics(run)
    timed = [r["tok_per_s"] for r in metrics[1:] or metrics]  # past the first interval
    print(f"  {name}: bpb {scored['model']:.4f}", flush=True)
    return {
        "optimizer": name, "bpb": scored["model"], "tok_per_s": sum(timed) / len(timed),
        "peak_rss_mib": peak_rss / MIB if peak_rss else None,
        "train_s": metrics[-1]["elapsed_s"],
    }  # fmt: skip


def part_two(index: Path, steps: int, max_tokens: int, reuse: bool) -> list[dict]:
    no_clip = WORK / "tiny-no-clip.toml"  # per-layer updates cannot clip by global norm
    raw = PRESETS["tiny"]
    no_clip.write_text(
        "[model]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in raw["model"].items())
        + "[train]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in raw["train"].items())
        + "grad_clip = 0.0\n"
    )  # fmt: skip
    runs = [(name, ["--optimizer", name]) for name in OURS] + list(VARIANTS)
    runs += [(name, None) for name in PEERS]
    rows = []
    for name, flags in runs:
        run = WORK / ("run-" + "".join(c if c.isalnum() else "-" for c in name))
        if reuse and finished(run, steps):
            rows.append(scored_row(name, run, index, max_tokens, None))
            continue
        shutil.rmtree(run, ignore_errors=True)
        if flags is None:
            cmd = [sys.executable, __file__, "--peer-run", str(run), "--steps", str(steps)]
        else:
            chosen = ["--config", str(no_clip)] if "--per-layer-update" in flags else [
                "--preset", "tiny",
            ]  # fmt: skip
            cmd = [sys.executable, "-m", "teralm.cli", "train", "--index", str(index), "--out",
                   str(run), *chosen, "--max-steps", str(steps), "--checkpoint-every",
                   str(steps), *flags, "--galore-rank", "0.25", "--quiet"]  # fmt: skip
        measured = run_measured(cmd)
        if measured["returncode"]:
            sys.exit(f"{name} failed:\n{measured['output']}")
        rows.append(scored_row(name, run, index, max_tokens, measured["peak_rss"]))
    for row in rows:
        row["bpb_vs_adamw"] = row["bpb"] / rows[0]["bpb"] - 1
        if PEERS:
            row["speed_vs_peer"] = row["tok_per_s"] / rows[-1]["tok_per_s"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=100_000)
    parser.add_argument(
        "--reuse", action="store_true", help="score runs of part 2 already finished, not retrain"
    )
    parser.add_argument("--peer-run", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    _, index = corpus_index("pydocs")
    if args.peer_run:
        return peer_run(index, args.peer_run, args.steps)
    global PEERS
    try:
        import galore_torch  # noqa: F401
    except ImportError:
        print("galore-torch is not installed (pip install -e '.[bench]'): its rows are left out")
        PEERS = ()
    WORK.mkdir(parents=True, exist_ok=True)
    vocab = Index.open(index).vocab_size

    print("part 1: optimizer state at GaLore rank = width / 4", flush=True)
    state = part_one(vocab)
    columns = [("preset", "preset", "s"), ("parameters", "parameters", ",.0f")]
    for name in (*OURS, *PEERS):
        columns += [(f"{name}_mib", f"{name} MiB", ",.1f"), (f"{name}_share", "of adamw", ".1%")]
    print(table(state, columns))
    print(f"part 2: tiny preset, {args.steps} steps on pydocs with the index", flush=True)
    runs = part_two(index, args.steps, args.max_tokens, args.reuse)
    print(
        table(
            runs,
            [
                ("optimizer", "optimizer", "s"), ("bpb", "held-out bpb", ".4f"),
                ("bpb_vs_adamw", "vs adamw", "+.2%"), ("tok_per_s", "tokens/s", ",.0f"),
                ("speed_vs_peer", "vs galore-torch", ".2f"),
                ("peak_rss_mib", "peak RSS MiB", ",.0f"), ("train_s", "train s", ".0f"),
            ],
        )
    )  # fmt: skip
    print(f"wrote {save('bench_optimizers', {'state': state, 'runs': runs})}")


if __name__ == "__main__":
    main()
