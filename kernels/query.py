"""Query kernels: search a shard's ``.prefix`` order (positions sorted by reversed context).

Key element ``j`` of position ``p`` is ``x[p-j]`` while that lies inside the document and no more
than ``overlap`` tokens before the shard, then the separator. Entries whose first ``j`` elements
equal a query's are a contiguous range; element ``j`` is sorted within it, so each longer suffix of
the query narrows the range by two binary searches.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from teralm.kernels.match import _is_doc_start


@njit(cache=True, inline="always")
def _element(tokens, tail, prefix, shard_start, lowest, doc_bits, separator, i, j):
    """Key element ``j`` of the entry at rank ``i`` (its first ``j`` elements are real tokens)."""
    q = np.int64(prefix[i])
    p = shard_start + q
    if j > 0 and (_is_doc_start(doc_bits, p - j + 1) or p - j < lowest):
        return separator
    k = q - j
    return np.int64(tokens[k]) if k >= 0 else np.int64(tail[len(tail) + k])


@njit(cache=True)
def narrow(tokens, tail, prefix, shard_start, lowest, doc_bits, separator, lo, hi, j, value):
    """Sub-range of ranks ``[lo, hi)`` whose key element ``j`` equals ``value``."""
    a, b = lo, hi
    while a < b:  # first rank with element >= value
        m = (a + b) >> 1
        if _element(tokens, tail, prefix, shard_start, lowest, doc_bits, separator, m, j) < value:
            a = m + 1
        else:
            b = m
    start = a
    b = hi
    while a < b:  # first rank with element > value
        m = (a + b) >> 1
        if _element(tokens, tail, prefix, shard_start, lowest, doc_bits, separator, m, j) <= value:
            a = m + 1
        else:
            b = m
    return start, a


@njit(cache=True)
def match_ranges(
    tokens,
    tail,
    prefix,
    shard_start,
    lowest,
    doc_bits,
    separator,
    reversed_contexts,
    starts,
    ranges,
):
    """For each context (reversed, concatenated; ``starts`` delimit them) fill ``ranges[c, l]``
    with the rank range of its length-``l`` suffix, as far as it occurs. Returns lengths."""
    count = len(starts) - 1
    reached = np.zeros(count, dtype=np.int64)
    for c in range(count):
        lo, hi = np.int64(0), np.int64(len(prefix))
        ranges[c, 0, 0] = lo
        ranges[c, 0, 1] = hi
        for j in range(starts[c + 1] - starts[c]):
            value = reversed_contexts[starts[c] + j]
            lo, hi = narrow(
                tokens, tail, prefix, shard_start, lowest, doc_bits, separator, lo, hi, j, value
            )
            if lo == hi:
                break
            ranges[c, j + 1, 0] = lo
            ranges[c, j + 1, 1] = hi
            reached[c] = j + 1
    return reached


@njit(cache=True)
def followers(tokens, nxt, prefix, shard_start, doc_bits, n_total, ranks):
    """Tokens that follow the entries at ``ranks`` in their documents (-1: none)."""
    n = len(tokens)
    out = np.empty(len(ranks), dtype=np.int64)
    for i in range(len(ranks)):
        q = np.int64(prefix[ranks[i]])
        p = shard_start + q
        if p + 1 < n_total and not _is_doc_start(doc_bits, p + 1):
            out[i] = tokens[q + 1] if q + 1 < n else nxt[0]
        else:
            out[i] = -1
    return out
