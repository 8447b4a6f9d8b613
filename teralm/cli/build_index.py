"""``build-index SOURCE`` (and ``teralm build-index``): build the index of a corpus."""

from __future__ import annotations

import argparse
import errno
import os
import sys
import time
from pathlib import Path

from teralm.cli.common import fail
from teralm.errors import TeralmError


def add_parser(sub) -> None:
    b = sub.add_parser("build-index", help="build the index of a corpus")
    add_build_args(b)
    b.set_defaults(handler=run)


def add_build_args(p: argparse.ArgumentParser) -> None:
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


def default_out(source: str) -> Path:
    name = Path(source.rstrip("/")).name.split(".")[0].replace(":", "-") or "index"
    return Path("indexes") / name


SMALL_SHARD = 1 << 16  # below this, per-shard costs dominate a build


def run(args: argparse.Namespace, prog: str = "teralm build-index") -> int:
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
        return fail(prog, str(e))
    config = BuildConfig(
        source=args.source,
        out=args.out or default_out(args.source),
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
        return fail(prog, str(e))
    except KeyboardInterrupt:
        return fail(prog, "interrupted; run the same command again to resume")
    except OSError as e:
        if e.errno == errno.ENOSPC:
            return fail(
                prog,
                f"disk full writing {e.filename or config.out}; free some space and "
                "run the same command again to resume",
            )
        return fail(prog, f"{e.strerror or e} ({e.filename or config.out})")
    except lmdb.Error as e:
        return fail(
            prog,
            f"catalog {config.out / 'catalog.lmdb'}: {e}; if the disk is full, "
            "free some space and run the same command again to resume",
        )
    print(format_summary(result, config.out, time.perf_counter() - began))
    return 0


def build_index_main(argv: list[str] | None = None) -> int:
    """``build-index SOURCE [options]``."""
    parser = argparse.ArgumentParser(
        prog="build-index",
        description="Build the sharded, resumable causal lookup index of a corpus.",
    )
    add_build_args(parser)
    return run(parser.parse_args(argv), "build-index")
