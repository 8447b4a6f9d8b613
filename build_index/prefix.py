"""Pass 2: sort each shard's positions by preceding context (one shard per unit of work).

Beside the sorted positions (``.prefix``) it writes what pass 3's merge compares, so that pass
3 never goes back to the tokens: the first ``sort_depth`` key elements of every entry,
front-coded (``.run``), and where each bucket starts in it (``.runidx``). All three are work
files, removed by pass 3.
"""

from __future__ import annotations

import time

import numpy as np

from teralm.build_index.layout import Layout
from teralm.index import format as fmt
from teralm.kernels.sort import encode_run, sort_shard

RUN_PARTS = ("lcp", "depth", "follow", "elements")
SORT_BYTES_PER_TOKEN = 28  # memory of sorting a shard, per token of its context (measured: 24.5)


def sort_one_shard(layout: Layout, k: int) -> tuple[int, float, int]:
    """Write the shard's ``.prefix``, ``.run`` and ``.runidx`` atomically; returns (k, seconds,
    bytes written)."""
    began = time.perf_counter()
    offsets = layout.offsets()
    lo, doc_starts = layout.context_bounds(k, offsets)
    start, stop = layout.shard_start(k), layout.shard_start(k) + layout.sizes[k]
    stream = layout.stream()
    context = stream[lo:stop]
    order = sort_shard(context, start - lo, doc_starts, layout.separator, layout.sort_dtype)
    after = -1
    if stop < layout.num_tokens and offsets[np.searchsorted(offsets, stop)] != stop:
        after = int(stream[stop : stop + 1][0])
    run = encode_run(
        context,
        start - lo,
        doc_starts,
        order,
        layout.sort_depth,
        layout.separator,
        after,
        layout.sort_dtype,
    )
    fmt.write_atomic(layout.path(k, "run"), b"".join(run[p].tobytes() for p in RUN_PARTS))
    fmt.write_atomic(layout.path(k, "runidx"), run["starts"])
    fmt.write_atomic(layout.path(k, "prefix"), order.astype(fmt.PREFIX_DTYPE, copy=False))
    written = sum(layout.path(k, kind).stat().st_size for kind in ("prefix", "run", "runidx"))
    return k, time.perf_counter() - began, written


def run_index(layout: Layout, k: int) -> np.ndarray:
    """``[2, 65537]``: the entry and the element where each bucket starts in shard ``k``'s run."""
    return np.fromfile(layout.path(k, "runidx"), dtype="<u8").reshape(2, fmt.NUM_BUCKETS + 1)


def read_run(layout: Layout, k: int, lo: int, hi: int, e0: int) -> dict[str, np.ndarray]:
    """Entries ``[lo, hi)`` of shard ``k``'s run, whose stored elements start at ``e0``: one
    sequential read of each part they occupy."""
    n, width = layout.sizes[k], layout.sort_dtype.itemsize
    with open(layout.path(k, "run"), "rb") as f:
        run = {"lcp": _read(f, lo, hi - lo, np.uint8), "depth": _read(f, n + lo, hi - lo, np.uint8)}
        stored = int(run["depth"].sum(dtype=np.int64) - run["lcp"].sum(dtype=np.int64))
        run["follow"] = _read(f, 2 * n + lo * width, hi - lo, layout.sort_dtype)
        run["elements"] = _read(f, (2 + width) * n + e0 * width, stored, layout.sort_dtype)
    return run


def _read(f, offset: int, count: int, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    data = np.empty(count, dtype)
    f.seek(offset)
    if f.readinto(memoryview(data).cast("B")) != data.nbytes:
        raise OSError(f"{f.name}: shorter than its run index says")
    return data
