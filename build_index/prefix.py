"""Pass 2: sort each shard's positions by preceding context (one shard per unit of work).

Beside the sorted positions (``.prefix``) it writes what pass 3's merge compares, so that pass
3 never goes back to the tokens: the first ``sort_depth`` key elements of every entry,
front-coded (``.run``), and where each bucket starts in it (``.runidx``). All three are work
files, removed by pass 3.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from teralm.build_index.layout import Layout
from teralm.files import fsync_path, write_atomic
from teralm.index import format as fmt
from teralm.kernels.sort import sort_shard

RUN_PARTS = ("lcp", "depth", "follow", "elements")
SORT_FILES = ("prefix", "run", "runidx")  # pass 2's files of a shard
SORT_BYTES_PER_TOKEN = 28  # memory of sorting a shard, per token of its context (measured: 24.5)


def sort_one_shard(layout: Layout, k: int) -> tuple[int, float, int]:
    """Write the shard's ``.prefix``, ``.run`` and ``.runidx`` atomically but unflushed
    (``flush_shard``); returns (k, seconds, bytes written)."""
    began = time.perf_counter()
    offsets = layout.offsets()
    lo, doc_starts = layout.context_bounds(k, offsets)
    start, stop = layout.shard_start(k), layout.shard_start(k) + layout.sizes[k]
    stream = layout.stream()
    context = stream[lo:stop]
    after = -1
    if stop < layout.num_tokens and offsets[np.searchsorted(offsets, stop)] != stop:
        after = int(stream[stop : stop + 1][0])
    run = sort_shard(
        context,
        start - lo,
        doc_starts,
        layout.separator,
        layout.sort_dtype,
        layout.sort_depth,
        after,
    )
    # Not flushed here: the main process flushes them (flush_shard) before it records the shard,
    # so that this worker sorts its next shard while the disk writes this one.
    order = run["order"].astype(fmt.PREFIX_DTYPE, copy=False)
    parts = b"".join(run[p].tobytes() for p in RUN_PARTS)
    write_atomic(layout.path(k, "run"), parts, sync=False)
    write_atomic(layout.path(k, "runidx"), run["starts"], sync=False)
    write_atomic(layout.path(k, "prefix"), order, sync=False)
    written = sum(layout.path(k, kind).stat().st_size for kind in SORT_FILES)
    return k, time.perf_counter() - began, written


def flush_shard(layout: Layout, k: int) -> None:
    """fsync shard ``k``'s pass-2 files and the index folder (their renames)."""
    for kind in SORT_FILES:
        fsync_path(layout.path(k, kind))
    fsync_path(Path(layout.directory))


def run_index(layout: Layout, k: int) -> np.ndarray:
    """``[2, 65537]``: the entry and the element where each bucket starts in shard ``k``'s run."""
    return np.fromfile(layout.path(k, "runidx"), dtype="<u8").reshape(2, fmt.NUM_BUCKETS + 1)


def read_run(layout: Layout, k: int, lo: int, hi: int, e0: int) -> dict[str, np.ndarray]:
    """Entries ``[lo, hi)`` of shard ``k``'s run, whose stored elements start at ``e0``, and
    their positions in the shard (``prefix``): one read of each part they occupy."""
    n, width = layout.sizes[k], layout.sort_dtype.itemsize
    with _open_unread_ahead(layout.path(k, "run")) as f:
        run = {"lcp": _read(f, lo, hi - lo, np.uint8), "depth": _read(f, n + lo, hi - lo, np.uint8)}
        stored = int(run["depth"].sum(dtype=np.int64) - run["lcp"].sum(dtype=np.int64))
        run["follow"] = _read(f, 2 * n + lo * width, hi - lo, layout.sort_dtype)
        run["elements"] = _read(f, (2 + width) * n + e0 * width, stored, layout.sort_dtype)
    with _open_unread_ahead(layout.path(k, "prefix")) as f:
        run["prefix"] = _read(f, lo * fmt.PREFIX_DTYPE.itemsize, hi - lo, fmt.PREFIX_DTYPE)
    return run


ENTRY_PARTS = ("lcp", "depth", "follow", "prefix")  # one value per entry in a read run


def run_bytes(layout: Layout, entries: int, elements: int) -> int:
    """Bytes that ``read_run`` returns for ``entries`` entries holding ``elements`` elements."""
    width = layout.sort_dtype.itemsize
    return entries * (2 + width + fmt.PREFIX_DTYPE.itemsize) + elements * width


def split_run(run: dict, n: int) -> tuple[dict, dict]:
    """A read run's first ``n`` entries, and the rest (views, not copies)."""
    e = int(run["depth"][:n].sum(dtype=np.int64) - run["lcp"][:n].sum(dtype=np.int64))
    head = {p: run[p][:n] for p in ENTRY_PARTS} | {"elements": run["elements"][:e]}
    tail = {p: run[p][n:] for p in ENTRY_PARTS} | {"elements": run["elements"][e:]}
    return head, tail


def join_runs(first: dict, then: dict) -> dict:
    """Two read runs of consecutive entries as one."""
    return {p: np.concatenate([first[p], then[p]]) for p in first}


def _open_unread_ahead(path: Path):
    """``path`` opened for reads of exactly the bytes asked for. The kernel's read-ahead (8 MiB
    per file on some disks) would fetch far more for each of the hundreds of shards that a
    merge reads a little of at a time; in a memory cgroup, those pages pushed each other out
    before they were used, and the disk read 200 times what the merge needed."""
    f = open(path, "rb", buffering=0)  # noqa: SIM115 (the caller closes it)
    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
    return f


def _read(f, offset: int, count: int, dtype) -> np.ndarray:
    data = np.empty(count, dtype)
    view = memoryview(data).cast("B")
    while view:
        got = os.preadv(f.fileno(), [view], offset)
        if got == 0:
            raise OSError(f"{f.name}: shorter than its run index says")
        view, offset = view[got:], offset + got
    return data
