"""The cost and the information of the index's fuller answer: each target's most frequent
followers at several context lengths, seeing only earlier text, computed per training batch from
the global order (``teralm.train.data.causal_followers``).

    python benchmarks/bench_followers.py [--batches 20] [--caps 32,8,3] [--k 4]
                                         [--corpora pydocs,manpages,headers]

For each corpus's byte index (bench_quality's), draws batches of the tiny preset's shape (16
fragments of 256 tokens from random places) and times, per batch: the stored features and the
∞-gram counts that training reads today (``causal_infgram``), and the followers at each cap.
It also says how often each cap's first follower is the target, and how often the target is among
its ``k``, beside the stored follower's rate; by band of the stored match length (1-3, 4-15, 16+
tokens), which is where the issue asks for gains; how often the short-window model's first
follower (``teralm.train.data.short_window``: the last 3 tokens' followers earlier in the
document) is the target, and is where the stored follower is not; and the bytes per token that
storing the same answer in the index would take. Prints a table and writes
benchmarks/results/bench_followers.json.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from common import corpus_index, save, table

from teralm.index import Index
from teralm.model import ModelConfig
from teralm.train.data import TRAIN_EXACT_LIMIT, causal_followers, causal_infgram, short_window

SEQ_LEN, BATCH = 256, 16
BANDS = ((1, 3), (4, 15), (16, 1 << 30))
# the short-window model (PPM-style): the last 3 tokens' followers in the last 2048 of the document
SHORT_WINDOW = ModelConfig(index_followers=1, window_order=3, window_tokens=2048)


def fragments(ix: Index, batches: int, seed: int = 0) -> list[list[int]]:
    """``batches`` lists of ``BATCH`` fragment starts, each fragment inside the corpus."""
    rng = np.random.default_rng(seed)
    return [
        [int(s) for s in rng.integers(1, ix.num_tokens - SEQ_LEN - 1, size=BATCH)]
        for _ in range(batches)
    ]


def measure(ix: Index, starts: list[list[int]], caps: tuple[int, ...], k: int) -> dict:
    """Seconds per batch of today's features and of the followers; hit rates by band."""
    today = followers = 0.0
    rows = []
    for batch in starts:
        for start in batch:
            began = time.perf_counter()
            stored = ix.features(start, start + SEQ_LEN)
            lengths = stored.match_len.astype(np.int64)
            causal_infgram(ix, start + 1, SEQ_LEN, 0, lengths, TRAIN_EXACT_LIMIT)
            middle = time.perf_counter()
            found = causal_followers(ix, start + 1, SEQ_LEN, 0, caps, k, lengths, TRAIN_EXACT_LIMIT)
            followers += time.perf_counter() - middle
            today += middle - began
            targets = ix.tokens(start + 1, start + 1 + SEQ_LEN).astype(np.int64)
            stored_next = stored.next_token.astype(np.int64)
            window = short_window(ix, SHORT_WINDOW, start + 1, SEQ_LEN, 0)[0][:, 0]
            rows.append((lengths, stored_next, targets, found, window))
    return {
        "today_ms": 1000 * today / len(starts),
        "followers_ms": 1000 * followers / len(starts),
        **hit_rates(rows, caps),
    }


def hit_rates(rows: list, caps: tuple[int, ...]) -> dict:
    """The stored follower's and each cap's top-1 / top-k hit rates, by stored match band."""
    lengths = np.concatenate([r[0] for r in rows])
    stored_hit = np.concatenate([r[1] == r[2] for r in rows])
    out = {}
    for lo, hi in BANDS:
        band = (lengths >= lo) & (lengths <= hi)
        name = f"{lo}-{hi}" if hi < 1 << 30 else f"{lo}+"
        out[f"share_{name}"] = float(band.mean())
        out[f"stored_{name}"] = float(stored_hit[band].mean())
        for level, cap in enumerate(caps):
            top1 = np.concatenate([r[3].tokens[:, level, 0] == r[2] for r in rows])
            topk = np.concatenate([(r[3].tokens[:, level] == r[2][:, None]).any(1) for r in rows])
            out[f"cap{cap}_top1_{name}"] = float(top1[band].mean())
            out[f"cap{cap}_topk_{name}"] = float(topk[band].mean())
        ppm = np.concatenate([r[4] == r[2] for r in rows])
        out[f"ppm_top1_{name}"] = float(ppm[band].mean())
        out[f"ppm_only_{name}"] = float((ppm & ~stored_hit)[band].mean())
    return out


def stored_bytes(caps: tuple[int, ...], k: int, token_bytes: int) -> int:
    """Bytes per token to store the same answer: per cap a length byte, a 2-byte total and
    ``k`` (token, 2-byte count) pairs."""
    return len(caps) * (1 + 2 + k * (token_bytes + 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--caps", default="32,8,3", help="context length caps, longest first")
    parser.add_argument("--k", type=int, default=4, help="followers per cap")
    parser.add_argument("--corpora", default="pydocs,manpages,headers")
    args = parser.parse_args()
    caps = tuple(int(c) for c in args.caps.split(","))
    rows = []
    for corpus in args.corpora.split(","):
        _, index = corpus_index(corpus)
        ix = Index.open(index)
        starts = fragments(ix, 2)
        measure(ix, starts, caps, args.k)  # compile the kernels, warm the page cache
        row = {"corpus": corpus, "tokens": ix.num_tokens}
        row.update(measure(ix, fragments(ix, args.batches, seed=1), caps, args.k))
        row["stored_bytes_per_token"] = stored_bytes(caps, args.k, 1)
        rows.append(row)
        print(f"  {corpus}: done", flush=True)
    cpu = os.popen("lscpu | grep 'Model name'").read().split(":")[-1].strip()
    print(f"{BATCH} x {SEQ_LEN} tokens a batch, caps {caps}, k {args.k}, one thread; {cpu}")
    print(
        table(
            rows,
            [
                ("corpus", "corpus", ""),
                ("tokens", "tokens", ",d"),
                ("today_ms", "today ms/batch", ".1f"),
                ("followers_ms", "followers ms/batch", ".1f"),
                ("stored_bytes_per_token", "stored B/token", "d"),
            ],
        )
    )
    for row in rows:
        print(f"{row['corpus']}: hit rates by stored match band (share of targets)")
        for lo, hi in BANDS:
            name = f"{lo}-{hi}" if hi < 1 << 30 else f"{lo}+"
            cells = [f"stored {row[f'stored_{name}']:.3f}"] + [
                f"cap {cap}: top-1 {row[f'cap{cap}_top1_{name}']:.3f}, "
                f"top-{args.k} {row[f'cap{cap}_topk_{name}']:.3f}"
                for cap in caps
            ]
            cells.append(
                f"short window: top-1 {row[f'ppm_top1_{name}']:.3f}, "
                f"right where the stored follower is not {row[f'ppm_only_{name}']:.3f}"
            )
            print(f"  {name:>5} ({row[f'share_{name}']:.1%}): " + "; ".join(cells))
    print(f"wrote {save('bench_followers', {'caps': caps, 'k': args.k, 'rows': rows})}")


if __name__ == "__main__":
    main()
