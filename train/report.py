"""The end of a run: loss curve PNG and a one-screen summary."""

from __future__ import annotations

import json
import os
from pathlib import Path

from teralm.model import checkpoint
from teralm.train.loop import TrainResult
from teralm.train.metrics import METRICS


def read_metrics(run: Path) -> list[dict]:
    path = run / METRICS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_loss(run: Path) -> Path | None:
    """``RUN/loss.png`` from ``metrics.jsonl`` (written atomically); None without metrics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run)
    if not records:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(run.name)
    ax.grid(alpha=0.3)
    tmp = run / "loss.png.tmp"
    fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, run / "loss.png")
    return run / "loss.png"


def summary(run: Path, result: TrainResult) -> str:
    records = read_metrics(run)
    rate = records[-1]["tok_per_s"] if records else 0.0
    return "\n".join(
        [
            f"run        {run}",
            f"parameters {result.parameters:,}",
            f"steps      {result.steps} (stopped at {result.stopped})",
            f"tokens     {result.tokens:,}",
            f"loss       {result.final_loss:.4f} nats/token (last step)",
            f"speed      {rate:,.0f} tokens/s (last interval)",
            f"wall       {result.wall_s:.1f} s",
            *(
                [f"sent       {result.bytes_sent:,} bytes by this process to the others"]
                if result.bytes_sent
                else []
            ),
            f"files      {run / METRICS}, {run / 'loss.png'}, {run / checkpoint.LATEST}",
        ]
    )
