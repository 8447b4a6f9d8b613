"""``teralm eval``: held-out bits per byte (or perplexity) of a run: the model, the ∞-gram and
their mixtures."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from teralm.cli.common import add_index_memory, add_precision, fail, load_run, open_knn
from teralm.errors import ConfigError, TeralmError


def add_parser(sub) -> None:
    """``teralm eval``."""
    e = sub.add_parser("eval", help="held-out bpb / perplexity: model, ∞-gram, interpolation")
    e.add_argument("run", type=Path, help="run folder (or fp8 export)")
    e.add_argument("--index", type=Path, required=True)
    add_index_memory(e)
    e.add_argument("--max-tokens", type=int, default=100_000, help="held-out targets to score")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.add_argument(
        "--knn",
        type=Path,
        help="also mix in this kNN datastore (build-knn); scores the held-out documents that "
        "its calibration did not see",
    )
    e.add_argument(
        "--allow-other-index",
        action="store_true",
        help="score with an index other than the run's training one (its held-out documents "
        "may hold training text: the score is then not a held-out one)",
    )
    e.add_argument("--quiet", action="store_true")
    add_precision(e)
    e.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from teralm.index import Index
    from teralm.infer.precision import default_device
    from teralm.train.evaluate import (
        best_lambda,
        document_windows,
        held_out_documents,
        score,
        summarize,
    )

    try:
        ix = Index.open(args.index, args.index_memory)
        device = default_device()
        model, state, _ = load_run(args, device)
        if model.cfg.vocab_size != ix.vocab_size:
            raise ConfigError("the run's vocabulary differs from the index's")
        other = ix.differs_from(state.get("index") or {})
        if other and not args.allow_other_index:
            raise ConfigError(
                f"{args.index} is not the index the run was trained on ({', '.join(other)} "
                "differ), so its held-out documents may hold training text; score with the "
                "training index, or add --allow-other-index for a score that is not held-out"
            )
        holdout = state["config"]["train"]["holdout_every"]
        knn = open_knn(args, ix)

        def scored(part: str, with_knn=None):
            docs = held_out_documents(ix, holdout, part)
            windows = list(document_windows(ix, docs, model.cfg.max_seq_len, args.max_tokens))
            return score(ix, model, windows, device, progress=not args.quiet, knn=with_knn)

        split = bool(held_out_documents(ix, holdout, "validation"))
        lam = best_lambda(scored("validation")) if split else None  # else the oracle's
        scores = scored("test" if split else "all", knn)
    except TeralmError as e:
        return fail("teralm eval", str(e))
    calibration = knn.calibration if knn else None
    byte_level = ix.manifest["tokenizer"] == "bytes"
    result = summarize(scores, ix.vocab_size, byte_level, calibration, lam)
    result["lambda_from"] = "validation" if split else "the scored text (no validation documents)"
    result["held_out"] = not other
    if args.json:
        print(json.dumps(result))
        return 0
    print_eval(result, holdout, split, other, model.mixture_gate is not None, knn is not None)
    return 0


def print_eval(result: dict, holdout: int, split: bool, other, mixed: bool, knn: bool) -> None:
    """``teralm eval``'s table: each system's score, then the scores by match and count band."""
    unit, which = result["metric"], "the test half of the " if split else ""
    print(
        f"{'held-out' if not other else 'NOT held-out (another index than the training one)'} "
        f"{unit} on {result['tokens']:,} tokens ({which}documents with id % {holdout} == 0)"
    )
    served = "model + ∞-gram as served" if mixed else "model"
    rows = [(served, result["model"])]
    if mixed:
        rows.append(("model alone (no ∞-gram mixture)", result["model_alone"]))
    rows += [
        ("∞-gram alone", result["infgram"]),
        (
            f"model + ∞-gram, λ={result['lambda']:.2f} ({result['lambda_from']})",
            result["interpolated"],
        ),
        (
            f"model + ∞-gram, λ={result['lambda_oracle']:.2f} (oracle)",
            result["interpolated_oracle"],
        ),
    ]
    if knn:
        rows.append((f"{served} + kNN", result["model_knn"]))
        if mixed:
            rows.append(("model alone + kNN", result["model_alone_knn"]))
    for label, value in rows:
        print(f"  {label:<40} {value:.4f}")
    for name, label, what in (
        ("by_match", "the stored match length of the context", "match"),
        ("by_count", "the ∞-gram's count of occurrences", "count"),
    ):
        print(f"by {label}: {served}, model alone, λ={result['lambda']}")
        for group in result[name]:
            print(
                f"  {what} {group['range']:>7} ({group['share']:6.1%} of tokens)  "
                f"{group['model']:.4f}  {group['model_alone']:.4f}  {group['interpolated']:.4f}"
            )
