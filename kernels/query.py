"""Query kernels: search the global sorted order (positions sorted by reversed context).

Key element ``j`` of position ``p`` is ``x[p-j]`` while that lies inside the document and no more
than ``overlap`` tokens before ``p``'s shard, then the separator. The order compares the first
``depth`` elements, then the shard, then the whole key. A query (a context read backwards) of at
most ``depth`` tokens is looked up by one binary search for its insertion point (first over the
bucket table and the sampled key words of ``order.keys``, then over ``order.positions``); the
entries sharing most elements with it sit next to that point, and those sharing ``l`` elements
form a block around it: a bucket when ``l`` elements fit in the bucket's 16 bits, else found by
galloping outwards. The tokens that follow a block are one contiguous slice of ``order.follow``.
A longer query whose first ``depth`` tokens occur continues inside their block, where each shard's
entries are contiguous and sorted by whole key: one more search per shard that holds them.

The kernels take the index as ``corpus``: (token table of ``shard_table``, a zero-length array
of the token dtype, shard_tokens, overlap, order bytes, order width, follow, keys, buckets, depth).
"""

from __future__ import annotations

import sys

import numpy as np
from numba import carray, njit, types
from numba.extending import intrinsic

from teralm.errors import IndexDamaged
from teralm.kernels.match import doc_depth

# what the kernels raise IndexDamaged with, for a value they cannot use (checked where read)
ORDER_OUT_OF_RANGE = "an order.positions entry lies outside the corpus"
FOLLOW_OUT_OF_RANGE = "an order.follow entry lies outside the vocabulary"
SEARCH_GROUP = 16  # searches run step by step together (see _global_searches)
RESCAN_FACTOR = 64  # causal counts rescan up to this many times their exact limit (causal_counts)
LITTLE_ENDIAN = sys.byteorder == "little"  # order.positions holds little-endian words


@intrinsic
def _pointer(typingctx, address):
    """The integer ``address`` as a raw pointer."""

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(types.voidptr))

    return types.voidptr(types.int64), codegen


def shard_table(arrays: list[np.ndarray]) -> np.ndarray:
    """The shards' token arrays as the kernels take them, whatever their number: an int64 table
    with one row per shard (address, length). The caller keeps the arrays alive while the table
    is in use; they must be one-dimensional, C-contiguous and of one dtype."""
    if not arrays:
        raise ValueError("an index without shards has nothing to search")
    if not all(a.ndim == 1 and a.flags.c_contiguous and a.dtype == arrays[0].dtype for a in arrays):
        raise ValueError("shard arrays must be one-dimensional, C-contiguous and of one dtype")
    return np.array([(a.ctypes.data, len(a)) for a in arrays], dtype=np.int64)


@njit(cache=True)
def _shard_tokens(corpus, k):
    row = corpus[0][k]
    return carray(_pointer(row[0]), row[1], corpus[1].dtype)


@njit(cache=True)
def _position(corpus, i):
    """The corpus position at rank ``i`` of the order."""
    order, width = corpus[4], corpus[5]
    b = i * width
    p = (
        np.int64(order[b])
        | (np.int64(order[b + 1]) << 8)
        | (np.int64(order[b + 2]) << 16)
        | (np.int64(order[b + 3]) << 24)
    )
    if width == 5:
        p |= np.int64(order[b + 4]) << 32
    return p


@njit(cache=True)
def _size(corpus):
    return len(corpus[4]) // corpus[5]


@njit(cache=True)
def _common(corpus, doc_bits, separator, n_total, i, ctx, end, limit):
    """(common prefix length with the query, and whether the query sorts before the entry's key)
    for the entry at rank ``i``. The query is ``ctx[end-limit:end]`` read backwards (the reversed
    context); a query that is a prefix of the key sorts first."""
    p = _position(corpus, i)
    if p >= n_total:
        raise IndexDamaged(ORDER_OUT_OF_RANGE)
    shard_tokens = corpus[2]
    k = p // shard_tokens
    base = k * shard_tokens
    lowest = max(0, base - corpus[3])
    real = min(doc_depth(doc_bits, p, max(limit, 1)), p - lowest + 1)
    tokens = _shard_tokens(corpus, k)
    for j in range(limit):
        v = ctx[end - 1 - j]
        if j >= real:
            return j, v < separator
        q = p - j
        while q < base:
            k -= 1
            base -= shard_tokens
            tokens = _shard_tokens(corpus, k)
        e = np.int64(tokens[q - base])
        if e != v:
            return j, v < e
    return limit, True


@njit(cache=True)
def _matchable(ctx, begin, end, separator):
    """How many of the last tokens of ``ctx[begin:end]`` can match: those after its last
    separator value."""
    m = 0
    while m < end - begin and ctx[end - 1 - m] != separator:
        m += 1
    return m


@njit(cache=True)
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


@njit(cache=True)
def _search(corpus, doc_bits, separator, n_total, lo, hi, ctx, end, m):
    """Binary search of ranks ``[lo, hi)`` for the query's insertion point: (length of the
    longest common prefix there, the insertion rank, and the common prefix lengths of the ranks
    at and before it, -1 where there is none)."""
    a, b = lo, hi
    while a < b:  # first rank whose key is >= the query
        mid = (a + b) >> 1
        _, before = _common(corpus, doc_bits, separator, n_total, mid, ctx, end, m)
        if before:
            b = mid
        else:
            a = mid + 1
    right = _common(corpus, doc_bits, separator, n_total, a, ctx, end, m)[0] if a < hi else -1
    left = _common(corpus, doc_bits, separator, n_total, a - 1, ctx, end, m)[0] if a > lo else -1
    return max(left, right, 0), a, right, left


@njit(cache=True, nogil=True)
def _global_searches(corpus, doc_bits, separator, n_total, elem_bits, sample, ctx, begins, ends):
    """The longest match of each context ``ctx[begins[c]:ends[c]]`` over the whole order (of
    its matchable tokens, at most the order's depth), as rows ``(length, insertion rank, common
    prefix length at it, and at the rank before; -1 where there is none)`` like ``_search``'s.

    A search starts inside the query's bucket (its leading 16 bits: ``buckets[b]`` is where
    bucket ``b`` starts), narrows it on the sampled first key words (``order.keys``, one per
    ``sample`` ranks), then binary searches the ranks left. The contexts go in groups of
    ``SEARCH_GROUP`` whose searches advance a step each in turn: one search waits for each of
    its memory reads, while the reads of a group's searches are independent and overlap.
    """
    n = _size(corpus)
    contexts = len(ends)
    out = np.empty((contexts, 4), dtype=np.int64)
    keys, depth = corpus[7], corpus[9]
    if n == 0 or len(keys) == 0:
        out[:, 0], out[:, 1], out[:, 2:] = 0, 0, -1
        return out
    g = SEARCH_GROUP
    group_ends, ms = np.empty(g, np.int64), np.empty(g, np.int64)
    words = np.empty(g, np.uint64)
    first, last = np.empty(g, np.int64), np.empty(g, np.int64)  # the bucket's samples
    s0, s1 = np.empty(g, np.int64), np.empty(g, np.int64)
    a, b = np.empty(g, np.int64), np.empty(g, np.int64)
    for c0 in range(0, contexts, g):
        k = min(g, contexts - c0)
        for j in range(k):
            end = ends[c0 + j]
            m = min(_matchable(ctx, begins[c0 + j], end, separator), depth)
            group_ends[j], ms[j] = end, m
            a[j] = b[j] = s0[j] = s1[j] = first[j] = last[j] = 0
            if ms[j] > 0:
                words[j], a[j], b[j] = _bucket(corpus[8], elem_bits, ctx, end, m)
                first[j] = s0[j] = (a[j] + sample - 1) // sample
                last[j] = s1[j] = (b[j] + sample - 1) // sample
        # the sample searches step without branches: a mispredicted one would throw away the
        # group's reads in flight (measured on pydocs: 24 ms a batch with branches, 16.5 without)
        busy = True
        while busy:  # first sample whose word is >= the query's
            busy = False
            for j in range(k):
                go = s0[j] < s1[j]
                mid = (s0[j] + s1[j]) >> 1
                up = go & (keys[min(mid, len(keys) - 1)] < words[j])
                s0[j] += up * (mid + 1 - s0[j])
                s1[j] += (go and not up) * (mid - s1[j])
                busy |= go
        for j in range(k):
            if s0[j] > first[j]:
                a[j] = (s0[j] - 1) * sample + 1
            s1[j] = last[j]
        busy = True
        while busy:  # first sample whose word is > the query's
            busy = False
            for j in range(k):
                go = s0[j] < s1[j]
                mid = (s0[j] + s1[j]) >> 1
                up = go & (keys[min(mid, len(keys) - 1)] <= words[j])
                s0[j] += up * (mid + 1 - s0[j])
                s1[j] += (go and not up) * (mid - s1[j])
                busy |= go
        for j in range(k):
            if s0[j] < last[j]:
                b[j] = s0[j] * sample
        busy = True
        while busy:  # first rank whose key is >= the query
            busy = False
            for j in range(k):
                if a[j] < b[j]:
                    mid = (a[j] + b[j]) >> 1
                    _, before = _common(
                        corpus, doc_bits, separator, n_total, mid, ctx, group_ends[j], ms[j]
                    )
                    if before:
                        b[j] = mid
                    else:
                        a[j] = mid + 1
                    busy = True
        for j in range(k):
            at, end, m = a[j], group_ends[j], ms[j]
            if m == 0:
                out[c0 + j] = (0, 0, -1, -1)
                continue
            right = (
                _common(corpus, doc_bits, separator, n_total, at, ctx, end, m)[0] if at < n else -1
            )
            left = (
                _common(corpus, doc_bits, separator, n_total, at - 1, ctx, end, m)[0]
                if at > 0
                else -1
            )
            out[c0 + j] = (max(left, right, 0), at, right, left)
    return out


@njit(cache=True)
def _shares(corpus, doc_bits, separator, n_total, ctx, end, length, found, i):
    """Whether the entry at rank ``i`` shares ``length`` elements with the query (``found``:
    what ``_search`` returned, whose two ranks around the insertion point are known)."""
    at = found[1]
    if i == at:
        return found[2] >= length
    if i == at - 1:
        return found[3] >= length
    p = _position(corpus, i)
    shard_tokens = corpus[2]
    base = p // shard_tokens * shard_tokens
    if p >= n_total or p - length + 1 < base:  # _common checks the position, reads across shards
        return _common(corpus, doc_bits, separator, n_total, i, ctx, end, length)[0] == length
    if doc_depth(doc_bits, p, length) < length:
        return False
    tokens = _shard_tokens(corpus, p // shard_tokens)
    same = True
    for j in range(length):  # no early exit: a loop the compiler vectorises
        same &= tokens[p - base - j] == ctx[end - 1 - j]
    return same


@njit(cache=True, nogil=True)
def _expand(
    corpus, doc_bits, separator, n_total, elem_bits, lo_bound, hi_bound, ctx, end, length, found
):
    """All ranks of ``[lo_bound, hi_bound)`` sharing ``length`` elements with the query, around
    its insertion point (``found`` is what ``_search`` returned there; the caller knows that
    block is not empty): a bucket when ``length`` elements fit in its 16 bits and the bounds are
    the whole order, else gallop outwards, then binary search."""
    if length == 0:
        return lo_bound, hi_bound
    whole = lo_bound == 0 and hi_bound == _size(corpus)
    if whole and length * elem_bits <= 16:
        _, lo, hi = _bucket(corpus[8], elem_bits, ctx, end, length)
        return lo, hi
    args = (corpus, doc_bits, separator, n_total, ctx, end, length, found)
    at = found[1]
    k = at if at < hi_bound and _shares(*args, at) else at - 1
    lo, step = k, 1
    while lo - step >= lo_bound and _shares(*args, lo - step):
        lo -= step
        step *= 2
    a = max(lo - step + 1, lo_bound)
    while a < lo:
        mid = (a + lo) >> 1
        if _shares(*args, mid):
            lo = mid
        else:
            a = mid + 1
    hi, step = k + 1, 1
    while hi + step - 1 < hi_bound and _shares(*args, hi + step - 1):
        hi += step
        step *= 2
    b = min(hi + step - 1, hi_bound)
    while hi < b:
        mid = (hi + b) >> 1
        if _shares(*args, mid):
            hi = mid + 1
        else:
            b = mid
    return lo, hi


@njit(cache=True, nogil=True)
def _shard_end(corpus, n_total, i, hi):
    """The first rank of ``[i, hi)`` whose position lies in a later shard than rank ``i``'s (the
    block's shards rise)."""
    shard_tokens = corpus[2]
    k = _position(corpus, i) // shard_tokens
    a, b = i + 1, hi
    while a < b:
        mid = (a + b) >> 1
        p = _position(corpus, mid)
        if p >= n_total:
            raise IndexDamaged(ORDER_OUT_OF_RANGE)
        if p // shard_tokens > k:
            b = mid
        else:
            a = mid + 1
    return a


@njit(cache=True, nogil=True)
def _match(corpus, doc_bits, separator, n_total, elem_bits, ctx, end, m, found, parts):
    """Search for the query (its last ``m`` tokens): the longest match length, and the ranges
    to search at each length, in ``parts`` (rows ``lo, hi, length, at, right, left``; grown
    when needed). Row 0 is the whole order, searched for the first ``depth`` tokens (``found``:
    its row of ``_global_searches``); when the
    query is longer and its first ``depth`` tokens occur, the rows after it are that block's
    runs of one shard each, searched for the whole query. Returns (length, rows, parts)."""
    depth = corpus[9]
    n = _size(corpus)
    parts[0, 0], parts[0, 1] = 0, n
    parts[0, 2:] = found
    if m <= depth or found[0] < depth:
        return found[0], 1, parts
    lo, hi = _expand(corpus, doc_bits, separator, n_total, elem_bits, 0, n, ctx, end, depth, found)
    rows, best = 1, depth
    i = lo
    while i < hi:
        j = _shard_end(corpus, n_total, i, hi)
        if rows == len(parts):
            grown = np.empty((2 * rows, 6), dtype=np.int64)
            grown[:rows] = parts
            parts = grown
        parts[rows, 0], parts[rows, 1] = i, j
        parts[rows, 2:] = _search(corpus, doc_bits, separator, n_total, i, j, ctx, end, m)
        best = max(best, parts[rows, 2])
        rows += 1
        i = j
    return best, rows, parts


@njit(cache=True, nogil=True)
def _ranges_at(corpus, doc_bits, separator, n_total, elem_bits, ctx, end, length, parts, rows, out):
    """The rank ranges of the occurrences of the query's last ``length`` tokens (at most its
    match length) into ``out`` (grown when needed); returns (count, out)."""
    depth = corpus[9]
    count = 0
    first = 0 if length <= depth else 1
    last = 1 if length <= depth else rows
    for r in range(first, last):
        if parts[r, 2] < length:
            continue
        lo, hi = _expand(
            corpus,
            doc_bits,
            separator,
            n_total,
            elem_bits,
            parts[r, 0],
            parts[r, 1],
            ctx,
            end,
            length,
            parts[r, 2:],
        )
        if count == len(out):
            grown = np.empty((2 * count, 2), dtype=np.int64)
            grown[:count] = out
            out = grown
        out[count, 0], out[count, 1] = lo, hi
        count += 1
    return count, out


def pair_counts(buckets: np.ndarray) -> np.ndarray:
    """``pairs[a]``: the bytes that follow byte ``a`` inside a document as rows ``(byte, count)``,
    most frequent first (ties by byte), then rows of count 0; from the bucket table of a
    byte-keyed index (bucket ``(f, a)`` holds the keys starting ``f, a``)."""
    sizes = np.diff(buckets.astype(np.int64))
    counts = sizes.reshape(256, 256).T  # counts[a, f]
    order = np.argsort(-counts, axis=1, kind="stable")
    return np.ascontiguousarray(np.stack([order, np.take_along_axis(counts, order, 1)], axis=-1))


@njit(cache=True)
def _room(rows, size):
    """``rows``, or a copy at least twice as long, with room for ``size`` rows."""
    if size <= len(rows):
        return rows
    grown = np.empty((max(2 * len(rows), size), 2), dtype=rows.dtype)
    grown[: len(rows)] = rows
    return grown


@njit(cache=True, nogil=True)
def lookup(
    corpus,
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

    ``need_follower``: the match must have an occurrence with a next token in its document (the
    ∞-gram's rule); else any occurrence counts (the online features' rule). Next-token counts
    are a histogram of the ``order.follow`` slices: exact up to ``exact_limit`` occurrences (and
    for one-byte matches, from ``pairs`` of ``pair_counts`` when keys are bytes; else it is
    empty), else every stride-th occurrence counts ``stride`` times. Returns per context
    ``summary[c] = (length, occurrences, occurrences with a follower, a position with a
    follower or -1)``; the rank ranges of the occurrences, context ``c``'s being rows
    ``range_offsets[c]:range_offsets[c+1]`` of ``ranges``; then the distributions as
    ``offsets`` and rows ``(token, count)``, most frequent first, ``top_k`` each (all if
    ``top_k <= 0``); and the index of the first token outside the vocabulary (-1 if none; then
    nothing else is computed). ``tally`` (zeros) and ``seen`` are scratch arrays of ``vocab``
    entries; ``tally`` is all zeros again on return. An order entry out of range raises
    IndexDamaged (``tally`` is then dirty).
    """
    n_total = _size(corpus)
    contexts = len(ctx_starts) - 1
    summary = np.zeros((contexts, 4), dtype=np.int64)
    range_offsets = np.zeros(contexts + 1, dtype=np.int64)
    ranges = np.empty((max(16, contexts), 2), dtype=np.int64)
    offsets = np.zeros(contexts + 1, dtype=np.int64)
    for i in range(len(ctx)):
        if ctx[i] < 0 or ctx[i] >= vocab:
            return summary, ranges[:0], range_offsets, offsets, np.empty((0, 2), dtype=np.int64), i
    parts = np.empty((4, 6), dtype=np.int64)
    found = np.empty((16, 2), dtype=np.int64)
    rows = np.empty((max(16, contexts * 8), 2), dtype=np.int64)
    follow = corpus[6]
    begins, ends = ctx_starts[:-1], ctx_starts[1:]
    searched = _global_searches(
        corpus, doc_bits, separator, n_total, elem_bits, sample, ctx, begins, ends
    )
    for c in range(contexts):
        end = ctx_starts[c + 1]
        m = _matchable(ctx, ctx_starts[c], end, separator)
        best, used, parts = _match(
            corpus, doc_bits, separator, n_total, elem_bits, ctx, end, m, searched[c], parts
        )
        while True:
            total, witness = 0, -1
            count, found = _ranges_at(
                corpus, doc_bits, separator, n_total, elem_bits, ctx, end, best, parts, used, found
            )
            for r in range(count):
                lo, hi = found[r, 0], found[r, 1]
                total += hi - lo
                for i in range(lo, hi if witness < 0 else lo):
                    if follow[i] != separator:
                        witness = _position(corpus, i)
                        if witness >= n_total:
                            raise IndexDamaged(ORDER_OUT_OF_RANGE)
                        break
            if witness >= 0 or not need_follower or best == 0:
                break
            best -= 1
        summary[c, 0], summary[c, 1], summary[c, 3] = best, total, witness
        base = range_offsets[c]
        if base + count > len(ranges):
            grown = np.empty((2 * (base + count), 2), dtype=np.int64)
            grown[:base] = ranges[:base]
            ranges = grown
        ranges[base : base + count] = found[:count]
        range_offsets[c + 1] = base + count

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
            if stride:
                followed, distinct = _tally_followers(
                    corpus, found, count, stride, -1, separator, tally, seen, 0
                )
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
    total_ranges = range_offsets[contexts]
    return summary, ranges[:total_ranges], range_offsets, offsets, rows[: offsets[contexts]], -1


@njit(cache=True)
def _earlier_followers(corpus, lo, hi, stride, limit, target, separator):
    """Of ranks ``lo, lo + stride, ...`` below ``hi``: how many hold a position ``p`` with
    ``p + 1 < limit`` and a follower, and how many of those followers are ``target``. Branch-free,
    over the positions as native 32-bit words where the order's width allows it (a loop the
    compiler vectorises: this scan is most of a training batch's ∞-gram counts)."""
    follow = corpus[6]
    total, hits = 0, 0
    if corpus[5] == 4 and LITTLE_ENDIAN and hi > lo:
        words = corpus[4][4 * lo : 4 * hi].view(np.uint32)
        if stride == 1:  # the common case, as its own loop: the compiler vectorises it
            fs = follow[lo:hi]
            for j in range(hi - lo):
                ok = (np.int64(words[j]) + 1 < limit) & (fs[j] != separator)
                total += ok
                hits += ok & (fs[j] == target)
            return total, hits
        for j in range(0, hi - lo, stride):
            f = follow[lo + j]
            ok = (np.int64(words[j]) + 1 < limit) & (f != separator)
            total += ok
            hits += ok & (f == target)
        return total, hits
    for i in range(lo, hi, stride):
        f = follow[i]
        ok = (_position(corpus, i) + 1 < limit) & (f != separator)
        total += ok
        hits += ok & (f == target)
    return total, hits


@njit(cache=True)
def _sampled_followers(corpus, found, count, stride, limit, target, separator):
    """``_earlier_followers`` over the rank ranges ``found[:count]`` taken as one list of which
    every ``stride``-th counts ``stride`` times: ``(total, hits)``."""
    total, hits, passed = 0, 0, 0
    for r in range(count):
        lo, hi = found[r, 0], found[r, 1]
        t, h = _earlier_followers(
            corpus, lo + (-passed) % stride, hi, stride, limit, target, separator
        )
        total += stride * t
        hits += stride * h
        passed += hi - lo
    return total, hits


@njit(cache=True)
def _sample_stride(found, count, exact_limit):
    """The occurrences in the rank ranges ``found[:count]``, and the stride at which at most
    ``exact_limit`` of them are counted."""
    occurrences = 0
    for r in range(count):
        occurrences += found[r, 1] - found[r, 0]
    return occurrences, max(1, (occurrences + exact_limit - 1) // exact_limit)


@njit(cache=True)
def _rescan(total, stride, occurrences, exact_limit):
    """Whether to count a suffix again, exactly: no sampled occurrence lay before the limit (as
    near the corpus start, where nearly all of them come later), and it has at most
    ``RESCAN_FACTOR * exact_limit`` occurrences; so a suffix seen before is counted as seen."""
    return total == 0 and stride > 1 and occurrences <= RESCAN_FACTOR * exact_limit


@njit(cache=True)
def _causal_searches(corpus, elem_bits, sample, doc_bits, separator, ctx, begins, ends):
    """What the causal kernels share before their per-context work: the corpus size, each
    context's search (``_global_searches``) and the scratch tables ``_match`` and
    ``_ranges_at`` grow."""
    n_total = _size(corpus)
    searched = _global_searches(
        corpus, doc_bits, separator, n_total, elem_bits, sample, ctx, begins, ends
    )
    return n_total, searched, np.empty((4, 6), dtype=np.int64), np.empty((16, 2), dtype=np.int64)


@njit(cache=True)
def _causal_match(
    corpus, doc_bits, separator, n_total, elem_bits, ctx, begin, end, searched, parts
):
    """``_match`` of the context ``ctx[begin:end]`` (its ``searched`` row of
    ``_global_searches``): (length, rows, parts)."""
    m = _matchable(ctx, begin, end, separator)
    return _match(corpus, doc_bits, separator, n_total, elem_bits, ctx, end, m, searched, parts)


@njit(cache=True, nogil=True)
def causal_counts(
    corpus,
    elem_bits,
    sample,
    doc_bits,
    separator,
    ctx,
    begins,
    ends,
    limits,
    targets,
    exact_limit,
):
    """The ∞-gram of position ``limits[c]`` seeing only earlier text: for the context
    ``ctx[begins[c]:ends[c]]`` (which ends just before ``limits[c]``; contexts may overlap), count the
    occurrences of its longest suffix that end at positions ``p`` with ``p + 1 < limits[c]`` and
    a follower in their document, and how many of those followers equal ``targets[c]``.

    Returns ``(length, total, hits)`` per context; ``length`` backs off while no such occurrence
    exists (0: none at all, then ``total`` is 0). Exact up to ``exact_limit`` occurrences of a
    suffix, else every stride-th occurrence counts ``stride`` times; where none of those lies
    before the limit, all of them are scanned (if at most ``RESCAN_FACTOR * exact_limit``), so a
    suffix seen before is counted as seen.
    """
    contexts = len(ends)
    out = np.zeros((contexts, 3), dtype=np.int64)
    n_total, searched, parts, found = _causal_searches(
        corpus, elem_bits, sample, doc_bits, separator, ctx, begins, ends
    )
    for c in range(contexts):
        end = ends[c]
        length, used, parts = _causal_match(
            corpus, doc_bits, separator, n_total, elem_bits, ctx, begins[c], end, searched[c], parts
        )
        while length > 0:
            count, found = _ranges_at(
                corpus,
                doc_bits,
                separator,
                n_total,
                elem_bits,
                ctx,
                end,
                length,
                parts,
                used,
                found,
            )
            occurrences, stride = _sample_stride(found, count, exact_limit)
            total, hits = _sampled_followers(
                corpus, found, count, stride, limits[c], targets[c], separator
            )
            if _rescan(total, stride, occurrences, exact_limit):
                total, hits = _sampled_followers(
                    corpus, found, count, 1, limits[c], targets[c], separator
                )
            if total > 0:
                out[c, 0], out[c, 1], out[c, 2] = length, total, hits
                break
            length -= 1
    return out


@njit(cache=True)
def _tally_followers(corpus, found, count, stride, limit, separator, tally, seen, n_seen):
    """Add to ``tally`` the followers of the occurrences in the rank ranges ``found[:count]``
    (taken as one list, of which every ``stride``-th counts ``stride`` times) that end at
    positions ``p`` with ``p + 1 < limit``; tokens counted for the first time are appended to
    ``seen``; a ``limit`` of -1 counts every occurrence. Returns (the occurrences counted, the
    new length of ``seen``)."""
    follow = corpus[6]
    total, passed = 0, 0
    for r in range(count):
        lo, hi = found[r, 0], found[r, 1]
        for i in range(lo + (-passed) % stride, hi, stride):
            f = follow[i]
            if f == separator or (limit >= 0 and _position(corpus, i) + 1 >= limit):
                continue
            if f >= len(tally):
                raise IndexDamaged(FOLLOW_OUT_OF_RANGE)
            if tally[f] == 0:
                seen[n_seen] = f
                n_seen += 1
            tally[f] += stride
            total += stride
        passed += hi - lo
    return total, n_seen


@njit(cache=True)
def take_top(tally, seen, n_seen, tokens, counts):
    """The ``len(tokens)`` most counted tokens of ``seen[:n_seen]`` (ties: the smaller token
    first) with their counts, into ``tokens`` and ``counts`` (-1 and 0 past the last); clears
    ``tally``."""
    for slot in range(len(tokens)):
        best = -1
        for j in range(n_seen):
            t = seen[j]
            c = tally[t]
            if c > 0 and (best < 0 or c > tally[best] or (c == tally[best] and t < best)):
                best = t
        if best < 0:
            tokens[slot], counts[slot] = -1, 0
        else:
            tokens[slot], counts[slot] = best, tally[best]
            tally[best] = -tally[best]  # taken
    for j in range(n_seen):
        tally[seen[j]] = 0


@njit(cache=True, nogil=True)
def causal_followers(
    corpus,
    elem_bits,
    sample,
    doc_bits,
    separator,
    vocab,
    ctx,
    begins,
    ends,
    limits,
    caps,
    k,
    exact_limit,
):
    """The next-token counts of position ``limits[c]`` seeing only earlier text, at several
    context lengths: for the context ``ctx[begins[c]:ends[c]]`` (which ends just before
    ``limits[c]``) and each cap in ``caps`` (longest first), the longest suffix of at most
    that many tokens with an occurrence ending at a position ``p`` with ``p + 1 < limits[c]``
    and a follower in its document, and the ``k`` followers of those occurrences counted most
    often (ties: the smaller token first).

    Returns ``(lengths, totals, tokens, counts)``: per context and cap, the suffix's length (0:
    no earlier occurrence at all), its counted occurrences, and the top ``k`` followers and
    their counts (-1 and 0 past the last). Sampled as ``causal_counts`` samples, with
    ``exact_limit`` and the rescan of a context whose sample holds nothing earlier."""
    contexts, levels = len(ends), len(caps)
    lengths = np.zeros((contexts, levels), dtype=np.int64)
    totals = np.zeros((contexts, levels), dtype=np.int64)
    tokens = np.full((contexts, levels, k), -1, dtype=np.int64)
    counts = np.zeros((contexts, levels, k), dtype=np.int64)
    tally = np.zeros(vocab, dtype=np.int64)
    seen = np.empty(vocab, dtype=np.int64)
    n_total, searched, parts, found = _causal_searches(
        corpus, elem_bits, sample, doc_bits, separator, ctx, begins, ends
    )
    for c in range(contexts):
        end = ends[c]
        reach, used, parts = _causal_match(
            corpus, doc_bits, separator, n_total, elem_bits, ctx, begins[c], end, searched[c], parts
        )
        for level in range(levels):
            length = min(reach, caps[level])
            while length > 0:
                count, found = _ranges_at(
                    corpus, doc_bits, separator, n_total, elem_bits, ctx, end, length, parts,
                    used, found,
                )  # fmt: skip
                occurrences, stride = _sample_stride(found, count, exact_limit)
                total, n_seen = _tally_followers(
                    corpus, found, count, stride, limits[c], separator, tally, seen, 0
                )
                if _rescan(total, stride, occurrences, exact_limit):
                    total, n_seen = _tally_followers(
                        corpus, found, count, 1, limits[c], separator, tally, seen, 0
                    )
                if total > 0:
                    lengths[c, level], totals[c, level] = length, total
                    take_top(tally, seen, n_seen, tokens[c, level], counts[c, level])
                    break
                length -= 1
            reach = length  # nothing longer occurs earlier: the shorter caps start from here
    return lengths, totals, tokens, counts
