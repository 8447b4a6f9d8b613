"""Lookups on one index from a fresh process, with what they cost in disk reads: bench_scale's
``cold`` part runs it once with the index in the page cache and once inside a memory cgroup
much smaller than the index (after dropping the page cache).

    python benchmarks/lookup_probe.py INDEX [--lookups 2000] [--warmup 1000] [--batches 20]
                                            [--sets in-corpus,held-out,random] [--memory SIZE]
                                            [--steps 200]

Contexts of 32 bytes: ``in-corpus`` (from the index's own documents), ``held-out`` (this
Python's standard-library sources, text the index does not hold) and ``random`` bytes. For each
set, after ``--warmup`` lookups of other contexts of the same kind: p50/p99 of one longest match
+ next-token counts (``next_token_distribution``), major page faults and bytes read from disk per
lookup, and the batched throughput. Then ``FragmentSampler`` batches (16 x 256 tokens, with the
∞-gram counts) per second and tokens/s, and the index's part of a served decode step (16
sequences continuing held-out text: the online matchers pushed one token, then one batched ∞-gram
query, as ``teralm serve`` runs them each step). ``--memory``: ``Index.open``'s, the bytes of the
index read into memory first (the time that takes is reported). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import resource
import sysconfig
import time
from pathlib import Path

import numpy as np

from teralm.build_index.builder import parse_size
from teralm.index import Index

CONTEXT = 32


def disk_counters() -> tuple[int, int]:
    """(major page faults, bytes read from storage) of this process so far."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    io = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return faults, int(io["read_bytes"])


def context_sets(ix: Index, n: int, rng: np.random.Generator) -> dict[str, list[np.ndarray]]:
    """``n`` contexts of each kind (see the module's docstring)."""
    starts = rng.integers(0, ix.num_tokens - CONTEXT, size=n)
    in_corpus = [ix.tokens(int(a), int(a) + CONTEXT).astype(np.int64) for a in starts]
    held = held_out_text()
    held_out = [
        held[a : a + CONTEXT].astype(np.int64) for a in rng.integers(0, len(held) - CONTEXT, size=n)
    ]
    random = [rng.integers(32, 127, size=CONTEXT).astype(np.int64) for _ in range(n)]
    return {"in-corpus": in_corpus, "held-out": held_out, "random": random}


def measure(ix: Index, contexts: list[np.ndarray]) -> dict:
    """Per-lookup latency and disk reads, one context at a time, then batched throughput."""
    times = []
    faults0, read0 = disk_counters()
    for c in contexts:
        began = time.perf_counter()
        ix.query.next_token_distribution([c])
        times.append(time.perf_counter() - began)
    faults1, read1 = disk_counters()
    began = time.perf_counter()
    ix.query.next_token_distribution(contexts)
    batched = len(contexts) / (time.perf_counter() - began)
    us = np.array(times) * 1e6
    return {
        "p50_us": float(np.percentile(us, 50)),
        "p99_us": float(np.percentile(us, 99)),
        "faults_per_lookup": (faults1 - faults0) / len(contexts),
        "read_kib_per_lookup": (read1 - read0) / len(contexts) / 1024,
        "batched_per_s": batched,
    }


def sampler_speed(ix: Index, batches: int) -> dict:
    """Training batches with the ∞-gram counts, as ``teralm train`` draws them."""
    from teralm.train.config import DataSettings
    from teralm.train.data import FragmentSampler

    data = DataSettings(seq_len=256, batch_size=16, holdout_every=100, index_dropout=0.0)
    sampler = FragmentSampler(ix, data, infgram=True)
    sampler.batch(0)
    faults0, read0 = disk_counters()
    began = time.perf_counter()
    for step in range(1, batches + 1):
        sampler.batch(step)
    seconds = time.perf_counter() - began
    faults1, read1 = disk_counters()
    return {
        "batches_per_s": batches / seconds,
        "tokens_per_s": batches * 16 * 256 / seconds,
        "faults_per_batch": (faults1 - faults0) / batches,
        "read_mib_per_batch": (read1 - read0) / batches / 2**20,
    }


def decode_steps(ix: Index, steps: int, batch: int = 16) -> dict:
    """The index's work in ``steps`` decode steps of ``batch`` sequences of held-out text."""
    from teralm.index.query import OnlineMatcher, push_all
    from teralm.infer.mixture import infgram_probs

    text = held_out_text()
    starts = np.random.default_rng(1).integers(0, len(text) - 4096, size=batch)
    matchers = [OnlineMatcher(ix) for _ in range(batch)]
    for m, a in zip(matchers, starts):
        m.extend(text[a : a + 64].tolist())
    faults0, read0 = disk_counters()
    times = []
    for step in range(64, 64 + steps):
        began = time.perf_counter()
        push_all(matchers, [int(text[a + step]) for a in starts])
        infgram_probs(ix, [text[max(0, a + step + 1 - 64) : a + step + 1].tolist() for a in starts])
        times.append(time.perf_counter() - began)
    faults1, read1 = disk_counters()
    ms = np.array(times) * 1e3
    return {
        "step_p50_ms": float(np.percentile(ms, 50)),
        "step_p99_ms": float(np.percentile(ms, 99)),
        "faults_per_step": (faults1 - faults0) / steps,
        "read_kib_per_step": (read1 - read0) / steps / 1024,
    }


def held_out_text() -> np.ndarray:
    """Text the index does not hold: this Python's standard-library sources, as bytes."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return np.frombuffer(
        b"".join(p.read_bytes() for p in sorted(stdlib.glob("*.py"))[:200]), np.uint8
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("index", type=Path)
    parser.add_argument("--lookups", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=1000)
    parser.add_argument("--batches", type=int, default=20, help="0: no training batches")
    parser.add_argument("--sets", default="in-corpus,held-out,random", help="context sets")
    parser.add_argument("--memory", default="0", help="of the index, read into memory first")
    parser.add_argument("--steps", type=int, default=200, help="decode steps (0: none)")
    args = parser.parse_args()
    memory = 0 if args.memory == "0" else parse_size(args.memory)
    began = time.perf_counter()
    ix = Index.open(args.index, memory)
    result = {
        "index_bytes": sum(p.stat().st_size for p in args.index.glob("*.*")),
        "resident": sorted(ix.resident),
    }
    ix.query.next_token_distribution([np.arange(4)])  # compile the kernels (and map the files)
    result["open_s"] = time.perf_counter() - began
    rng = np.random.default_rng(0)
    for name, contexts in context_sets(ix, args.warmup + args.lookups, rng).items():
        if name not in args.sets.split(","):
            continue
        for c in contexts[: args.warmup]:
            ix.query.next_token_distribution([c])
        result[name] = measure(ix, contexts[args.warmup :])
    if args.batches:
        result["sampler"] = sampler_speed(ix, args.batches)
    if args.steps:
        result["decode"] = decode_steps(ix, args.steps)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
