"""Pass 2 kernel: sort a shard's positions by their reversed, document-bounded context.

The shard (plus up to ``CONTEXT_OVERLAP`` tokens of the previous shard) is laid out reversed with a
separator before every document start, so the suffix array of that stream orders positions by
``x[t], x[t-1], ...`` up to the document start, then the separator. libdivsufsort builds it.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from pydivsufsort import divsufsort


@njit(cache=True)
def _reversed_stream(context, doc_starts, separator, stream, origin):
    """Fill ``stream`` with ``context`` reversed, a separator after each document's first token.

    ``origin[r]`` is the context index of stream entry ``r`` (-1 for separators).
    """
    r = 0
    d = len(doc_starts) - 1
    for i in range(len(context) - 1, -1, -1):
        stream[r] = context[i]
        origin[r] = i
        r += 1
        if i == 0 or (d >= 0 and doc_starts[d] == i):
            stream[r] = separator
            origin[r] = -1
            r += 1
            if d >= 0 and doc_starts[d] == i:
                d -= 1
    return r


@njit(cache=True)
def _shard_positions(suffix_array, origin, n_overlap, out):
    k = 0
    for r in suffix_array:
        i = origin[r]
        if i >= n_overlap:
            out[k] = i - n_overlap
            k += 1
    return k


def sort_shard(
    context: np.ndarray, n_overlap: int, doc_starts: np.ndarray, separator: int, sort_dtype
) -> np.ndarray:
    """Positions ``0..len(context)-n_overlap`` of the shard, sorted by reversed context.

    ``context`` is the shard's tokens preceded by ``n_overlap`` tokens of context; ``doc_starts``
    are the (sorted, > 0) indices into ``context`` where a document begins.
    """
    n = len(context)
    doc_starts = np.asarray(doc_starts, dtype=np.int64)
    length = n + 1 + len(doc_starts[doc_starts > 0])
    stream = np.empty(length, dtype=sort_dtype)
    origin = np.empty(length, dtype=np.int32 if length < 2**31 else np.int64)
    filled = _reversed_stream(context, doc_starts[doc_starts > 0], separator, stream, origin)
    assert filled == length
    suffix_array = divsufsort(stream)
    del stream
    out = np.empty(n - n_overlap, dtype=np.uint32)
    k = _shard_positions(suffix_array, origin, n_overlap, out)
    assert k == len(out)
    return out


def sort_shard_reference(
    context: np.ndarray, n_overlap: int, doc_starts: np.ndarray, separator: int
) -> np.ndarray:
    """Obviously-correct O(n^2 log n) version of :func:`sort_shard`, for tests."""
    starts = set(int(s) for s in doc_starts) | {0}
    keys = []
    for i in range(n_overlap, len(context)):
        key = []
        j = i
        while True:
            key.append(int(context[j]))
            if j in starts:
                break
            j -= 1
        key.append(separator)
        keys.append((key, i - n_overlap))
    keys.sort()
    return np.array([pos for _, pos in keys], dtype=np.uint32)


@njit(cache=True)
def _run_sizes(
    context, starts, n_overlap, order, cap, elem_bits, separator, lcp, depth, counts, stored
):
    """Per sorted entry: its key's real elements (``depth``, at most ``cap``) and the elements
    it shares with the previous entry's key (``lcp``; 0 at the first entry of a bucket); per
    bucket, its entries and the elements they store."""
    previous = -1
    for r in range(len(order)):
        i = np.int64(order[r]) + n_overlap
        d = min(i - starts[i] + 1, cap)
        depth[r] = d
        second = np.int64(context[i - 1]) if d >= 2 else -1
        if elem_bits == 16:
            bucket = np.int64(context[i])
        else:
            bucket = (np.int64(context[i]) << 8) | (second if d >= 2 else separator)
        common = 0
        if bucket == previous:
            prev = np.int64(order[r - 1]) + n_overlap
            limit = min(d, depth[r - 1])
            while common < limit and context[i - common] == context[prev - common]:
                common += 1
        lcp[r] = common
        counts[bucket] += 1
        stored[bucket] += d - common
        previous = bucket


@njit(cache=True)
def _fill_run(
    context, n_overlap, order, lcp, depth, starts, separator, last_follower, follow, elements
):
    """The stored elements of every entry (those after its ``lcp``) and its follower."""
    e = 0
    for r in range(len(order)):
        i = np.int64(order[r]) + n_overlap
        for j in range(lcp[r], depth[r]):
            elements[e] = context[i - j]
            e += 1
        if i + 1 < len(context):
            follow[r] = context[i + 1] if starts[i + 1] != i + 1 else separator
        else:
            follow[r] = last_follower if last_follower >= 0 else separator


@njit(cache=True)
def _doc_start_of(n, doc_starts, starts):
    """For every context index, the index of its document's start (0 before the first)."""
    d, current = 0, 0
    for i in range(n):
        while d < len(doc_starts) and doc_starts[d] <= i:
            current = doc_starts[d]
            d += 1
        starts[i] = current


def encode_run(
    context: np.ndarray,
    n_overlap: int,
    doc_starts: np.ndarray,
    order: np.ndarray,
    cap: int,
    separator: int,
    last_follower: int,
    sort_dtype,
) -> dict[str, np.ndarray]:
    """The sorted shard's keys, front-coded, for pass 3's streaming merge.

    ``order`` is :func:`sort_shard`'s answer for the same ``context``; ``last_follower`` is the
    token after the shard's last position in its document (-1 if none). Per entry: ``lcp`` (key
    elements shared with the previous entry, 0 at a bucket's first entry), ``depth`` (the key's
    real elements, at most ``cap``), ``follow`` (the next token, or the separator) and, in
    ``elements``, its key elements ``lcp..depth`` (element ``j`` is ``context[i - j]``).
    ``starts[0, b]``/``starts[1, b]``: the entry and the element where bucket ``b`` begins.
    """
    n = len(order)
    elem_bits = 8 * np.dtype(sort_dtype).itemsize
    starts = np.empty(len(context), dtype=np.int32 if len(context) < 2**31 else np.int64)
    _doc_start_of(len(context), np.asarray(doc_starts, dtype=np.int64), starts)
    lcp = np.empty(n, dtype=np.uint8)
    depth = np.empty(n, dtype=np.uint8)
    counts = np.zeros(1 << 16, dtype=np.int64)
    stored = np.zeros(1 << 16, dtype=np.int64)
    _run_sizes(
        context, starts, n_overlap, order, cap, elem_bits, separator, lcp, depth, counts, stored
    )
    follow = np.empty(n, dtype=sort_dtype)
    elements = np.empty(int(stored.sum()), dtype=sort_dtype)
    _fill_run(
        context, n_overlap, order, lcp, depth, starts, separator, last_follower, follow, elements
    )
    index = np.zeros((2, (1 << 16) + 1), dtype=np.uint64)
    np.cumsum(counts, out=index[0, 1:])
    np.cumsum(stored, out=index[1, 1:])
    return {"lcp": lcp, "depth": depth, "follow": follow, "elements": elements, "starts": index}
