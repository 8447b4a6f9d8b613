"""``teralm sample``: continue a prompt, with and without the index."""

from __future__ import annotations

import argparse
from pathlib import Path

from teralm.cli.common import (
    add_index_memory,
    add_knn,
    add_precision,
    add_speculate,
    fail,
    load_run,
    open_knn,
    positive,
)
from teralm.errors import TeralmError


def add_parser(sub) -> None:
    """``teralm sample``."""
    s = sub.add_parser("sample", help="continue a prompt, with and without the index")
    s.add_argument("run", type=Path)
    s.add_argument("--index", type=Path, required=True)
    s.add_argument("--prompt", default="def ")
    s.add_argument(
        "--max-tokens", "--tokens", dest="tokens", type=int, default=200, help="tokens to generate"
    )
    s.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    s.add_argument("--top-k", type=positive(int), default=40)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument(
        "--stop", action="append", default=[], help="end at this text (repeatable; not printed)"
    )
    add_precision(s, generating=True)
    add_speculate(s)
    add_knn(s)
    add_index_memory(s)
    s.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from teralm.index import Index
    from teralm.infer.engine import Engine
    from teralm.infer.load import check_tokenizer
    from teralm.infer.precision import default_device, inference_threads
    from teralm.infer.sampling import Sampling
    from teralm.infer.text import complete

    try:
        ix = Index.open(args.index, args.index_memory)
        model, state, _ = load_run(args, default_device(), generating=True)
        check_tokenizer(state, ix)
        knn = open_knn(args, ix)
    except TeralmError as e:
        return fail("teralm sample", str(e))
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
        return fail("teralm sample", str(e))
    finally:
        engine.close()
    return 0
