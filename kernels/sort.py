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
