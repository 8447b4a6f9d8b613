"""``teralm build-knn``: the kNN datastore of a run's hidden states."""

from __future__ import annotations

import argparse
from pathlib import Path

from teralm.cli.common import add_precision, fail, positive
from teralm.errors import TeralmError


def add_parser(sub) -> None:
    """``teralm build-knn``."""
    k = sub.add_parser("build-knn", help="the kNN datastore of a run's hidden states")
    k.add_argument("run", type=Path, help="run folder (or fp8 export)")
    k.add_argument("--index", type=Path, required=True, help="the index the run trained on")
    k.add_argument("--out", type=Path, help="datastore folder (default: RUN/knn)")
    k.add_argument(
        "--factory",
        help="faiss index factory string (default: Flat up to 2^18 keys, else OPQ<m>_<2m>,IVF<√keys>,PQ<m> with m = d/8)",
    )
    k.add_argument(
        "--shard-tokens", type=positive(int), default=1 << 22, help="positions per shard (2^22)"
    )
    k.add_argument("--k", type=positive(int), default=32, help="neighbours per query (32)")
    k.add_argument("--nprobe", type=positive(int), default=32, help="IVF lists searched (32)")
    k.add_argument(
        "--validation-tokens",
        type=positive(int),
        default=50_000,
        help="held-out validation tokens the mixture is calibrated on",
    )
    k.add_argument("--force", action="store_true", help="replace a different datastore in --out")
    k.add_argument("--quiet", action="store_true")
    add_precision(k)
    k.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import os

    # OpenMP threads that wait for work sleep instead of spinning (read when torch and faiss
    # load, below): beside another busy process on 2 cores, the model's forward took 108 µs a
    # key spinning and 62 µs sleeping, against 34 µs either way on a quiet machine
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from teralm.train.knn import KnnBuildConfig, build_knn, format_summary

    config = KnnBuildConfig(
        run=args.run,
        index=args.index,
        out=args.out or args.run / "knn",
        factory=args.factory,
        shard_tokens=args.shard_tokens,
        k=args.k,
        nprobe=args.nprobe,
        validation_tokens=args.validation_tokens,
        precision=args.precision or "auto",
        force=args.force,
        progress=not args.quiet,
    )
    try:
        result = build_knn(config)
    except TeralmError as e:
        return fail("teralm build-knn", str(e))
    except KeyboardInterrupt:
        return fail("teralm build-knn", "interrupted; run the same command again to resume")
    print(format_summary(result, config.out))
    return 0
