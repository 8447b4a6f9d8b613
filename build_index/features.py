"""Pass 3: causal longest-match features of every token against all earlier tokens of the corpus.

The work is split by key bucket (leading 16 bits of the reversed context): a job takes a range of
buckets, pulls that range out of every shard's sorted positions, merges them (S-way, O(log S) per
entry), and sweeps the merged order forwards and backwards (see teralm.kernels.match). Jobs write
disjoint positions of the ``.match`` files, so they run in any order and in parallel; a job that
was cut short is simply run again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from teralm.build_index.layout import Layout
from teralm.index import format as fmt
from teralm.kernels import match as km

BUCKETS = fmt.NUM_BUCKETS


@dataclass(frozen=True)
class FirstOccurrences:
    """Per token value: first position, first position with a follower, that follower."""

    first: np.ndarray
    first_f: np.ndarray
    first_tok: np.ndarray


@lru_cache(maxsize=2)
def _doc_bits(layout: Layout) -> np.ndarray:
    return km.doc_start_bits(layout.offsets(), layout.num_tokens)


def forget_cached_files() -> None:
    """Drop the cached document bitmap (a new build may have replaced the files)."""
    _doc_bits.cache_clear()


def _neighbours(layout: Layout, stream, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Up to ``max_match`` tokens before shard ``k`` and the one token after it."""
    start, stop = layout.shard_start(k), layout.shard_start(k) + layout.sizes[k]
    tail = stream[max(0, start - layout.max_match) : start]
    nxt = stream[stop : stop + 1]
    return tail, nxt if len(nxt) else np.zeros(1, stream.dtype)


def _words(tokens: np.ndarray, layout: Layout) -> np.ndarray:
    """The shard's bytes as uint64 words, when one token is one key element (else empty)."""
    if tokens.dtype.itemsize * 8 != layout.elem_bits or len(tokens) == 0:
        return np.empty(0, np.uint64)
    raw = tokens.view(np.uint8)
    return raw[: len(raw) // 8 * 8].view("<u8")


def make_plan(layout: Layout) -> tuple[FirstOccurrences, np.ndarray]:
    """One sequential scan of the corpus: the first-occurrence tables, and ``cumulative``
    [shard, bucket + 1]: where each bucket starts in the shard's ``.prefix``."""
    bits = _doc_bits(layout)
    stream = layout.stream()
    vocab = max(layout.vocab_size, 256)
    first = np.full(vocab, km.INF, dtype=np.int64)
    first_f = np.full(vocab, km.INF, dtype=np.int64)
    first_tok = np.zeros(vocab, dtype=np.int64)
    cumulative = np.zeros((layout.num_shards, BUCKETS + 1), dtype=np.int64)
    for k in range(layout.num_shards):
        tokens = stream.shard(k)
        tail, nxt = _neighbours(layout, stream, k)
        hist = np.zeros(BUCKETS, dtype=np.int64)
        km.bucket_histogram(
            tokens, tail, layout.shard_start(k), bits, layout.separator, layout.elem_bits, hist
        )
        np.cumsum(hist, out=cumulative[k, 1:])
        km.first_occurrences(
            tokens, nxt, layout.shard_start(k), bits, layout.num_tokens, first, first_f, first_tok
        )
    return FirstOccurrences(first, first_f, first_tok), cumulative


def split_jobs(cumulative: np.ndarray, target: int) -> list[tuple[int, int]]:
    """Consecutive bucket ranges of about ``target`` positions each (a bucket is never split)."""
    per_bucket = np.diff(cumulative.sum(axis=0))
    jobs, begin, acc = [], 0, 0
    for b in np.flatnonzero(per_bucket):
        acc += int(per_bucket[b])
        if acc >= target:
            jobs.append((begin, int(b) + 1))
            begin, acc = int(b) + 1, 0
    if acc:
        jobs.append((begin, BUCKETS))
    return jobs


def job_ranges(cumulative: np.ndarray, buckets: tuple[int, int]) -> list[tuple[int, int]]:
    """Per shard, the ``.prefix`` range ``[lo, hi)`` whose keys lie in the bucket range."""
    b0, b1 = buckets
    return [(int(lo), int(hi)) for lo, hi in zip(cumulative[:, b0], cumulative[:, b1])]


def features_job(layout: Layout, firsts: FirstOccurrences, ranges: list[tuple[int, int]]) -> int:
    """Compute and store the features of the positions in ``ranges`` (one range per shard).

    Returns the number of positions.
    """
    bits = _doc_bits(layout)
    stream = layout.stream()
    cap, elem_bits = layout.max_match, layout.elem_bits
    run_starts = np.cumsum([0] + [hi - lo for lo, hi in ranges]).astype(np.int64)
    rows = int(run_starts[-1])
    keys = np.empty((rows, km.key_words(cap, elem_bits)), dtype=np.uint64)
    depth = np.empty(rows, dtype=np.uint8)
    follower = np.empty(rows, dtype=np.int32)
    pos = np.empty(rows, dtype=np.int64)
    locals_ = []
    for k, (lo, hi) in enumerate(ranges):
        prefix = np.memmap(layout.path(k, "prefix"), dtype=fmt.PREFIX_DTYPE, mode="r")
        local = np.array(prefix[lo:hi])  # unmapped after the job: RSS stays per job
        locals_.append(local)
        r = slice(run_starts[k], run_starts[k + 1])
        tail, nxt = _neighbours(layout, stream, k)
        km.gather_keys(
            stream.shard(k),
            _words(stream.shard(k), layout),
            tail,
            nxt,
            layout.shard_start(k),
            local,
            bits,
            layout.num_tokens,
            cap,
            layout.separator,
            elem_bits,
            keys[r],
            depth[r],
            follower[r],
        )
        pos[r] = local.astype(np.int64) + layout.shard_start(k)
    order = km.merge_sorted(keys, run_starts)
    lcp = km.adjacent_lcp(keys, depth, order, elem_bits)
    token = (keys[order, 0] >> np.uint64(64 - elem_bits)).astype(np.int64)
    del keys
    follow = np.where(follower >= 0, follower, layout.separator).astype(_follow_dtype(layout))
    pos, follower = pos[order], follower[order]
    length, next_pos, next_tok = km.sweep_features(pos, follower, lcp, cap)
    del lcp, follower

    # One-token matches may lie in another bucket: take them from the first-occurrence table.
    short = length <= 1
    length[short] = firsts.first[token[short]] < pos[short]
    has_next = np.where(short, firsts.first_f[token] < pos, next_pos < km.INF) & (length > 0)
    len_byte = np.empty(rows, dtype=np.uint8)
    len_byte[order] = length | np.where(has_next, 0, fmt.NO_FOLLOWER_BIT)
    next_row = np.empty(rows, dtype=np.int64)
    next_row[order] = np.where(has_next, np.where(short, firsts.first_tok[token], next_tok), 0)

    # Rows of run k are shard k's prefix entries lo..hi: store them in that (sorted) order.
    width = np.dtype(layout.token_dtype).itemsize
    follow_width = follow.dtype.itemsize
    for k, (lo, hi) in enumerate(ranges):
        if hi == lo:
            continue
        r = slice(run_starts[k], run_starts[k + 1])
        n = layout.sizes[k]
        pieces = [
            (lo, len_byte[r]),
            (n + lo * width, next_row[r].astype(layout.token_dtype)),
            (n * (1 + width) + lo * follow_width, follow[r]),
        ]
        fmt.write_at(sorted_features_path(layout, k), pieces)
    return rows


def sampled_keys(layout: Layout, k: int, prefix: np.ndarray) -> np.ndarray:
    """The first key word of every ``KEY_SAMPLE``-th rank of shard ``k`` (the ``.keys`` file)."""
    stream = layout.stream()
    tokens = stream.shard(k)
    tail, nxt = _neighbours(layout, stream, k)
    local = np.ascontiguousarray(prefix[:: fmt.KEY_SAMPLE])
    per_word = 64 // layout.elem_bits
    keys = np.empty((len(local), 1), dtype=np.uint64)
    depth = np.empty(len(local), dtype=np.uint8)
    follower = np.empty(len(local), dtype=np.int32)
    km.gather_keys(
        tokens,
        _words(tokens, layout),
        tail,
        nxt,
        layout.shard_start(k),
        local,
        _doc_bits(layout),
        layout.num_tokens,
        per_word,
        layout.separator,
        layout.elem_bits,
        keys,
        depth,
        follower,
    )
    return keys[:, 0]


def _follow_dtype(layout: Layout) -> np.dtype:
    return fmt.sort_dtype(layout.token_dtype, layout.separator)


def sorted_features_path(layout: Layout, k: int):
    """Pass 3's work file for shard ``k``: features, then the ``.follow`` array, in ``.prefix``
    order (removed at the end)."""
    return layout.path(k, "match").with_suffix(".match-sorted")


def create_sorted_feature_files(layout: Layout) -> None:
    """Create the work files of the shards whose ``.match`` is not written yet.

    They are sparse: no space is taken until the jobs write into them (``fmt.write_at``, which
    raises ENOSPC on a full disk).
    """
    width = 1 + np.dtype(layout.token_dtype).itemsize + _follow_dtype(layout).itemsize
    for k, n in enumerate(layout.sizes):
        path = sorted_features_path(layout, k)
        if layout.path(k, "match").exists() or (path.exists() and path.stat().st_size == n * width):
            continue
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            f.truncate(n * width)
        os.replace(tmp, path)
    fmt.fsync_dir(Path(layout.directory))  # the jobs recorded in the catalog live in these files


def write_match_file(layout: Layout, k: int) -> tuple[int, int]:
    """Scatter shard ``k``'s sorted-order features to position order (the ``.match`` file) and
    write its ``.follow`` and ``.keys`` files.

    The work file is removed only after both files are complete (``.match`` last), so a re-run
    after a crash in between finds the ``.match`` and has nothing to do.
    """
    if not sorted_features_path(layout, k).exists() and layout.path(k, "match").exists():
        return k, layout.sizes[k]
    n, dtype = layout.sizes[k], np.dtype(layout.token_dtype)
    prefix = np.fromfile(layout.path(k, "prefix"), dtype=fmt.PREFIX_DTYPE)
    work = np.fromfile(sorted_features_path(layout, k), dtype=np.uint8)
    out = np.empty(n * (1 + dtype.itemsize), dtype=np.uint8)
    out[:n][prefix] = work[:n]
    width = n * (1 + dtype.itemsize)
    out[n:].view(dtype)[prefix] = work[n:width].view(dtype)
    fmt.write_atomic(layout.path(k, "follow"), work[width:])
    fmt.write_atomic(layout.path(k, "keys"), sampled_keys(layout, k, prefix))
    fmt.write_atomic(layout.path(k, "match"), out)
    sorted_features_path(layout, k).unlink()
    return k, n
