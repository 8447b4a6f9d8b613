"""``teralm lighthouse``: coordinate DiLoCo workers on several machines."""

from __future__ import annotations

import argparse

from teralm.cli.common import fail, positive
from teralm.errors import TeralmError


def add_parser(sub) -> None:
    """``teralm lighthouse``."""
    h = sub.add_parser("lighthouse", help="coordinate DiLoCo workers on several machines")
    h.add_argument(
        "--bind",
        default="127.0.0.1:29510",
        help="HOST:PORT to listen on (0.0.0.0:29510 for workers on other machines)",
    )
    h.add_argument("--min-replicas", type=positive(int), default=1, help="workers a round needs")
    h.add_argument(
        "--join-timeout",
        type=positive(float),
        default=10.0,
        help="seconds a new quorum waits for workers that are up but not yet asking",
    )
    h.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """``teralm lighthouse``: coordinate DiLoCo workers until interrupted."""
    import time

    from teralm.train.diloco import lighthouse_server

    try:
        with lighthouse_server(args.bind, args.min_replicas, args.join_timeout) as url:
            print(f"lighthouse at {url}: start workers with --lighthouse {url}", flush=True)
            while True:
                time.sleep(3600)
    except (TeralmError, RuntimeError) as e:
        return fail("teralm lighthouse", str(e))
    except KeyboardInterrupt:
        return 0
