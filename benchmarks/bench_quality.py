"""Quality benchmark: held-out bits per byte with and without the index input, on three corpora.

    pip install -e .
    python benchmarks/bench_quality.py [--corpus headers manpages pydocs] [--steps N]
        [--max-tokens 100000] [--precision auto] [--size tiny|4x] [--set KEY=VALUE ...]

For each corpus (pydocs from the team's shared data; manpages, this machine's manual pages
rendered by make_manpages.py; headers, its C and C++ headers taken by make_headers.py), builds
its byte index (documents with id % 50 == 0 are held out by the trainer), trains the ``tiny`` preset twice with equal steps and tokens (index input on,
then off), and scores both on the held-out documents: the models, the ∞-gram alone and the
interpolations, also by the stored match length of each context. Prints a table per corpus and
writes benchmarks/results/bench_quality.json. ``--size 4x``: the scale check, a model about four
times the tiny preset's parameters (7 layers of width 384: 12.7M parameters against 3.4M) trained
for a quarter of its steps, so in about the same CPU time; writes bench_quality_4x.json.
``--set index_dropout=0.3``: a training setting other than the preset's, for an A/B (or a
``[model]`` one: ``--set index_followers=0 --set window_order=0`` trains the preset as it was
before it read the counted answers; the run without the index drops what needs the index
input).
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import fields
from pathlib import Path

from common import CORPORA, corpus_index, quality_work, save, table, teralm_cli

from teralm.model import ModelConfig
from teralm.train.config import PRESETS
from teralm.train.report import read_metrics

RUNS = {"with index": ("run-index", []), "without index": ("run-noindex", ["--no-index-input"])}
# the scale check's model: about 4x the tiny preset's parameters, for a quarter of its steps
SIZES = {"tiny": ({}, 1), "4x": ({"n_layer": 7, "d_model": 384, "n_head": 6}, 4)}


def train_args(size: str, settings: dict, folder: Path, steps: int | None) -> list[str]:
    """The ``teralm train`` arguments for a model size and training ``settings``: the tiny
    preset, or a TOML file (written in ``folder``) of the tiny preset with the larger model and
    fewer steps, and the settings."""
    model, fewer = SIZES[size]
    if not model and not settings:
        return ["--preset", "tiny", *(["--max-steps", steps] if steps else [])]
    tiny = PRESETS["tiny"]
    model_names = {f.name for f in fields(ModelConfig)}
    model = {**model, **{k: v for k, v in settings.items() if k in model_names}}
    settings = {k: v for k, v in settings.items() if k not in model_names}
    train = {**tiny["train"], "max_steps": steps or tiny["train"]["max_steps"] // fewer, **settings}
    tables = {"model": {**tiny["model"], **model}, "train": train}
    text = "".join(
        f"[{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items())
        for name, values in tables.items()
    )
    path = folder / f"{size}.toml"
    path.write_text(text)
    return ["--config", path]


def setting(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` of ``--set``: the value as JSON (a number, true, false), else a string."""
    key, equals, value = text.partition("=")
    if not key or not equals:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE, e.g. index_dropout=0.3")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def train_and_score(corpus: str, args: argparse.Namespace) -> dict:
    """Both runs of one corpus, trained and scored: ``eval --json`` with the run's config and
    training time."""
    _, index = corpus_index(corpus)
    results = {}
    work = quality_work(corpus)
    shape = train_args(args.size, dict(args.set), work, args.steps)
    for name, (folder, extra) in RUNS.items():
        run = work / (folder if args.size == "tiny" else f"{folder}-{args.size}")
        shutil.rmtree(run, ignore_errors=True)
        cmd = ["train", "--index", index, "--out", run, *shape, "--quiet"]
        print(teralm_cli(*cmd, "--precision", args.precision, *extra))
        scored = teralm_cli(
            "eval", run, "--index", index, "--max-tokens", args.max_tokens, "--json", "--quiet"
        )
        results[name] = {
            **json.loads(scored),
            "train": json.loads((run / "config.json").read_text()),
            "train_wall_s": read_metrics(run)[-1]["elapsed_s"],
        }
    return results


def report(corpus: str, results: dict) -> dict:
    """Print one corpus's tables; its rows and ratios."""
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
    precision = with_index["train"]["precision"]["precision"]
    model = with_index["train"]["config"]["model"]
    shape = f"{model['n_layer']} layers of {model['d_model']}"
    steps = with_index["train"]["config"]["train"]["max_steps"]
    print(
        f"\n{corpus}: {with_index['tokens']:,} held-out bytes; {shape}, {steps} steps, {precision}"
    )
    print(table(rows, [("system", "system", "s"), ("bpb", "bpb", ".4f")]))
    breakdowns = {}
    for name, label in (("by_match", "stored match length"), ("by_count", "∞-gram count")):
        groups = [
            {
                "range": w["range"],
                "share": 100 * w["share"],
                "without": wo["model"],
                "with": w["model"],
                "with_alone": w["model_alone"],
                "interpolated": wo["interpolated"],
            }
            for w, wo in zip(with_index[name], without[name], strict=True)
        ]
        breakdowns[name] = groups
        print(f"by {label}:")
        print(
            table(
                groups,
                [
                    ("range", label, "s"),
                    ("share", "% tokens", ".1f"),
                    ("without", "without index", ".4f"),
                    ("with", "with index", ".4f"),
                    ("with_alone", "with, own head", ".4f"),
                    ("interpolated", "without + ∞-gram", ".4f"),
                ],
            )
        )
    ratios = {
        "with / without": with_index["model"] / without["model"],
        "with / best interpolation of the plain model": with_index["model"]
        / without["interpolated"],
    }
    print(
        f"with / without index: {ratios['with / without']:.3f} (target <= 0.75); with index / "
        f"best interpolation of the plain model: "
        f"{ratios['with / best interpolation of the plain model']:.3f} (target <= 0.97)"
    )
    return {"rows": rows, **breakdowns, "ratios": ratios, "runs": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", nargs="+", choices=sorted(CORPORA), default=sorted(CORPORA))
    parser.add_argument("--steps", type=int, default=None, help="default: the size's")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument(
        "--set", type=setting, action="append", default=[], metavar="KEY=VALUE",
        help="a [train] or [model] setting for both runs, e.g. index_dropout=0.3 (repeatable)",
    )  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=100_000)
    parser.add_argument("--precision", default="auto")
    args = parser.parse_args()
    payload = {corpus: report(corpus, train_and_score(corpus, args)) for corpus in args.corpus}
    name = "bench_quality" if args.size == "tiny" else f"bench_quality_{args.size}"
    print(f"wrote {save(name, payload)}")


if __name__ == "__main__":
    main()
