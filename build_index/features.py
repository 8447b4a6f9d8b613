"""Pass 3: causal longest-match features of every token against all earlier tokens of the corpus,
and the global sorted order that queries search.

The work is split by key bucket (leading 16 bits of the reversed context): a job takes a range of
buckets, reads that range of every shard's front-coded keys (pass 2's ``.run``, a few sequential
reads per shard), merges them (S-way, O(log S) per entry), writes its slice of the global order
and sweeps it forwards and backwards (see teralm.kernels.match). Jobs write disjoint parts of
the order files and of the shards' work files, so they run in any order and in parallel; a job
that was cut short is simply run again. Nothing reads tokens at random: memory is set by the job
size, whatever the corpus size.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from teralm.build_index.layout import Layout
from teralm.build_index.prefix import read_run, run_index
from teralm.index import format as fmt
from teralm.kernels import match as km

BUCKETS = fmt.NUM_BUCKETS


@dataclass(frozen=True)
class FirstOccurrences:
    """Per token value: first position, first position with a follower, that follower."""

    first: np.ndarray
    first_f: np.ndarray
    first_tok: np.ndarray


def job_bytes_per_row(layout: Layout) -> int:
    """Peak memory of a features job per merged entry (measured, rounded up)."""
    return 8 * km.key_words(layout.sort_depth, layout.elem_bits) + 128


def local_doc_bits(layout: Layout, offsets: np.ndarray, k: int) -> np.ndarray:
    """Bitmap of the document starts in shard ``k`` and at the position just after it (the
    offsets end with ``num_tokens``: nothing follows the corpus's last token)."""
    start, n = layout.shard_start(k), layout.sizes[k]
    inside = offsets[np.searchsorted(offsets, start) : np.searchsorted(offsets, start + n, "right")]
    local = inside.astype(np.int64) - start
    return km.doc_start_bits(np.append(local, n + 1), n + 1)  # it drops the closing entry


def make_plan(layout: Layout) -> tuple[FirstOccurrences, np.ndarray]:
    """One sequential scan of the corpus for the first-occurrence tables, and ``starts``
    [bucket + 1]: where each bucket starts in the global order (from pass 2's run indexes)."""
    stream, offsets = layout.stream(), layout.offsets()
    vocab = max(layout.vocab_size, 256)
    first = np.full(vocab, km.INF, dtype=np.int64)
    first_f = np.full(vocab, km.INF, dtype=np.int64)
    first_tok = np.zeros(vocab, dtype=np.int64)
    starts = np.zeros(BUCKETS + 1, dtype=np.int64)
    for k in range(layout.num_shards):
        starts += run_index(layout, k)[0].astype(np.int64)
        stop = layout.shard_start(k) + layout.sizes[k]
        after = stream[stop : stop + 1]
        km.first_occurrences(
            stream.shard(k),
            after if len(after) else np.zeros(1, stream.dtype),
            layout.shard_start(k),
            local_doc_bits(layout, offsets, k),
            first,
            first_f,
            first_tok,
        )
    return FirstOccurrences(first, first_f, first_tok), starts


def split_jobs(starts: np.ndarray, target: int) -> list[tuple[int, int]]:
    """Consecutive bucket ranges of about ``target`` positions each (a bucket is never split)."""
    per_bucket = np.diff(starts)
    jobs, begin, acc = [], 0, 0
    for b in np.flatnonzero(per_bucket):
        acc += int(per_bucket[b])
        if acc >= target:
            jobs.append((begin, int(b) + 1))
            begin, acc = int(b) + 1, 0
    if acc:
        jobs.append((begin, BUCKETS))
    return jobs


def run_spans(layout: Layout, jobs: list[tuple[int, int]]) -> np.ndarray:
    """``[job, shard]``: the entries ``[lo, hi)`` and the elements ``[e0, e1)`` of the shard's
    run that hold the job's buckets (one read of each ``.runidx``)."""
    spans = np.zeros((len(jobs), layout.num_shards, 4), dtype=np.int64)
    first = np.array([b0 for b0, _ in jobs], dtype=np.int64)
    last = np.array([b1 for _, b1 in jobs], dtype=np.int64)
    for k in range(layout.num_shards):
        index = run_index(layout, k).astype(np.int64)
        spans[:, k] = np.stack(
            [index[0, first], index[0, last], index[1, first], index[1, last]], 1
        )
    return spans


def _merged_keys(layout: Layout, spans: np.ndarray):
    """The job's entries of every shard, one run per shard: keys, depth, follower, position."""
    elem_bits, depth_cap = layout.elem_bits, layout.sort_depth
    run_starts = np.cumsum([0] + [hi - lo for lo, hi, _, _ in spans.tolist()]).astype(np.int64)
    rows = int(run_starts[-1])
    keys = np.empty((rows, km.key_words(depth_cap, elem_bits)), dtype=np.uint64)
    depth = np.empty(rows, dtype=np.uint8)
    follow = np.empty(rows, dtype=layout.sort_dtype)
    pos = np.empty(rows, dtype=np.int64)
    for k, (lo, hi, e0, e1) in enumerate(spans.tolist()):
        if hi == lo:
            continue
        r = slice(run_starts[k], run_starts[k + 1])
        run = read_run(layout, k, lo, hi, e0, e1)
        km.decode_run(
            run["lcp"],
            run["depth"],
            run["elements"],
            layout.separator,
            elem_bits,
            depth_cap,
            keys[r],
        )
        depth[r], follow[r] = run["depth"], run["follow"]
        prefix = np.memmap(layout.path(k, "prefix"), dtype=fmt.PREFIX_DTYPE, mode="r")
        pos[r] = np.asarray(prefix[lo:hi], dtype=np.int64) + layout.shard_start(k)
        del prefix
    return keys, depth, follow, pos, run_starts


def features_job(
    layout: Layout, firsts: FirstOccurrences, spans: np.ndarray, global_start: int
) -> int:
    """Merge the entries in ``spans`` (a row of ``run_spans``: one range per shard), write
    their slice of the global order (it starts at rank ``global_start``) and their features.

    Returns the number of positions.
    """
    cap, elem_bits = layout.max_match, layout.elem_bits
    keys, depth, follow, pos, run_starts = _merged_keys(layout, spans)
    rows = len(pos)
    order = km.merge_sorted(keys, run_starts)
    lcp = np.minimum(km.adjacent_lcp(keys, depth, order, elem_bits), cap)
    first_words = keys[order, 0]
    del keys
    token = (first_words >> np.uint64(64 - elem_bits)).astype(np.int64)
    _write_order(layout, global_start, pos[order], follow[order], first_words)
    del first_words
    follower = follow.astype(np.int32)
    follower[follow == layout.separator] = -1
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

    # Rows of run k are shard k's sorted entries lo..hi: store them in that order.
    width = np.dtype(layout.token_dtype).itemsize
    for k, (lo, hi, _, _) in enumerate(spans.tolist()):
        if hi == lo:
            continue
        r = slice(run_starts[k], run_starts[k + 1])
        n = layout.sizes[k]
        pieces = [(lo, len_byte[r]), (n + lo * width, next_row[r].astype(layout.token_dtype))]
        fmt.write_at(sorted_features_path(layout, k), pieces)
    return rows


def _write_order(layout: Layout, start: int, pos, follow, first_words) -> None:
    """Ranks ``start..start + len(pos)`` of the global order: positions, followers and the
    sampled key words."""
    width = layout.order_width
    packed = pos.astype("<u8").view(np.uint8).reshape(-1, 8)[:, :width]
    fmt.write_at(layout.order_path("positions"), [(start * width, np.ascontiguousarray(packed))])
    fmt.write_at(layout.order_path("follow"), [(start * follow.itemsize, follow)])
    sample = fmt.KEY_SAMPLE
    first = -(-start // sample)  # the first sampled rank at or after start
    words = first_words[first * sample - start :: sample].astype(fmt.KEY_DTYPE)
    if len(words):
        fmt.write_at(layout.order_path("keys"), [(first * fmt.KEY_DTYPE.itemsize, words)])


def sorted_features_path(layout: Layout, k: int):
    """Pass 3's work file for shard ``k``: features in sorted order (removed at the end)."""
    return layout.path(k, "match").with_suffix(".match-sorted")


def _sparse(path: Path, size: int) -> None:
    """Create ``path`` as an empty file of ``size`` bytes, unless it is there with that size."""
    if path.exists() and path.stat().st_size == size:
        return
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.truncate(size)
    os.replace(tmp, path)


def create_work_files(layout: Layout) -> None:
    """Create the order files and the work files of the shards whose ``.match`` is not written
    yet. They are sparse: no space is taken until the jobs write into them (``fmt.write_at``,
    which raises ENOSPC on a full disk)."""
    sizes = fmt.order_file_bytes(
        {
            "num_tokens": layout.num_tokens,
            "token_dtype": layout.token_dtype,
            "separator": layout.separator,
        }
    )
    for kind, size in sizes.items():
        if kind != "buckets":
            _sparse(layout.order_path(kind), size)
    width = 1 + np.dtype(layout.token_dtype).itemsize
    for k, n in enumerate(layout.sizes):
        if not layout.path(k, "match").exists():
            _sparse(sorted_features_path(layout, k), n * width)
    fmt.fsync_dir(Path(layout.directory))  # the jobs recorded in the catalog live in these files


_libc = ctypes.CDLL(None, use_errno=True)
PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
PAGE = 4096


def _punch(fd: int, start: int, stop: int) -> None:
    """Give back the disk space of the whole pages inside ``[start, stop)`` (they read as zeros
    after); the bytes of pages it shares with its neighbours stay."""
    a, b = -(-start // PAGE) * PAGE, stop // PAGE * PAGE
    if b > a and _libc.fallocate(fd, PUNCH_HOLE, ctypes.c_long(a), ctypes.c_long(b - a)) != 0:
        errno = ctypes.get_errno()
        if errno not in (95,):  # EOPNOTSUPP: a filesystem without holes keeps the space
            raise OSError(errno, os.strerror(errno))


def release_runs(layout: Layout, spans: np.ndarray) -> None:
    """Give back the disk space of the parts of pass 2's keys that a finished job merged
    (``spans``: its row of ``run_spans``). Called only after the job is recorded as done: what
    it frees is never read again."""
    width = layout.sort_dtype.itemsize
    for k, (n, (lo, hi, e0, e1)) in enumerate(zip(layout.sizes, spans.tolist())):
        path = layout.path(k, "run")
        if hi == lo or not path.exists():
            continue
        fd = os.open(path, os.O_WRONLY)
        try:
            for start, stop in (
                (lo, hi),
                (n + lo, n + hi),
                (2 * n + lo * width, 2 * n + hi * width),
                ((2 + width) * n + e0 * width, (2 + width) * n + e1 * width),
            ):
                _punch(fd, start, stop)
        finally:
            os.close(fd)


def remove_runs(layout: Layout) -> None:
    """Drop pass 2's keys once every job has merged them."""
    for k in range(layout.num_shards):
        for kind in ("run", "runidx"):
            layout.path(k, kind).unlink(missing_ok=True)


def write_match_file(layout: Layout, k: int) -> tuple[int, int]:
    """Scatter shard ``k``'s sorted-order features to position order (the ``.match`` file), then
    remove the shard's work files (``.prefix`` last: a re-run after a crash in between finds
    the ``.match`` and has nothing to do)."""
    work = sorted_features_path(layout, k)
    if layout.path(k, "match").exists():
        work.unlink(missing_ok=True)
        layout.path(k, "prefix").unlink(missing_ok=True)
        return k, layout.sizes[k]
    n, dtype = layout.sizes[k], np.dtype(layout.token_dtype)
    prefix = np.fromfile(layout.path(k, "prefix"), dtype=fmt.PREFIX_DTYPE)
    sorted_features = np.fromfile(work, dtype=np.uint8)
    out = np.empty(n * (1 + dtype.itemsize), dtype=np.uint8)
    out[:n][prefix] = sorted_features[:n]
    out[n:].view(dtype)[prefix] = sorted_features[n:].view(dtype)
    fmt.write_atomic(layout.path(k, "match"), out)
    work.unlink()
    layout.path(k, "prefix").unlink()
    return k, n
