"""The command line: ``build-index`` and ``teralm <command>``, a module per command. Each
module's ``add_parser`` adds its parser, whose ``handler`` default runs the command."""

from __future__ import annotations

import argparse
import sys

from teralm.cli import (
    build_index,
    build_knn,
    evaluate,
    export,
    lighthouse,
    query,
    sample,
    serve,
    train,
    verify,
)
from teralm.cli.build_index import build_index_main

__all__ = ["COMMANDS", "build_index_main", "main"]

# the commands in the order ``teralm --help`` lists them
COMMANDS = {
    "build-index": build_index,
    "verify-index": verify,
    "query": query,
    "train": train,
    "lighthouse": lighthouse,
    "eval": evaluate,
    "build-knn": build_knn,
    "sample": sample,
    "serve": serve,
    "export-fp8": export,
}


def main(argv: list[str] | None = None) -> int:
    """``teralm build-index | verify-index | query | train | lighthouse | eval | build-knn |
    sample | serve | export-fp8``."""
    parser = argparse.ArgumentParser(
        prog="teralm",
        description="teralm: a compact transformer trained and served with a lookup index of "
        "its whole training corpus. Start with: build-index SOURCE, then teralm train.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.add_parser(sub)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given (a launcher repeats it)
    return args.handler(args)
