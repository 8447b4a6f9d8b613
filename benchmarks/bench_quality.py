"""Quality benchmark: held-out bits per byte on pydocs, with and without the index input.

    pip install -e .
    python benchmarks/bench_quality.py [--steps N] [--max-tokens 100000] [--precision auto]

Builds the byte index of all of pydocs (documents with id % 50 == 0 are held out by the trainer),
trains the ``tiny`` preset twice with equal steps and tokens (index input on, then off), and
scores both on the held-out documents: the models, the ∞-gram alone and the interpolations.
Prints a table and writes benchmarks/results/bench_quality.json.
"""

from __future__ import annotations

import argparse
import json
import shutil

from common import CACHE, pydocs_index, save, table, teralm_cli

from teralm.train.report import read_metrics

WORK = CACHE / "quality"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="default: the tiny preset's")
    parser.add_argument("--max-tokens", type=int, default=100_000)
    parser.add_argument("--precision", default="auto")
    args = parser.parse_args()
    _, index = pydocs_index()

    results = {}
    for name, extra in (("with index", []), ("without index", ["--no-index-input"])):
        run = WORK / ("run-index" if not extra else "run-noindex")
        shutil.rmtree(run, ignore_errors=True)
        steps = ["--max-steps", args.steps] if args.steps else []
        cmd = ["train", "--index", index, "--out", run, "--preset", "tiny", "--quiet"]
        print(teralm_cli(*cmd, "--precision", args.precision, *steps, *extra))
        scored = teralm_cli(
            "eval", run, "--index", index, "--max-tokens", args.max_tokens, "--json", "--quiet"
        )
        results[name] = {
            **json.loads(scored),
            "train": json.loads((run / "config.json").read_text()),
        }
        results[name]["train_wall_s"] = read_metrics(run)[-1]["elapsed_s"]

    with_index, without = results["with index"], results["without index"]
    rows = [
        {"system": "model without index", "bpb": without["model"]},
        {"system": "model with index", "bpb": with_index["model"]},
        {"system": "∞-gram alone", "bpb": without["infgram"]},
        {
            "system": f"model without index + ∞-gram (λ={without['lambda']})",
            "bpb": without["interpolated"],
        },
        {
            "system": f"model with index + ∞-gram (λ={with_index['lambda']})",
            "bpb": with_index["interpolated"],
        },
    ]
    ratio = with_index["model"] / without["model"]
    print(
        f"held-out pydocs bytes: {with_index['tokens']:,} targets; tiny preset, "
        f"{args.precision}, equal steps and tokens"
    )
    print(table(rows, [("system", "system", "s"), ("bpb", "bpb", ".4f")]))
    print(
        f"with / without index: {ratio:.3f} (target <= 0.75); "
        f"with index vs best interpolation of the plain model: "
        f"{with_index['model']:.4f} vs {without['interpolated']:.4f}"
    )
    print(f"wrote {save('bench_quality', {'rows': rows, 'ratio': ratio, 'runs': results})}")


if __name__ == "__main__":
    main()
