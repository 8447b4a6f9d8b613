"""What the commands share: one-line errors, argument types and flags, and loading a run."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from teralm.errors import TeralmError
from teralm.model.config import AUTO, PRECISIONS


def fail(prog: str, message: str) -> int:
    """Print ``PROG: error: MESSAGE`` on stderr; the exit code of a refused command."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 1


def count(text: str) -> int:
    """An argparse type: an int of 0 or more."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is below 0")
    return value


def positive(kind: type) -> Callable[[str], int | float]:
    """An argparse type: a number of ``kind`` above 0."""

    def parse(text: str) -> int | float:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text} is not above 0")
        return value

    parse.__name__ = kind.__name__  # argparse's "invalid int value" names it
    return parse


def memory_size(text: str) -> int:
    """An argparse type: a size such as 2G, or 0."""
    from teralm.build_index.builder import parse_size

    if text.strip() == "0":
        return 0
    try:
        return parse_size(text, "--index-memory")
    except TeralmError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_index_memory(parser: argparse.ArgumentParser) -> None:
    """``--index-memory SIZE``: how much of the index to hold in memory (``Index.open``)."""
    parser.add_argument(
        "--index-memory",
        type=memory_size,
        default=0,
        metavar="SIZE",
        help="read this much of the index into memory up front (e.g. 2G; 0, the default: none), "
        "the files lookups read most first: key samples, then tokens, followers, positions",
    )


def add_precision(parser: argparse.ArgumentParser, generating: bool = False) -> None:
    auto = (
        "auto: bf16 on a GPU, fp32 on every CPU (its fused decoder)"
        if generating
        else "auto: bf16 on a GPU, and on a CPU with native bf16 where it measures faster; "
        "else fp32"
    )
    parser.add_argument("--precision", choices=(AUTO, *PRECISIONS), help=auto)


def add_knn(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--knn",
        type=Path,
        help="mix in this kNN datastore of the run's hidden states (build-knn), with the index",
    )


def add_speculate(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--speculate",
        type=count,
        help="tokens drafted from the index per step and checked in the same forward (0: none;"
        " default: 8 where the fused CPU decoder runs, else 0); greedy output is unchanged, sampled output keeps its distribution",
    )


def load_run(args: argparse.Namespace, device, generating: bool = False):
    """The run's model in the precision asked for (a warning when it will be slow here)."""
    from teralm.infer.load import load_model

    model, state, choice = load_model(args.run, device, args.precision or "auto", generating)
    if choice.warning:
        print(f"warning: {choice.warning}", file=sys.stderr)
    return model, state, choice


def open_knn(args: argparse.Namespace, ix):
    """The datastore of ``--knn`` for the run (None without the flag); ConfigError if it was
    built from another index or other weights."""
    if not args.knn:
        return None
    from teralm.index.knn import KnnDatastore
    from teralm.model.checkpoint import weights_sha256

    return KnnDatastore.open(args.knn, ix, weights_sha256(args.run))
