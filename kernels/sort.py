"""Pass 2 kernel: sort a shard's positions by their reversed, document-bounded context.

The shard (plus up to ``CONTEXT_OVERLAP`` tokens of the previous shard) is laid out reversed with a
separator before every document start, so the suffix array of that stream orders positions by
``x[t], x[t-1], ...`` up to the document start, then the separator. libdivsufsort builds it.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from pydivsufsort import divsufsort


@njit(cache=True, nogil=True)
def byte_histogram(tokens):
    """How often each of the 256 byte values occurs in ``tokens`` (uint8): ``np.bincount``'s
    answer, about 4 times faster (four counters hide the store-to-load dependency)."""
    counts = np.zeros((4, 256), dtype=np.int64)
    n = len(tokens) // 4 * 4
    for i in range(0, n, 4):
        counts[0, tokens[i]] += 1
        counts[1, tokens[i + 1]] += 1
        counts[2, tokens[i + 2]] += 1
        counts[3, tokens[i + 3]] += 1
    for i in range(n, len(tokens)):
        counts[0, tokens[i]] += 1
    return counts.sum(axis=0)


@njit(cache=True)
def _reversed_stream(context, doc_starts, separator, stream, separators):
    """Fill ``stream`` with ``context`` reversed, a separator after each document's first token;
    ``separators`` gets the stream index of each separator, ascending."""
    r = q = 0
    d = len(doc_starts) - 1
    for i in range(len(context) - 1, -1, -1):
        stream[r] = context[i]
        r += 1
        if i == 0 or (d >= 0 and doc_starts[d] == i):
            stream[r] = separator
            separators[q] = r
            r += 1
            q += 1
            if d >= 0 and doc_starts[d] == i:
                d -= 1


def sort_shard(
    context: np.ndarray,
    n_overlap: int,
    doc_starts: np.ndarray,
    separator: int,
    sort_dtype,
    cap: int,
    last_follower: int,
) -> dict[str, np.ndarray]:
    """The shard's positions sorted by reversed context, and their keys front-coded for pass 3.

    ``context`` is the shard's tokens preceded by ``n_overlap`` tokens of context; ``doc_starts``
    are the (sorted) indices into ``context`` where a document begins; ``last_follower`` is the
    token after the shard's last position in its document (-1 if none). Returns ``order`` (the
    positions ``0..len(context)-n_overlap`` in key order) and, per entry, ``lcp`` (key elements
    shared with the previous entry, 0 at a bucket's first entry), ``depth`` (the key's real
    elements, at most ``cap``), ``follow`` (the next token, or the separator) and, in
    ``elements``, its key elements ``lcp..depth`` (element ``j`` is ``context[i - j]``).
    ``starts[0, b]``/``starts[1, b]``: the entry and the element where bucket ``b`` begins.
    """
    n = len(context)
    doc_starts = np.asarray(doc_starts, dtype=np.int64)
    doc_starts = doc_starts[doc_starts > 0]
    length = n + 1 + len(doc_starts)
    itemsize = np.dtype(sort_dtype).itemsize
    spare = (cap * itemsize + 7) // 8 + 1  # keys are read a whole number of words at a time
    words = np.empty((length * itemsize + 7) // 8 + spare, dtype=np.uint64)
    words[-spare:] = 0
    stream = words.view(sort_dtype)[:length]
    separators = np.empty(1 + len(doc_starts), dtype=np.int64)
    _reversed_stream(context, doc_starts, separator, stream, separators)
    rows = divsufsort(stream)
    m = n - n_overlap
    run = {"order": np.empty(m, dtype=np.uint32), "depth": np.empty(m, dtype=np.uint8)}
    kept = _shard_entries(rows, separators, n, n_overlap, cap, run["order"], run["depth"])
    assert kept == m
    rows = rows[:m]
    run["lcp"] = np.empty(m, dtype=np.uint8)
    run["follow"] = np.empty(m, dtype=sort_dtype)
    counts = np.zeros(1 << 16, dtype=np.int64)
    stored = np.zeros(1 << 16, dtype=np.int64)
    follower = last_follower if last_follower >= 0 else separator
    _front_code(
        rows, stream, words, run["depth"], follower, run["lcp"], run["follow"], counts, stored
    )
    run["elements"] = np.empty(int(stored.sum()), dtype=sort_dtype)
    _stored_elements(rows, stream, run["lcp"], run["depth"], run["elements"])
    run["starts"] = np.zeros((2, (1 << 16) + 1), dtype=np.uint64)
    np.cumsum(counts, out=run["starts"][0, 1:])
    np.cumsum(stored, out=run["starts"][1, 1:])
    return run


@njit(cache=True)
def _shard_entries(rows, separators, n, n_overlap, cap, order, depth):
    """Walk ``rows``, the suffix array of the reversed stream, keeping the shard's entries: each
    one's position and depth (its key runs from its stream index to the next separator). Entry
    ``k``'s stream index is left in ``rows[k]`` (the walk is never behind ``k``)."""
    k = 0
    for s in range(len(rows)):
        r = np.int64(rows[s])
        j = np.searchsorted(separators, r)  # separators before r
        if separators[j] == r:
            continue
        i = n - 1 - (r - j)
        if i < n_overlap:
            continue
        order[k] = i - n_overlap
        depth[k] = min(separators[j] - r, cap)
        rows[k] = r
        k += 1
    return k


BLOCK = 1024  # entries whose keys are gathered at once: independent loads, all in flight


@njit(cache=True)
def _gather_keys(rows, k0, k1, words, size, key_words, window):
    """The first ``key_words`` words of the keys of entries ``k0..k1`` into ``window``, one row
    each. A tight loop of loads that do not depend on each other: the CPU overlaps their cache
    misses, which a loop that compares as it loads cannot (its branches wait on each load)."""
    for j in range(k1 - k0):
        b = np.int64(rows[k0 + j]) * size
        for w in range(key_words):
            window[j, w] = _word_at(words, b + 8 * w)


@njit(cache=True)
def _front_code(rows, stream, words, depth, follower, lcp, follow, counts, stored):
    """Per entry, its bucket, lcp with the previous entry and follower: the token before its
    key in the stream (the separator there when the next position starts a document).
    ``words`` is the stream's memory as 64-bit words; keys are compared eight bytes at a time."""
    size = stream.itemsize
    key_words = (np.int64(depth.max()) * size + 7) // 8 if len(depth) else 1
    window = np.zeros((BLOCK + 1, key_words), dtype=np.uint64)  # row 0: the entry before
    previous_bucket = -1
    for k0 in range(0, len(rows), BLOCK):
        k1 = min(k0 + BLOCK, len(rows))
        _gather_keys(rows, k0, k1, words, size, key_words, window[1:])
        for j in range(1, k1 - k0 + 1):
            k = k0 + j - 1
            r = np.int64(rows[k])
            head = window[j, 0]
            bucket = np.int64(head & np.uint64(0xFFFF))
            if size == 1:  # the first two elements, the first in the high byte
                bucket = ((bucket & 0xFF) << 8) | (bucket >> 8)
            common = 0
            if bucket == previous_bucket:
                limit = min(np.int64(depth[k]), np.int64(depth[k - 1])) * size
                common = limit
                for w in range(key_words):
                    x = window[j, w] ^ window[j - 1, w]
                    if x != 0:
                        c = 8 * w
                        while (x & np.uint64(0xFF)) == 0:
                            x >>= np.uint64(8)
                            c += 1
                        common = min(c, limit)
                        break
                common //= size
            lcp[k] = common
            follow[k] = stream[r - 1] if r > 0 else follower
            counts[bucket] += 1
            stored[bucket] += np.int64(depth[k]) - common
            previous_bucket = bucket
        window[0] = window[k1 - k0]


@njit(cache=True, inline="always")
def _word_at(words, b):
    """The eight bytes from byte ``b`` of ``words`` (little-endian), at any alignment."""
    shift = np.uint64((b & 7) * 8)
    low, high = words[b >> 3], words[(b >> 3) + 1]
    return (low >> shift) | ((high << (np.uint64(63) - shift)) << np.uint64(1))


@njit(cache=True)
def _stored_elements(rows, stream, lcp, depth, elements):
    e = 0
    for k in range(len(rows)):
        r = np.int64(rows[k])
        for j in range(np.int64(lcp[k]), np.int64(depth[k])):
            elements[e] = stream[r + j]
            e += 1


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
