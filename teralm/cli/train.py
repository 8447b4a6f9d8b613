"""``teralm train``: train a model with index lookup (one process, torchrun's, or DiLoCo workers)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from teralm.cli.common import add_index_memory, add_precision, count, fail, positive
from teralm.errors import TeralmError
from teralm.train.config import PRESETS, SETTING_GROUPS, DilocoSettings, TrainConfig


def add_parser(sub) -> None:
    t = sub.add_parser(
        "train",
        help="train a model with index lookup",
        description="Train a model with index lookup. The flags of the training settings "
        "override the preset's (tiny, unless --preset or --config says otherwise); a setting "
        "that neither sets takes the default shown.",
    )
    run_options(t)
    groups = setting_flags(t)
    worker_options(groups[DilocoSettings])
    t.add_argument("--quiet", action="store_true")
    t.set_defaults(handler=run)


def run_options(t: argparse.ArgumentParser) -> None:
    """``teralm train``'s run, config and model flags."""
    t.add_argument("--index", type=Path, required=True, help="index folder (build-index)")
    t.add_argument("--out", type=Path, required=True, help="run folder")
    add_index_memory(t)
    group = t.add_mutually_exclusive_group()
    group.add_argument("--preset", choices=list(PRESETS), default=None)
    group.add_argument("--config", type=Path, help="TOML file with [model] and [train] tables")
    t.add_argument("--resume", action="store_true", help="continue the run in --out")
    t.add_argument("--no-index-input", action="store_true", help="ablation: no index features")
    add_precision(t)


def setting_flags(t: argparse.ArgumentParser) -> dict[type, argparse._ArgumentGroup]:
    """A flag for every training setting (``teralm.train.config``), in a group per settings
    group, with the setting's help and default; the groups by settings class."""
    groups = {}
    for cls in SETTING_GROUPS:
        title, _, _ = cls.__doc__.partition("\n")
        group = groups[cls] = t.add_argument_group(title.rstrip("."))
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            shown = f"{f.metadata['help']} (default: {f.default})"
            if isinstance(f.default, bool):
                group.add_argument(flag, action=argparse.BooleanOptionalAction, help=shown)
                continue
            kind, choices = type(f.default), f.metadata["choices"] or None
            metavar = None if choices else {int: "N", float: "X"}[kind]
            group.add_argument(flag, type=kind, choices=choices, metavar=metavar, help=shown)
    return groups


def given_settings(args: argparse.Namespace) -> dict:
    """The training settings given as flags."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    return {name: value for name, value in given.items() if value is not None}


def worker_options(d: argparse._ArgumentGroup) -> None:
    """``teralm train``'s flags of a DiLoCo worker's place."""
    d.add_argument(
        "--lighthouse",
        help="auto: start a lighthouse and --replicas workers here; or a lighthouse's URL, to "
        "run one worker (with --replica-id)",
    )
    d.add_argument("--replica-id", type=count, default=0, help="this worker's number (0)")
    d.add_argument(
        "--advertise",
        help="address the other workers reach this one at (default: 127.0.0.1 with a local "
        "lighthouse, else this machine's name)",
    )
    d.add_argument(
        "--outer-timeout",
        type=positive(float),
        default=120.0,
        help="seconds to wait for a quorum or an exchange (120)",
    )


def run(args: argparse.Namespace) -> int:
    """``teralm train``; under torchrun, the process ends as soon as it is done."""
    code = train_run(args)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # The process group is destroyed by now, but gloo's worker threads can still hold
        # tensors, and freeing them while the interpreter shuts down aborts the process
        # (std::terminate) now and then, after all the work is done: skip the shutdown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def train_run(args: argparse.Namespace) -> int:
    from teralm.index import Index
    from teralm.train.config import load_config
    from teralm.train.diloco import WorkerPlace, advertised_host
    from teralm.train.loop import train
    from teralm.train.report import plot_loss, summary
    from teralm.train.run_folder import holds_run, saved_config

    try:
        ix = Index.open(args.index, args.index_memory)
        if args.resume and holds_run(args.out) and not (args.preset or args.config):
            config = saved_config(args.out)
        else:
            config = load_config(args.preset, args.config)
        if args.no_index_input:
            config.model.index_input = False
            config.model.index_followers = config.model.window_order = 0
        if args.precision:
            config.model.precision = args.precision
        config.train = dataclasses.replace(config.train, **given_settings(args))
        worker = None
        if config.train.mode == "diloco" and args.lighthouse == "auto":
            return launch_workers(args, config.train)
        if args.lighthouse:
            worker = WorkerPlace(
                args.lighthouse, args.replica_id,
                advertised_host(args.lighthouse, args.advertise), args.outer_timeout,
            )  # fmt: skip
        result = train(
            ix, config, args.out, resume=args.resume, progress=not args.quiet, worker=worker
        )
    except TeralmError as e:
        return fail("teralm train", str(e))
    except KeyboardInterrupt:
        return fail("teralm train", f"interrupted; continue with --resume (--out {args.out})")
    if result.main:
        plot_loss(args.out)
        print(summary(args.out, result))
    if worker is not None:  # every worker, even a quiet one: the line is the result
        print(
            f"worker {worker.replica}: {result.rounds} rounds, {result.bytes_sent:,} bytes sent; "
            f"global weights sha256 {result.weights_sha256}",
            file=sys.stderr,
        )
    return 0


def launch_workers(args: argparse.Namespace, cfg) -> int:
    """``--lighthouse auto``: a lighthouse and ``replicas`` workers on this machine, each on
    its share of the cores (as torchrun's ``OMP_NUM_THREADS``) unless threads are set."""
    from teralm.train.diloco import launch_local, worker_threads

    argv, given = [], iter(args.argv)
    for arg in given:  # the same command, less --lighthouse auto
        if arg == "--lighthouse":
            next(given, None)
        elif not arg.startswith("--lighthouse="):
            argv.append(arg)
    env = {"OMP_NUM_THREADS": str(worker_threads(cfg.replicas)), **os.environ}
    return launch_local(argv, cfg.replicas, cfg.min_replicas, args.quiet, env)
