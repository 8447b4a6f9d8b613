"""``teralm train | eval | sample | build-knn | serve | export-fp8 | lighthouse``: the model
side of the command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from teralm.errors import ConfigError, TeralmError
from teralm.model.config import AUTO, PRECISIONS
from teralm.train.config import (
    COMMS,
    MODES,
    OFFLOADS,
    ONEBIT_TARGETS,
    OPTIMIZERS,
    OUTER_COMPRESSIONS,
    PRESETS,
)


def add_parsers(sub) -> None:
    """The model side's commands, on the ``teralm`` parser's subcommands."""
    train = sub.add_parser("train", help="train a model with index lookup")
    _train_options(train)
    _exchange_options(train)
    _diloco_options(train.add_argument_group(
        "DiLoCo (--mode diloco): workers that train apart and meet seldom"
    ))  # fmt: skip
    train.add_argument("--quiet", action="store_true")
    _lighthouse_parser(sub)
    _eval_parser(sub)
    _build_knn_parser(sub)
    _sample_parser(sub)
    _serve_parser(sub)
    _export_parser(sub)


def _train_options(t: argparse.ArgumentParser) -> None:
    """``teralm train``'s run, data, model and schedule flags."""
    t.add_argument("--index", type=Path, required=True, help="index folder (build-index)")
    t.add_argument("--out", type=Path, required=True, help="run folder")
    add_index_memory(t)
    group = t.add_mutually_exclusive_group()
    group.add_argument("--preset", choices=list(PRESETS), default=None)
    group.add_argument("--config", type=Path, help="TOML file with [model] and [train] tables")
    t.add_argument("--resume", action="store_true", help="continue the run in --out")
    t.add_argument("--no-index-input", action="store_true", help="ablation: no index features")
    _add_precision(t)
    t.add_argument("--max-steps", type=int)
    t.add_argument("--max-minutes", type=float)
    t.add_argument("--checkpoint-every", type=int, help="steps between checkpoints")
    t.add_argument("--seed", type=int)
    t.add_argument("--batch-size", type=int, help="the global batch, split over the processes")
    t.add_argument("--lr", type=float, help="peak learning rate (the preset's)")


def _exchange_options(t: argparse.ArgumentParser) -> None:
    """``teralm train``'s optimizer and gradient-exchange flags."""
    t.add_argument(
        "--comm", choices=COMMS, help="how torchrun's processes agree each step (allreduce)"
    )
    t.add_argument("--demo-chunk", type=int, help="DeMo: chunk size of the DCT (64)")
    t.add_argument("--demo-topk", type=int, help="DeMo: components sent per chunk (32)")
    t.add_argument("--demo-beta", type=float, help="DeMo: momentum (0.999)")
    t.add_argument("--onebit-warmup", type=int, help="1-bit: steps of plain all-reduce first (50)")
    t.add_argument("--onebit-block", type=int, help="1-bit: values sharing one scale (256)")
    t.add_argument(
        "--onebit-target", choices=ONEBIT_TARGETS,
        help="1-bit: what the messages carry (momentum: AdamW's, 1-bit Adam's way)",
    )  # fmt: skip
    t.add_argument("--optimizer", choices=OPTIMIZERS, help="adamw, or GaLore's (adamw)")
    t.add_argument(
        "--galore-rank", type=float, help="GaLore: rank, or a fraction of the width (0.25)"
    )
    t.add_argument("--galore-gap", type=int, help="GaLore: steps between projections (200)")
    t.add_argument("--galore-scale", type=float, help="GaLore: scale of the update (0.25)")
    t.add_argument(
        "--offload", choices=OFFLOADS, help="optimizer state (and master weights) on the CPU"
    )
    t.add_argument(
        "--per-layer-update",
        action="store_true",
        default=None,
        help="step each parameter inside the backward and free its gradient",
    )
    t.add_argument("--powersgd-rank", type=int, help="PowerSGD: rank of its factors (4)")
    t.add_argument(
        "--powersgd-warmup", type=int, help="PowerSGD: steps of plain all-reduce first (10)"
    )


def _diloco_options(d) -> None:
    """``teralm train``'s DiLoCo flags."""
    d.add_argument("--mode", choices=MODES, help="sync (torchrun data-parallel) or diloco")
    d.add_argument("--replicas", type=int, help="workers the global batch is split over (1)")
    d.add_argument("--inner-steps", type=int, help="steps between rounds (50)")
    d.add_argument("--outer-lr", type=float, help="outer SGD learning rate (0.7)")
    d.add_argument("--outer-momentum", type=float, help="outer Nesterov momentum (0.9)")
    d.add_argument(
        "--outer-compress", choices=OUTER_COMPRESSIONS, help="pseudo-gradients sent as (none)"
    )
    d.add_argument(
        "--outer-async",
        type=float,
        help="0: synchronous rounds; S <= 0.5: apply the previous round's mean times S while "
        "the next round's exchange is in flight (TScale's async mode)",
    )
    d.add_argument("--min-replicas", type=int, help="live workers a round needs (1)")
    d.add_argument(
        "--lighthouse",
        help="auto: start a lighthouse and --replicas workers here; or a lighthouse's URL, to "
        "run one worker (with --replica-id)",
    )
    d.add_argument("--replica-id", type=_count, default=0, help="this worker's number (0)")
    d.add_argument(
        "--advertise",
        help="address the other workers reach this one at (default: 127.0.0.1 with a local "
        "lighthouse, else this machine's name)",
    )
    d.add_argument(
        "--outer-timeout",
        type=_positive(float),
        default=120.0,
        help="seconds to wait for a quorum or an exchange (120)",
    )


def _lighthouse_parser(sub) -> None:
    """``teralm lighthouse``."""
    h = sub.add_parser("lighthouse", help="coordinate DiLoCo workers on several machines")
    h.add_argument(
        "--bind",
        default="127.0.0.1:29510",
        help="HOST:PORT to listen on (0.0.0.0:29510 for workers on other machines)",
    )
    h.add_argument("--min-replicas", type=_positive(int), default=1, help="workers a round needs")
    h.add_argument(
        "--join-timeout",
        type=_positive(float),
        default=10.0,
        help="seconds a new quorum waits for workers that are up but not yet asking",
    )


def _eval_parser(sub) -> None:
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
    _add_precision(e)


def _build_knn_parser(sub) -> None:
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
        "--shard-tokens", type=_positive(int), default=1 << 22, help="positions per shard (2^22)"
    )
    k.add_argument("--k", type=_positive(int), default=32, help="neighbours per query (32)")
    k.add_argument("--nprobe", type=_positive(int), default=32, help="IVF lists searched (32)")
    k.add_argument(
        "--validation-tokens",
        type=_positive(int),
        default=50_000,
        help="held-out validation tokens the mixture is calibrated on",
    )
    k.add_argument("--force", action="store_true", help="replace a different datastore in --out")
    k.add_argument("--quiet", action="store_true")
    _add_precision(k)


def _sample_parser(sub) -> None:
    """``teralm sample``."""
    s = sub.add_parser("sample", help="continue a prompt, with and without the index")
    s.add_argument("run", type=Path)
    s.add_argument("--index", type=Path, required=True)
    s.add_argument("--prompt", default="def ")
    s.add_argument(
        "--max-tokens", "--tokens", dest="tokens", type=int, default=200, help="tokens to generate"
    )
    s.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    s.add_argument("--top-k", type=_positive(int), default=40)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument(
        "--stop", action="append", default=[], help="end at this text (repeatable; not printed)"
    )
    _add_precision(s, generating=True)
    _add_speculate(s)
    _add_knn(s)
    add_index_memory(s)


def _serve_parser(sub) -> None:
    """``teralm serve``."""
    v = sub.add_parser("serve", help="serve a run and its index over HTTP (OpenAI-compatible)")
    v.add_argument("--index", type=Path, required=True)
    v.add_argument("--run", type=Path, required=True, help="run folder or fp8 export")
    v.add_argument("--host", default="127.0.0.1", help="interface to bind (default: local only)")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY'; 'env' reads TERALM_API_KEY",
    )
    v.add_argument("--max-tokens", type=_positive(int), default=1024, help="limit per request")
    v.add_argument("--max-prompt-tokens", type=_positive(int), default=4096)
    v.add_argument(
        "--max-sequences", type=_positive(int), default=64, help="prompts × n per request"
    )
    v.add_argument(
        "--max-batch", type=_positive(int), default=16, help="sequences decoded together"
    )
    v.add_argument("--timeout", type=_positive(float), default=120.0, help="seconds per request")
    v.add_argument(
        "--prefix-cache",
        type=_count,
        default=256,
        metavar="MIB",
        help="MiB of recent prompts' keys and values kept for prompts that begin the same (0: off)",
    )
    _add_precision(v, generating=True)
    _add_speculate(v)
    _add_knn(v)
    add_index_memory(v)
    v.add_argument(
        "--threads",
        type=_positive(int),
        help="CPU threads: torch's (default: cores - 1) and the fused decoder's (default: cores)",
    )
    v.add_argument("--quiet", action="store_true", help="no access log (a line per request)")


def _export_parser(sub) -> None:
    """``teralm export-fp8``."""
    x = sub.add_parser("export-fp8", help="write a run's model with fp8 weights")
    x.add_argument("run", type=Path)
    x.add_argument("--out", type=Path, required=True)


def _add_precision(parser: argparse.ArgumentParser, generating: bool = False) -> None:
    auto = (
        "auto: bf16 on a GPU, fp32 on every CPU (its fused decoder)"
        if generating
        else "auto: bf16 on a GPU, and on a CPU with native bf16 where it measures faster; "
        "else fp32"
    )
    parser.add_argument("--precision", choices=(AUTO, *PRECISIONS), help=auto)


def add_index_memory(parser: argparse.ArgumentParser) -> None:
    """``--index-memory SIZE``: how much of the index to hold in memory (``Index.open``)."""
    parser.add_argument(
        "--index-memory",
        type=_memory_size,
        default=0,
        metavar="SIZE",
        help="read this much of the index into memory up front (e.g. 2G; 0, the default: none), "
        "the files lookups read most first: key samples, then tokens, followers, positions",
    )


def _memory_size(text: str) -> int:
    """An argparse type: a size such as 2G, or 0."""
    from teralm.build_index.builder import parse_size

    if text.strip() == "0":
        return 0
    try:
        return parse_size(text, "--index-memory")
    except TeralmError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_knn(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--knn",
        type=Path,
        help="mix in this kNN datastore of the run's hidden states (build-knn), with the index",
    )


def _add_speculate(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--speculate",
        type=_count,
        help="tokens drafted from the index per step and checked in the same forward (0: none;"
        " default: 8 where the fused CPU decoder runs, else 0); greedy output is unchanged, sampled output keeps its distribution",
    )


def _count(text: str) -> int:
    """An argparse type: an int of 0 or more."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is below 0")
    return value


def _positive(kind: type) -> Callable[[str], int | float]:
    """An argparse type: a number of ``kind`` above 0."""

    def parse(text: str) -> int | float:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text} is not above 0")
        return value

    parse.__name__ = kind.__name__  # argparse's "invalid int value" names it
    return parse


def _fail(command: str, message: str) -> int:
    print(f"teralm {command}: error: {message}", file=sys.stderr)
    return 1


def _train(args: argparse.Namespace) -> int:
    """``teralm train``; under torchrun, the process ends as soon as it is done."""
    code = _train_run(args)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # The process group is destroyed by now, but gloo's worker threads can still hold
        # tensors, and freeing them while the interpreter shuts down aborts the process
        # (std::terminate) now and then, after all the work is done: skip the shutdown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _train_run(args: argparse.Namespace) -> int:
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
        if args.precision:
            config.model.precision = args.precision
        overrides = {name: getattr(args, name) for name in TRAIN_FLAGS}
        config.train = dataclasses.replace(
            config.train, **{k: v for k, v in overrides.items() if v is not None}
        )
        worker = None
        if config.train.mode == "diloco" and args.lighthouse == "auto":
            return _launch_workers(args, config.train)
        if args.lighthouse:
            worker = WorkerPlace(
                args.lighthouse, args.replica_id,
                advertised_host(args.lighthouse, args.advertise), args.outer_timeout,
            )  # fmt: skip
        result = train(
            ix, config, args.out, resume=args.resume, progress=not args.quiet, worker=worker
        )
    except TeralmError as e:
        return _fail("train", str(e))
    except KeyboardInterrupt:
        return _fail("train", f"interrupted; continue with --resume (--out {args.out})")
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


def _launch_workers(args: argparse.Namespace, cfg) -> int:
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


def _lighthouse(args: argparse.Namespace) -> int:
    """``teralm lighthouse``: coordinate DiLoCo workers until interrupted."""
    import time

    from teralm.train.diloco import lighthouse_server

    try:
        with lighthouse_server(args.bind, args.min_replicas, args.join_timeout) as url:
            print(f"lighthouse at {url}: start workers with --lighthouse {url}", flush=True)
            while True:
                time.sleep(3600)
    except (TeralmError, RuntimeError) as e:
        return _fail("lighthouse", str(e))
    except KeyboardInterrupt:
        return 0


# train settings that have a flag of their own
TRAIN_FLAGS = (
    "max_steps", "max_minutes", "checkpoint_every", "seed", "batch_size", "lr", "optimizer",
    "galore_rank", "galore_gap", "galore_scale", "offload", "per_layer_update", "comm",
    "demo_chunk", "demo_topk", "demo_beta", "onebit_warmup", "onebit_block", "onebit_target",
    "powersgd_rank",
    "powersgd_warmup", "mode", "replicas", "inner_steps", "outer_lr", "outer_momentum",
    "outer_compress", "outer_async", "min_replicas",
)  # fmt: skip


def _load(args: argparse.Namespace, device, generating: bool = False):
    """The run's model in the precision asked for (a warning when it will be slow here)."""
    from teralm.infer.load import load_model

    model, state, choice = load_model(args.run, device, args.precision or "auto", generating)
    if choice.warning:
        print(f"warning: {choice.warning}", file=sys.stderr)
    return model, state, choice


def _open_knn(args: argparse.Namespace, ix):
    """The datastore of ``--knn`` for the run (None without the flag); ConfigError if it was
    built from another index or other weights."""
    if not args.knn:
        return None
    from teralm.index.knn import KnnDatastore
    from teralm.model.checkpoint import weights_sha256

    return KnnDatastore.open(args.knn, ix, weights_sha256(args.run))


def _eval(args: argparse.Namespace) -> int:
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
        model, state, _ = _load(args, device)
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
        knn = _open_knn(args, ix)

        def scored(part: str, with_knn=None):
            docs = held_out_documents(ix, holdout, part)
            windows = list(document_windows(ix, docs, model.cfg.max_seq_len, args.max_tokens))
            return score(ix, model, windows, device, progress=not args.quiet, knn=with_knn)

        split = bool(held_out_documents(ix, holdout, "validation"))
        lam = best_lambda(scored("validation")) if split else None  # else the oracle's
        scores = scored("test" if split else "all", knn)
    except TeralmError as e:
        return _fail("eval", str(e))
    calibration = knn.calibration if knn else None
    byte_level = ix.manifest["tokenizer"] == "bytes"
    result = summarize(scores, ix.vocab_size, byte_level, calibration, lam)
    result["lambda_from"] = "validation" if split else "the scored text (no validation documents)"
    result["held_out"] = not other
    if args.json:
        print(json.dumps(result))
        return 0
    _print_eval(result, holdout, split, other, model.mixture_gate is not None, knn is not None)
    return 0


def _print_eval(result: dict, holdout: int, split: bool, other, mixed: bool, knn: bool) -> None:
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


def _build_knn(args: argparse.Namespace) -> int:
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
        return _fail("build-knn", str(e))
    except KeyboardInterrupt:
        return _fail("build-knn", "interrupted; run the same command again to resume")
    print(format_summary(result, config.out))
    return 0


def _sample(args: argparse.Namespace) -> int:
    import torch

    from teralm.index import Index
    from teralm.infer.engine import Engine
    from teralm.infer.load import check_tokenizer
    from teralm.infer.precision import default_device, inference_threads
    from teralm.infer.sampling import Sampling
    from teralm.infer.text import complete

    try:
        ix = Index.open(args.index, args.index_memory)
        model, state, _ = _load(args, default_device(), generating=True)
        check_tokenizer(state, ix)
        knn = _open_knn(args, ix)
    except TeralmError as e:
        return _fail("sample", str(e))
    torch.set_num_threads(inference_threads())
    prompt = [int(t) for t in ix.encode(args.prompt)]
    sampling = Sampling(args.tokens, args.temperature, args.top_p, args.top_k, seed=args.seed)
    engine = Engine(model, ix, max_batch=1, speculate=args.speculate, knn=knn)
    write = lambda text: print(text, end="", flush=True)  # noqa: E731
    try:
        for use_index in [True, False] if model.cfg.index_input else [False]:
            label = "with the index" if use_index else "without the index"
            write(f"--- {label} ---\n{args.prompt}")
            _, finish = complete(engine, prompt, sampling, args.stop, use_index, write)
            write(f"\n({finish})\n\n" if args.stop else "\n\n")
    except TeralmError as e:
        return _fail("sample", str(e))
    finally:
        engine.close()
    return 0


def _export(args: argparse.Namespace) -> int:
    import torch

    from teralm.infer.load import load_model
    from teralm.model import checkpoint

    if checkpoint.is_fp8_export(args.run):
        return _fail("export-fp8", f"{args.run} is an fp8 export already")
    try:
        model, state, _ = load_model(args.run, torch.device("cpu"), "fp32")
    except TeralmError as e:
        return _fail("export-fp8", str(e))
    out = checkpoint.export_fp8(model, state, args.out)
    size = (out / checkpoint.EXPORT_WEIGHTS).stat().st_size
    print(f"wrote {out} ({size / 2**20:.1f} MiB for {model.num_parameters():,} parameters)")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import os

    key = os.environ.get("TERALM_API_KEY") if args.api_key == "env" else args.api_key
    if args.api_key == "env" and not key:
        return _fail("serve", "--api-key env, but TERALM_API_KEY is not set")
    if key is not None and not key.strip():
        return _fail("serve", "--api-key is empty; give a key, or leave the flag out for none")

    import torch
    import uvicorn

    from teralm.index import Index
    from teralm.infer.engine import Engine
    from teralm.infer.load import check_tokenizer
    from teralm.infer.precision import default_device, inference_threads
    from teralm.server.app import create_app
    from teralm.server.guard import http_config
    from teralm.server.protocol import Limits

    try:
        ix = Index.open(args.index, args.index_memory)
        model, state, precision = _load(args, default_device(), generating=True)
        check_tokenizer(state, ix)
        knn = _open_knn(args, ix)
    except TeralmError as e:
        return _fail("serve", str(e))
    torch.set_num_threads(args.threads or inference_threads())
    ix.query.longest_match([[0]])  # compile and warm the query kernels before the first request
    engine = Engine(
        model, ix, args.max_batch, args.speculate, args.prefix_cache << 20, knn, args.threads
    )
    limits = Limits(
        max_prompt_tokens=args.max_prompt_tokens,
        max_tokens=args.max_tokens,
        max_sequences=args.max_sequences,
        timeout_s=args.timeout,
    )
    name = f"teralm-{args.run.resolve().name}"
    app = create_app(engine, name, limits, key)
    print(serve_summary(args, name, engine, precision, limits, key is not None), flush=True)
    if not args.quiet:
        _log_requests()
    uvicorn.Server(http_config(app, args.host, args.port)).run()
    engine.close()
    return 0


def serve_summary(args, name: str, engine, precision, limits, keyed: bool) -> str:
    """What ``teralm serve`` runs with, printed once at start."""
    import torch

    ix, model = engine.index, engine.model
    params = sum(p.numel() for p in model.parameters())
    memory = ", ".join(sorted(ix.resident)) or "nothing (mapped from disk)"
    decoder = "fused CPU kernel" if engine.decoder.fused else "PyTorch"
    lines = [
        f"teralm serve: {name}",
        f"  model      {args.run}: {params / 1e6:.1f}M parameters, {precision.precision} "
        f"({precision.reason})",
        f"  decoder    {decoder}; {torch.get_num_threads()} torch threads; drafts from the "
        f"index: up to {engine.speculate} per step",
        f"  index      {args.index}: {ix.num_tokens:,} tokens ({ix.manifest['tokenizer']}); "
        f"in memory: {memory}",
    ]
    if engine.knn is not None:
        knn, mix = engine.knn, engine.knn.calibration["model"]
        lines.append(
            f"  kNN        {args.knn}: {knn.num_keys:,} keys, {knn.k} neighbours, weight "
            f"{mix['lam']:.2f}, temperature {mix['temperature']:.3g}"
        )
    lines += [
        f"  limits     prompts of {limits.max_prompt_tokens:,} tokens, completions of "
        f"{limits.max_tokens:,}, {limits.max_sequences} sequences a request, "
        f"{engine.max_batch} decoded together, {limits.timeout_s:g} s a request",
        f"  address    http://{args.host}:{args.port} "
        f"({'API key required on /v1' if keyed else 'no API key'}); "
        f"access log {'off' if args.quiet else 'on'}",
    ]
    return "\n".join(lines)


def _log_requests() -> None:
    """The access log (``teralm.server.guard.access_log``) to stderr, with the time."""
    import logging

    from teralm.server.guard import access_log

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    access_log.addHandler(handler)
    access_log.setLevel(logging.INFO)
    access_log.propagate = False


COMMANDS = {
    "lighthouse": _lighthouse,
    "serve": _serve,
    "train": _train,
    "eval": _eval,
    "build-knn": _build_knn,
    "sample": _sample,
    "export-fp8": _export,
}
