"""Query kernels: search a shard's ``.prefix`` order (positions sorted by reversed context).

Key element ``j`` of position ``p`` is ``x[p-j]`` while that lies inside the document and no more
than ``overlap`` tokens before the shard, then the separator. A query (a context read backwards)
is looked up by one binary search for its insertion point (first over the bucket table and the
sampled key words of ``.keys``, then over ``.prefix`` itself); the entries sharing most elements
with it sit next to that point, and those sharing ``l`` elements form a block around it: a
bucket when ``l`` elements fit in the bucket's 16 bits, else found by galloping outwards. The
tokens that follow a block are one contiguous slice of ``.follow``.
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit, types
from numba.extending import intrinsic

from teralm.index.format import IndexDamaged
from teralm.kernels.match import _doc_depth

# what the kernels raise IndexDamaged with, for a value they cannot use (checked where read)
PREFIX_OUT_OF_RANGE = "a .prefix entry lies outside its shard"
FOLLOW_OUT_OF_RANGE = "a .follow entry lies outside the vocabulary"


@njit(cache=True, inline="always")
def _common(shard, doc_bits, separator, i, ctx, end, limit):
    """(common prefix length with the query, and whether the query sorts before the entry's key)
    for the entry at rank ``i``. The query is ``ctx[end-limit:end]`` read backwards (the reversed
    context); a query that is a prefix of the key sorts first. ``shard`` is (tokens, tail,
    prefix, follow, keys, start, lowest)."""
    tokens, tail, prefix, _, _, start, lowest = shard
    q = np.int64(prefix[i])
    if q >= len(tokens):
        raise IndexDamaged(PREFIX_OUT_OF_RANGE)
    p = start + q
    real = min(_doc_depth(doc_bits, p, max(limit, 1)), p - lowest + 1)
    for j in range(limit):
        v = ctx[end - 1 - j]
        if j >= real:
            return j, v < separator
        k = q - j
        e = np.int64(tokens[k]) if k >= 0 else np.int64(tail[len(tail) + k])
        if e != v:
            return j, v < e
    return limit, True


@njit(cache=True, inline="always")
def _matchable(ctx, begin, end, separator):
    """How many of the last tokens of ``ctx[begin:end]`` can match: those after its last
    separator value."""
    m = 0
    while m < end - begin and ctx[end - 1 - m] != separator:
        m += 1
    return m


@njit(cache=True, inline="always")
def _bucket(buckets, elem_bits, ctx, end, m):
    """The query's first key word (its first ``m`` elements, zero-padded) and the rank range
    ``[a, b)`` of the bucket table entries that share its leading 16 bits (or its first ``m``
    elements, when they are fewer bits)."""
    word = np.uint64(0)
    for j in range(64 // elem_bits):
        word <<= np.uint64(elem_bits)
        if j < m:
            word |= np.uint64(ctx[end - 1 - j])
    lead = np.int64(word >> np.uint64(48))
    width = 1 << (16 - min(16, m * elem_bits))
    return word, np.int64(buckets[lead]), np.int64(buckets[lead + width])


@njit(cache=True, nogil=True)
def _shard_range(shard, doc_bits, separator, buckets, elem_bits, sample, ctx, end, m):
    """Longest match of the reversed query in this shard: (length, insertion rank, and the
    common prefix lengths of the ranks at and before it, -1 where there is none).

    The search starts inside the query's bucket (its leading 16 bits: ``buckets[b]`` is where
    bucket ``b`` starts in ``.prefix``), narrows it on the sampled first key words (``.keys``,
    one per ``sample`` ranks; one memory access per step), then binary searches the ranks left.
    """
    n = len(shard[2])
    if n == 0 or m == 0:
        return 0, 0, -1, -1
    word, a, b = _bucket(buckets, elem_bits, ctx, end, m)
    keys = shard[4]
    lo, hi = (a + sample - 1) // sample, (b + sample - 1) // sample  # samples in [a, b)
    s0, s1 = lo, hi
    while s0 < s1:  # first sample whose word is >= the query's
        mid = (s0 + s1) >> 1
        if keys[mid] < word:
            s0 = mid + 1
        else:
            s1 = mid
    if s0 > lo:
        a = (s0 - 1) * sample + 1
    s1 = hi
    while s0 < s1:  # first sample whose word is > the query's
        mid = (s0 + s1) >> 1
        if keys[mid] <= word:
            s0 = mid + 1
        else:
            s1 = mid
    if s0 < hi:
        b = s0 * sample
    while a < b:  # first rank whose key is >= the query
        mid = (a + b) >> 1
        _, before = _common(shard, doc_bits, separator, mid, ctx, end, m)
        if before:
            b = mid
        else:
            a = mid + 1
    right = _common(shard, doc_bits, separator, a, ctx, end, m)[0] if a < n else -1
    left = _common(shard, doc_bits, separator, a - 1, ctx, end, m)[0] if a > 0 else -1
    return max(left, right, 0), a, right, left


@njit(cache=True, nogil=True)
def _expand(shard, doc_bits, separator, buckets, elem_bits, ctx, end, length, found):
    """All ranks sharing ``length`` elements with the query, around its insertion point
    (``found`` is what ``_shard_range`` returned; the caller knows that block is not empty):
    a bucket when ``length`` elements fit in its 16 bits, else gallop outwards, then binary
    search."""
    n = len(shard[2])
    if length == 0:
        return 0, n
    if length * elem_bits <= 16:
        _, lo, hi = _bucket(buckets, elem_bits, ctx, end, length)
        return lo, hi
    at, right, left = found[1], found[2], found[3]

    def shares(i):
        if i == at:
            return right >= length
        if i == at - 1:
            return left >= length
        return _common(shard, doc_bits, separator, i, ctx, end, length)[0] == length

    k = at if at < n and shares(at) else at - 1
    lo, step = k, 1
    while lo - step >= 0 and shares(lo - step):
        lo -= step
        step *= 2
    a = max(lo - step + 1, 0)
    while a < lo:
        mid = (a + lo) >> 1
        if shares(mid):
            lo = mid
        else:
            a = mid + 1
    hi, step = k + 1, 1
    while hi + step - 1 < n and shares(hi + step - 1):
        hi += step
        step *= 2
    b = min(hi + step - 1, n)
    while hi < b:
        mid = (hi + b) >> 1
        if shares(mid):
            hi = mid + 1
        else:
            b = mid
    return lo, hi


def pair_counts(shard_buckets: np.ndarray) -> np.ndarray:
    """``pairs[a]``: the bytes that follow byte ``a`` inside a document as rows ``(byte, count)``,
    most frequent first (ties by byte), then rows of count 0; from the bucket tables of a
    byte-keyed index (bucket ``(f, a)`` holds the keys starting ``f, a``)."""
    sizes = np.diff(shard_buckets.astype(np.int64), axis=1).sum(axis=0)
    counts = sizes.reshape(256, 256).T  # counts[a, f]
    order = np.argsort(-counts, axis=1, kind="stable")
    return np.ascontiguousarray(np.stack([order, np.take_along_axis(counts, order, 1)], axis=-1))


@njit(cache=True, inline="always")
def _room(rows, size):
    """``rows``, or a copy at least twice as long, with room for ``size`` rows."""
    if size <= len(rows):
        return rows
    grown = np.empty((max(2 * len(rows), size), 2), dtype=rows.dtype)
    grown[: len(rows)] = rows
    return grown


def shard_table(shards) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """The shards as the kernels take them, whatever their number, at the cost of two arrays:
    an int64 table with one row per shard (address and length of tokens, tail, prefix, follow
    and keys, then start and lowest) and a zero-length array of each of those five arrays'
    dtype. ``shards[k]`` is (tokens, tail, prefix, follow, keys, start, lowest) of C-contiguous
    arrays, which the caller must keep alive while the table is in use."""
    if not shards:
        raise ValueError("an index without shards has nothing to search")
    rows, dtypes = [], [a.dtype for a in shards[0][:5]]
    for shard in shards:
        arrays = shard[:5]
        if not all(a.ndim == 1 and a.flags.c_contiguous for a in arrays):
            raise ValueError("shard arrays must be one-dimensional and C-contiguous")
        if [a.dtype for a in arrays] != dtypes:
            raise ValueError("all shards must have arrays of the same dtypes")
        rows.append([v for a in arrays for v in (a.ctypes.data, len(a))] + list(shard[5:]))
    return np.array(rows, dtype=np.int64), tuple(np.empty(0, a.dtype) for a in shards[0][:5])


@intrinsic
def _pointer(typingctx, address):
    """The integer ``address`` as a raw pointer."""

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(types.voidptr))

    return types.voidptr(types.int64), codegen


@njit(cache=True, inline="always")
def _shard(shards, k):
    """Shard ``k`` of a ``shard_table`` as (tokens, tail, prefix, follow, keys, start, lowest)."""
    row, (tokens, tail, prefix, follow, keys) = shards[0][k], shards[1]
    return (
        carray(_pointer(row[0]), row[1], tokens.dtype),
        carray(_pointer(row[2]), row[3], tail.dtype),
        carray(_pointer(row[4]), row[5], prefix.dtype),
        carray(_pointer(row[6]), row[7], follow.dtype),
        carray(_pointer(row[8]), row[9], keys.dtype),
        row[10],
        row[11],
    )


@njit(cache=True, nogil=True)
def lookup(
    shards,
    shard_buckets,
    elem_bits,
    sample,
    pairs,
    doc_bits,
    separator,
    vocab,
    ctx,
    ctx_starts,
    need_follower,
    exact_limit,
    top_k,
    tally,
    seen,
):
    """Longest match, its occurrences and next-token counts for a batch of contexts
    (``ctx[ctx_starts[c]:ctx_starts[c+1]]``; only the part after a separator value can match).
    ``shards`` is a ``shard_table``.

    ``need_follower``: the match must have an occurrence with a next token in its document (the
    ∞-gram's rule); else any occurrence counts (the online features' rule). Next-token counts
    are a histogram of the ``.follow`` slices: exact up to ``exact_limit`` occurrences (and
    for one-byte matches, from ``pairs`` of ``pair_counts`` when keys are bytes; else it is
    empty), else every stride-th occurrence counts ``stride`` times. Returns per context ``summary[c] = (length, occurrences,
    occurrences with a follower, a position with a follower or -1)`` and the rank range in every
    shard; then the distributions as ``offsets`` and rows ``(token, count)``, most frequent
    first, ``top_k`` each (all if ``top_k <= 0``); and the index of the first token outside
    the vocabulary (-1 if none; then nothing else is computed). ``tally`` (zeros) and ``seen``
    are scratch arrays of ``vocab`` entries; ``tally`` is all zeros again on return. A
    ``.prefix`` or ``.follow`` value out of range raises IndexDamaged (``tally`` is then dirty).
    """
    num_shards = len(shards[0])
    contexts = len(ctx_starts) - 1
    summary = np.zeros((contexts, 4), dtype=np.int64)
    ranges = np.zeros((contexts, num_shards, 2), dtype=np.int64)
    offsets = np.zeros(contexts + 1, dtype=np.int64)
    for i in range(len(ctx)):
        if ctx[i] < 0 or ctx[i] >= vocab:
            return summary, ranges, offsets, np.empty((0, 2), dtype=np.int64), i
    found = np.zeros((num_shards, 4), dtype=np.int64)  # _shard_range's answer per shard
    rows = np.empty((max(16, contexts * 8), 2), dtype=np.int64)
    for c in range(contexts):
        end = ctx_starts[c + 1]
        m = _matchable(ctx, ctx_starts[c], end, separator)
        best = 0
        for k in range(num_shards):
            found[k] = _shard_range(
                _shard(shards, k),
                doc_bits,
                separator,
                shard_buckets[k],
                elem_bits,
                sample,
                ctx,
                end,
                m,
            )
            best = max(best, found[k, 0])
        while True:
            total, witness = 0, -1
            for k in range(num_shards):
                shard = _shard(shards, k)
                lo, hi = 0, 0
                if found[k, 0] >= best and len(shard[2]):
                    lo, hi = _expand(
                        shard,
                        doc_bits,
                        separator,
                        shard_buckets[k],
                        elem_bits,
                        ctx,
                        end,
                        best,
                        found[k],
                    )
                ranges[c, k, 0], ranges[c, k, 1] = lo, hi
                total += hi - lo
                follow = shard[3]
                for i in range(lo, hi if witness < 0 else lo):
                    if follow[i] != separator:
                        if shard[2][i] >= len(shard[0]):
                            raise IndexDamaged(PREFIX_OUT_OF_RANGE)
                        witness = shard[5] + np.int64(shard[2][i])
                        break
            if witness >= 0 or not need_follower or best == 0:
                break
            best -= 1
        summary[c, 0], summary[c, 1], summary[c, 3] = best, total, witness

        distinct, followed = 0, 0
        stride = 0  # no distribution
        if exact_limit > 0:
            stride = 1 if total <= exact_limit else (total + exact_limit - 1) // exact_limit
        if stride and best == 1 and len(pairs):
            # a one-byte match: the pair table holds the bytes that follow it, sorted
            a = ctx[end - 1]
            while distinct < pairs.shape[1] and pairs[a, distinct, 1] > 0:
                followed += pairs[a, distinct, 1]
                distinct += 1
            keep = distinct if top_k <= 0 else min(top_k, distinct)
            rows = _room(rows, offsets[c] + keep)
            rows[offsets[c] : offsets[c] + keep] = pairs[a, :keep]
        else:
            passed = 0
            for k in range(num_shards if stride else 0):
                lo, hi = ranges[c, k, 0], ranges[c, k, 1]
                follow = _shard(shards, k)[3]
                for i in range(lo + (-passed) % stride, hi, stride):
                    f = follow[i]
                    if f != separator:
                        if f >= vocab:
                            raise IndexDamaged(FOLLOW_OUT_OF_RANGE)
                        if tally[f] == 0:
                            seen[distinct] = f
                            distinct += 1
                        tally[f] += stride
                        followed += stride
                passed += hi - lo
            order = np.argsort(-tally[seen[:distinct]] * (vocab + 1) + seen[:distinct])
            keep = distinct if top_k <= 0 else min(top_k, distinct)
            rows = _room(rows, offsets[c] + keep)
            for j in range(keep):
                f = seen[order[j]]
                rows[offsets[c] + j, 0] = f
                rows[offsets[c] + j, 1] = tally[f]
            for j in range(distinct):
                tally[seen[j]] = 0
        summary[c, 2] = followed
        offsets[c + 1] = offsets[c] + keep
    return summary, ranges, offsets, rows[: offsets[contexts]], -1


@njit(cache=True, nogil=True)
def causal_counts(
    shards,
    shard_buckets,
    elem_bits,
    sample,
    doc_bits,
    separator,
    ctx,
    ctx_starts,
    limits,
    targets,
    exact_limit,
):
    """The ∞-gram of position ``limits[c]`` seeing only earlier text: for the context
    ``ctx[ctx_starts[c]:ctx_starts[c+1]]`` (which ends just before ``limits[c]``), count the
    occurrences of its longest suffix that end at positions ``p`` with ``p + 1 < limits[c]`` and
    a follower in their document, and how many of those followers equal ``targets[c]``.

    Returns ``(length, total, hits)`` per context; ``length`` backs off while no such occurrence
    exists (0: none at all, then ``total`` is 0). Exact up to ``exact_limit`` occurrences of a
    suffix, else every stride-th occurrence counts ``stride`` times.
    """
    contexts = len(ctx_starts) - 1
    out = np.zeros((contexts, 3), dtype=np.int64)
    ranges = np.zeros((len(shards[0]), 2), dtype=np.int64)
    for c in range(contexts):
        end = ctx_starts[c + 1]
        m = _matchable(ctx, ctx_starts[c], end, separator)
        while m > 0:
            total, hits = 0, 0
            occurrences = 0
            ranges[:] = 0
            for k in range(len(shards[0])):
                shard = _shard(shards, k)
                found = _shard_range(
                    shard,
                    doc_bits,
                    separator,
                    shard_buckets[k],
                    elem_bits,
                    sample,
                    ctx,
                    end,
                    m,
                )
                if found[0] >= m:
                    lo, hi = _expand(
                        shard,
                        doc_bits,
                        separator,
                        shard_buckets[k],
                        elem_bits,
                        ctx,
                        end,
                        m,
                        found,
                    )
                    ranges[k, 0], ranges[k, 1] = lo, hi
                    occurrences += hi - lo
            stride = max(1, (occurrences + exact_limit - 1) // exact_limit)
            passed = 0
            for k in range(len(shards[0])):
                lo, hi = ranges[k, 0], ranges[k, 1]
                _, _, prefix, follow, _, start, _ = _shard(shards, k)
                for i in range(lo + (-passed) % stride, hi, stride):
                    if start + np.int64(prefix[i]) + 1 < limits[c] and follow[i] != separator:
                        total += stride
                        if follow[i] == targets[c]:
                            hits += stride
                passed += hi - lo
            if total > 0:
                out[c, 0], out[c, 1], out[c, 2] = m, total, hits
                break
            m -= 1
    return out
