"""``teralm export-fp8``: write a run's model with fp8 weights."""

from __future__ import annotations

import argparse
from pathlib import Path

from teralm.cli.common import fail
from teralm.errors import TeralmError


def add_parser(sub) -> None:
    """``teralm export-fp8``."""
    x = sub.add_parser("export-fp8", help="write a run's model with fp8 weights")
    x.add_argument("run", type=Path)
    x.add_argument("--out", type=Path, required=True)
    x.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from teralm.infer.load import load_model
    from teralm.model import checkpoint

    if checkpoint.is_fp8_export(args.run):
        return fail("teralm export-fp8", f"{args.run} is an fp8 export already")
    try:
        model, state, _ = load_model(args.run, torch.device("cpu"), "fp32")
    except TeralmError as e:
        return fail("teralm export-fp8", str(e))
    out = checkpoint.export_fp8(model, state, args.out)
    size = (out / checkpoint.EXPORT_WEIGHTS).stat().st_size
    print(f"wrote {out} ({size / 2**20:.1f} MiB for {model.num_parameters():,} parameters)")
    return 0
