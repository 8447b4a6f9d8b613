"""``teralm verify-index INDEX``: check an index's checksums, order and features."""

from __future__ import annotations

import argparse
from pathlib import Path

from teralm.cli.common import fail
from teralm.errors import TeralmError


def add_parser(sub) -> None:
    v = sub.add_parser("verify-index", help="check an index: checksums, order, features")
    v.add_argument("index", type=Path)
    v.add_argument("--samples", type=int, default=64)
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--no-checksums", action="store_true")
    v.add_argument("--quiet", action="store_true")
    v.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from teralm.build_index.verify import verify_index
    from teralm.index import format as fmt

    if args.samples < 0:
        return fail("teralm verify-index", f"--samples must be 0 or more, not {args.samples}")
    try:
        m = fmt.read_manifest(args.index)
    except TeralmError as e:
        return fail("teralm verify-index", str(e))
    try:
        problems = verify_index(
            args.index, m, args.samples, args.seed, not args.no_checksums, not args.quiet
        )
    except OSError as e:  # e.g. a file without read permission
        problems = [f"cannot read the index files: {e}"]
    for p in problems:
        print(f"FAIL {p}")
    checked = "sizes and checksums, " if not args.no_checksums else "sizes, "
    print(
        f"{args.index}: {checked}{args.samples} sorted pairs per shard and {args.samples} "
        f"positions against brute force: {'OK' if not problems else f'{len(problems)} problem(s)'}"
    )
    return 0 if not problems else 1
