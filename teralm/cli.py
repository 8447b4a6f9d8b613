"""Command-line entry points: ``build-index`` and ``teralm <command>``."""

from __future__ import annotations

import argparse
import errno
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from teralm import cli_train
from teralm.errors import TeralmError

if TYPE_CHECKING:
    import numpy as np

    from teralm.index import Index


def _add_build_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "source",
        help="enwik8 | enwik9 | stdlib | a text file, folder, .jsonl[.gz], "
        ".parquet, or a Hugging Face dataset name[:split]",
    )
    p.add_argument("--out", type=Path, help="index folder (default: indexes/<source name>)")
    p.add_argument("--tokenizer", default="bytes", help="bytes (default) or bpe:VOCAB")
    p.add_argument("--shard-tokens", type=int, default=1 << 25, help="tokens per shard (2^25)")
    p.add_argument("--max-match", type=int, default=32, help="cap on stored match length (32)")
    p.add_argument(
        "--workers",
        type=int,
        default=min(os.cpu_count() or 1, 8),
        help="processes for the sort and feature passes",
    )
    p.add_argument(
        "--memory",
        help="memory budget of the build, e.g. 2G or 512M (default: half of the RAM, or of "
        "the cgroup's limit); it sets the size of the merge jobs and how many run at once",
    )
    p.add_argument("--text-field", default="text", help="text field of JSONL/Parquet/HF records")
    p.add_argument(
        "--verify-samples",
        type=int,
        default=16,
        help="positions checked against brute force at the end",
    )
    p.add_argument("--force", action="store_true", help="replace a different index in --out")
    p.add_argument(
        "--cluster",
        metavar="ADDRESS",
        help="run the sort and feature jobs as tasks of the Ray cluster at ADDRESS (its head's "
        "host:port, or auto); --out must be on a filesystem that every node shares, at the same "
        "path, and --workers is how many jobs run at once (needs pip install teralm[cluster])",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _default_out(source: str) -> Path:
    name = Path(source.rstrip("/")).name.split(".")[0].replace(":", "-") or "index"
    return Path("indexes") / name


SMALL_SHARD = 1 << 16  # below this, per-shard costs dominate a build


def _fail(prog: str, message: str) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 1


def _run_build(args: argparse.Namespace, prog: str) -> int:
    import lmdb

    from teralm.build_index.builder import (
        BuildConfig,
        build,
        default_memory,
        format_summary,
        parse_size,
    )

    try:
        memory = parse_size(args.memory) if args.memory else default_memory()
    except TeralmError as e:
        return _fail(prog, str(e))
    config = BuildConfig(
        source=args.source,
        out=args.out or _default_out(args.source),
        tokenizer=args.tokenizer,
        shard_tokens=args.shard_tokens,
        max_match=args.max_match,
        workers=args.workers,
        memory=memory,
        force=args.force,
        text_field=args.text_field,
        verify_samples=args.verify_samples,
        progress=not args.quiet,
        cluster=args.cluster,
    )
    if 0 < config.shard_tokens < SMALL_SHARD:
        print(
            f"{prog}: warning: --shard-tokens {config.shard_tokens:,} is small: every shard has "
            "its own files, sort and merge run, so a corpus of many shards builds slowly (the "
            f"default is {BuildConfig.shard_tokens:,})",
            file=sys.stderr,
        )
    began = time.perf_counter()
    try:
        result = build(config)
    except TeralmError as e:
        return _fail(prog, str(e))
    except KeyboardInterrupt:
        return _fail(prog, "interrupted; run the same command again to resume")
    except OSError as e:
        if e.errno == errno.ENOSPC:
            return _fail(
                prog,
                f"disk full writing {e.filename or config.out}; free some space and "
                "run the same command again to resume",
            )
        return _fail(prog, f"{e.strerror or e} ({e.filename or config.out})")
    except lmdb.Error as e:
        return _fail(
            prog,
            f"catalog {config.out / 'catalog.lmdb'}: {e}; if the disk is full, "
            "free some space and run the same command again to resume",
        )
    print(format_summary(result, config.out, time.perf_counter() - began))
    return 0


def _run_verify(args: argparse.Namespace) -> int:
    from teralm.build_index.verify import verify_index
    from teralm.index import format as fmt

    if args.samples < 0:
        return _fail("teralm verify-index", f"--samples must be 0 or more, not {args.samples}")
    try:
        m = fmt.read_manifest(args.index)
    except TeralmError as e:
        return _fail("teralm verify-index", str(e))
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


def _run_query(args: argparse.Namespace) -> int:
    from teralm.index import Index

    try:
        ix = Index.open(args.index)
        # the argument's bytes as given (Python hands bytes that are not UTF-8 over as surrogates)
        _print_query(ix, ix.encode(os.fsencode(args.text)), args.top, args.sources)
    except UnicodeDecodeError:
        return _fail("teralm query", "the text is not valid UTF-8, which a BPE index needs")
    except TeralmError as e:
        return _fail("teralm query", str(e))
    return 0


def _print_query(ix: Index, context: np.ndarray, top: int, sources: int) -> None:
    """The longest match of ``context``, its next tokens and the documents that hold it."""
    found = ix.query.lookup(context, top_k=top, sources=sources)
    length, count = found.length, found.count
    matched = ix.decode(context[len(context) - length :]) if length else ""
    print(f"longest match: {length} of {len(context)} tokens, {count:,} occurrences: {matched!r}")
    if len(found.tokens):
        print("next token      probability   count")
    for token, n in zip(found.tokens, found.counts):
        print(f"  {ix.decode([int(token)])!r:<14} {n / count:10.3f} {n:8,}")
    for hit in found.documents:
        snippet = " ".join(hit["snippet"].split())
        print(f"[doc {hit['document']}] {hit['source']} @ {hit['offset']}: {snippet[:100]!r}")


def build_index_main(argv: list[str] | None = None) -> int:
    """``build-index SOURCE [options]``."""
    parser = argparse.ArgumentParser(
        prog="build-index",
        description="Build the sharded, resumable causal lookup index of a corpus.",
    )
    _add_build_args(parser)
    return _run_build(parser.parse_args(argv), "build-index")


def main(argv: list[str] | None = None) -> int:
    """``teralm build-index | verify-index | query | train | eval | sample | build-knn | serve |
    export-fp8 | lighthouse``."""
    parser = argparse.ArgumentParser(
        prog="teralm",
        description="teralm: a compact transformer trained and served with a lookup index of "
        "its whole training corpus. Start with: build-index SOURCE, then teralm train.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_build_args(sub.add_parser("build-index", help="build the index of a corpus"))
    v = sub.add_parser("verify-index", help="check an index: checksums, order, features")
    v.add_argument("index", type=Path)
    v.add_argument("--samples", type=int, default=64)
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--no-checksums", action="store_true")
    v.add_argument("--quiet", action="store_true")
    q = sub.add_parser("query", help="longest match, next tokens and sources of a text")
    q.add_argument("index", type=Path)
    q.add_argument("text")
    q.add_argument("--top", type=int, default=5, help="continuations to show")
    q.add_argument("--sources", type=int, default=3, help="documents to show")
    cli_train.add_parsers(sub)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given (a launcher repeats it)
    if args.command in cli_train.COMMANDS:
        return cli_train.COMMANDS[args.command](args)
    if args.command == "build-index":
        return _run_build(args, "teralm build-index")
    if args.command == "query":
        return _run_query(args)
    return _run_verify(args)


if __name__ == "__main__":
    sys.exit(main())
