"""Query benchmark: longest match + next-token distribution on the pydocs byte index (training
documents only, id % 50 != 0), against infini-gram's engine and tokengrams on the same bytes.

    pip install -e '.[bench]'
    python benchmarks/bench_query.py [--contexts 10000] [--rounds 3] [--no-peers]
        [--shard-tokens 268435456,33554432] [--results bench_query]

Contexts: 32 tokens from held-out documents (id % 50 == 0), and 32 random tokens drawn uniformly
from the byte values the corpus uses. teralm answers from builds of the same bytes with the shard
sizes of --shard-tokens: by default one shard (as the peers each search one suffix array) and the
default shard size (2 shards here). Every
tool runs every set once per round, rounds one after another; the table gives the median over
rounds of each figure, so that a slow spell of the machine does not decide a comparison. Prints a
table, writes benchmarks/results/bench_query.json.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from common import CACHE, SHARED_DATA, save, table, teralm_cli

PYDOCS = SHARED_DATA / "pydocs.jsonl.gz"
WORK = CACHE / "query"
CONTEXT = 32


def split_pydocs() -> tuple[Path, list[bytes]]:
    """Training documents as JSONL (in a folder of their own), held-out texts in memory."""
    if not PYDOCS.exists():
        sys.exit(f"{PYDOCS} not found: the benchmark reads the team's shared data folder")
    train = WORK / "data" / "train.jsonl"
    train.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(PYDOCS, "rt") as f:
        docs = [json.loads(line) for line in f]
    if not train.exists():  # written once: the index build checks its source is unchanged
        with open(train.with_suffix(".part"), "w") as out:
            for doc in docs:
                if doc["id"] % 50:
                    out.write(json.dumps({"text": doc["text"]}) + "\n")
        os.replace(train.with_suffix(".part"), train)
    return train, [d["text"].encode() for d in docs if d["id"] % 50 == 0]


def make_contexts(held: list[bytes], vocab: np.ndarray, n: int, rng) -> dict[str, list[np.ndarray]]:
    long_docs = [np.frombuffer(d, np.uint8) for d in held if len(d) > CONTEXT]
    heldout = []
    for _ in range(n):
        d = long_docs[int(rng.integers(len(long_docs)))]
        a = int(rng.integers(0, len(d) - CONTEXT))
        heldout.append(d[a : a + CONTEXT].astype(np.int64))
    random = [rng.choice(vocab, size=CONTEXT).astype(np.int64) for _ in range(n)]
    return {"held-out": heldout, "random": random}


def latency(fn, contexts) -> dict:
    """Per-call latency of ``fn([context])`` and batched throughput of ``fn(contexts)``."""
    times = []
    for c in contexts:
        t = time.perf_counter()
        fn([c])
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    fn(contexts)
    batch = time.perf_counter() - t
    times = np.array(times) * 1e6
    return {
        "p50_us": float(np.percentile(times, 50)),
        "p99_us": float(np.percentile(times, 99)),
        "batched_per_s": len(contexts) / batch,
    }


def teralm_index(train: Path, name: str, *options: str) -> Path:
    """Build (or rebuild, so it matches this code) a teralm index of the training documents."""
    index_dir = WORK / name
    teralm_cli("build-index", train, "--out", index_dir, "--quiet", "--force", *options)
    return index_dir


def teralm_runner(index_dir: Path):
    from teralm.index import Index

    ix = Index.open(index_dir)
    ix.query.next_token_distribution([[1, 2, 3]])  # compile / warm up
    return ix, ix.next_token_distribution


PEER_SCRIPT = r"""
import json, sys, time
import numpy as np
tool, index_dir, contexts_path = sys.argv[1:4]
contexts = [list(map(int, c)) for c in np.load(contexts_path)]
if tool == "infini-gram":
    from infini_gram.engine import InfiniGramEngine
    eng = InfiniGramEngine(index_dir=index_dir, eos_token_id=0, vocab_size=255, version=4,
                           token_dtype="u8")
    def run(batch):
        return [eng.infgram_ntd(c, max_support=1000) for c in batch]
else:
    from tokengrams import MemmapIndex
    idx = MemmapIndex(index_dir + "/tokens.u16", index_dir + "/index.idx", vocab=256)
    def longest(c):
        lo, hi = 0, len(c)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if idx.contains(c[len(c) - mid:]): lo = mid
            else: hi = mid - 1
        return c[len(c) - lo:]
    def run(batch):
        return idx.batch_count_next([longest(c) for c in batch])
run(contexts[:10])
times = []
for c in contexts:
    t = time.perf_counter(); run([c]); times.append(time.perf_counter() - t)
t = time.perf_counter(); run(contexts); batch = time.perf_counter() - t
times = np.array(times) * 1e6
print(json.dumps({"p50_us": float(np.percentile(times, 50)), "p99_us": float(np.percentile(times, 99)),
                  "batched_per_s": len(contexts) / batch}))
"""


def build_peers(train: Path) -> dict[str, Path]:
    """infini-gram and tokengrams indexes of the same training bytes (built once, cached)."""
    import resource

    dirs = {"infini-gram": WORK / "infini-gram-index", "tokengrams": WORK / "tokengrams-index"}
    if not (dirs["infini-gram"] / "table.0").exists():
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        subprocess.run(
            [
                sys.executable,
                "-m",
                "infini_gram.indexing",
                "--data_dir",
                str(train.parent.resolve()),
                "--save_dir",
                str(dirs["infini-gram"].resolve()),
                "--token_dtype",
                "u8",
                "--cpus",
                "2",
                "--mem",
                "8",
                "--ulimit",
                str(hard),
            ],
            check=True,
            capture_output=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
    tg = dirs["tokengrams"]
    if not (tg / "index.idx").exists():
        tg.mkdir(parents=True, exist_ok=True)
        with open(train) as f:
            data = b"".join(json.loads(line)["text"].encode() for line in f)
        np.frombuffer(data, np.uint8).astype(np.uint16).tofile(tg / "tokens.u16")
        code = (
            "from tokengrams import MemmapIndex; MemmapIndex.build("
            f"{str(tg / 'tokens.u16')!r}, {str(tg / 'index.idx')!r}, vocab=256, verbose=False)"
        )
        subprocess.run([sys.executable, "-c", code], check=True)
    return dirs


def median_rows(rounds: list[list[dict]]) -> list[dict]:
    """One row per (tool, contexts): the median of each figure over the rounds."""
    rows = []
    for same in zip(*rounds):
        row = dict(same[0])
        for key in ("p50_us", "p99_us", "batched_per_s"):
            values = [r[key] for r in same if key in r]
            row[key] = statistics.median(values) if values else None
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--online-tokens", type=int, default=200_000)
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument(
        "--shard-tokens",
        default=f"{2**28},{2**25}",
        help="comma-separated shard sizes of the teralm builds (default: one shard here, and "
        "the default size); the first is compared with the peers",
    )
    parser.add_argument("--results", default="bench_query", help="name of the JSON result")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    train, held = split_pydocs()
    runners = {}
    for size in map(int, args.shard_tokens.split(",")):
        built = teralm_runner(
            teralm_index(train, f"teralm-index-{size}", "--shard-tokens", str(size))
        )
        shards = len(built[0].manifest["shards"])
        runners[f"teralm, {shards} shard{'s' if shards > 1 else ''}"] = built
    first = next(iter(runners))
    ix = runners[first][0]
    used = np.flatnonzero(np.bincount(ix.tokens(0, ix.num_tokens), minlength=256))
    sets = make_contexts(held, used, args.contexts, rng)
    peers = {} if args.no_peers else build_peers(train)
    for name, contexts in sets.items():
        np.save(WORK / f"contexts-{name}.npy", np.stack(contexts))

    rounds = []
    for _ in range(args.rounds):
        rows = []
        for name, contexts in sets.items():
            for tool, (_, query) in runners.items():
                rows.append({"tool": tool, "contexts": name, **latency(query, contexts)})
            for tool, directory in peers.items():
                out = subprocess.run(
                    [
                        sys.executable,
                        "-c",
                        PEER_SCRIPT,
                        tool,
                        str(directory),
                        str(WORK / f"contexts-{name}.npy"),
                    ],
                    capture_output=True,
                    text=True,
                    env={**os.environ, "HF_HUB_OFFLINE": "1"},
                )
                result = (
                    json.loads(out.stdout.strip().splitlines()[-1]) if not out.returncode else {}
                )
                rows.append({"tool": tool, "contexts": name, **result})
        rounds.append(rows)
    rows = median_rows(rounds)
    mean_match = {name: float(ix.query.longest_match(c).length.mean()) for name, c in sets.items()}
    for row in rows:
        if row["tool"].startswith("teralm"):
            row["mean_match"] = mean_match[row["contexts"]]

    from teralm.index.query import OnlineMatcher

    text = np.concatenate([np.frombuffer(d, np.uint8) for d in held])[: args.online_tokens]
    matcher = OnlineMatcher(ix)
    t = time.perf_counter()
    for token in text:
        matcher.push(int(token))
    online_us = (time.perf_counter() - t) / len(text) * 1e6

    print(
        f"pydocs training bytes: {ix.num_tokens:,} tokens; {args.contexts:,} contexts "
        f"of {CONTEXT} tokens per set; 1 process; median of {args.rounds} rounds"
    )
    print(
        table(
            rows,
            [
                ("tool", "tool", "s"),
                ("contexts", "contexts", "s"),
                ("p50_us", "p50 µs", ".1f"),
                ("p99_us", "p99 µs", ".1f"),
                ("batched_per_s", "batched ctx/s", ",.0f"),
                ("mean_match", "mean match", ".1f"),
            ],
        )
    )
    print(f"OnlineMatcher: {online_us:.1f} µs per token over {len(text):,} held-out tokens")
    for name in sets:
        ours = next(r for r in rows if r["contexts"] == name and r["tool"] == first)
        theirs = [r for r in rows if r["contexts"] == name and r["tool"] in peers and r["p50_us"]]
        if theirs:
            p50 = min(r["p50_us"] for r in theirs) / ours["p50_us"]
            batched = ours["batched_per_s"] / max(r["batched_per_s"] for r in theirs)
            print(f"{name}: {first} vs the best peer: p50 {p50:.2f}x, batched {batched:.2f}x")
    rounds_out = {"rows": rows, "rounds": rounds, "online_us_per_token": online_us}
    print(f"wrote {save(args.results, rounds_out)}")


if __name__ == "__main__":
    main()
