"""Pass 2: sort each shard's positions by preceding context (one shard per unit of work)."""

from __future__ import annotations

import time

from teralm.build_index.layout import Layout
from teralm.index import format as fmt
from teralm.kernels.sort import sort_shard


def sort_one_shard(layout: Layout, k: int) -> tuple[int, float]:
    """Write ``shard-k.prefix`` atomically; returns (k, seconds)."""
    began = time.perf_counter()
    lo, doc_starts = layout.context_bounds(k, layout.offsets())
    start = layout.shard_start(k)
    context = layout.stream()[lo : start + layout.sizes[k]]
    order = sort_shard(context, start - lo, doc_starts, layout.separator, layout.sort_dtype)
    fmt.write_atomic(layout.path(k, "prefix"), order.astype(fmt.PREFIX_DTYPE, copy=False))
    return k, time.perf_counter() - began
