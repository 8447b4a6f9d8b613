"""``teralm serve``: serve a run and its index over HTTP (OpenAI-compatible)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from teralm.cli.common import (
    add_index_memory,
    add_knn,
    add_precision,
    add_speculate,
    count,
    fail,
    load_run,
    open_knn,
    positive,
)
from teralm.errors import TeralmError


def add_parser(sub) -> None:
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
    v.add_argument("--max-tokens", type=positive(int), default=1024, help="limit per request")
    v.add_argument("--max-prompt-tokens", type=positive(int), default=4096)
    v.add_argument(
        "--max-sequences", type=positive(int), default=64, help="prompts × n per request"
    )
    v.add_argument("--max-batch", type=positive(int), default=16, help="sequences decoded together")
    v.add_argument("--timeout", type=positive(float), default=120.0, help="seconds per request")
    v.add_argument(
        "--prefix-cache",
        type=count,
        default=256,
        metavar="MIB",
        help="MiB of recent prompts' keys and values kept for prompts that begin the same (0: off)",
    )
    add_precision(v, generating=True)
    add_speculate(v)
    add_knn(v)
    add_index_memory(v)
    v.add_argument(
        "--threads",
        type=positive(int),
        help="CPU threads: torch's (default: cores - 1) and the fused decoder's (default: cores)",
    )
    v.add_argument("--quiet", action="store_true", help="no access log (a line per request)")
    v.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import os

    key = os.environ.get("TERALM_API_KEY") if args.api_key == "env" else args.api_key
    if args.api_key == "env" and not key:
        return fail("teralm serve", "--api-key env, but TERALM_API_KEY is not set")
    if key is not None and not key.strip():
        return fail(
            "teralm serve", "--api-key is empty; give a key, or leave the flag out for none"
        )

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
        model, state, precision = load_run(args, default_device(), generating=True)
        check_tokenizer(state, ix)
        knn = open_knn(args, ix)
    except TeralmError as e:
        return fail("teralm serve", str(e))
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
        log_requests()
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


def log_requests() -> None:
    """The access log (``teralm.server.guard.access_log``) to stderr, with the time."""
    import logging

    from teralm.server.guard import access_log

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    access_log.addHandler(handler)
    access_log.setLevel(logging.INFO)
    access_log.propagate = False
