"""Pass 3 kernels: causal longest-match features read off the globally sorted context order.

Every position ``t`` gets a key: its reversed context ``x[t], x[t-1], ...`` (at most ``cap``
tokens, stopping at its document start), then the separator, packed big-endian into uint64 words
so that comparing words compares keys. The shards' sorted position lists merge into one sorted
stream; in it, the longest common suffix of two positions is the minimum of the adjacent key LCPs
between them. A forward and a backward sweep keep, per match length ``l``, the smallest position
seen since the adjacent LCP last fell below ``l``; the longest earlier match of ``t`` is the
largest ``l`` whose smallest position is ``< t``. O(cap) state, streamed.

Keys of the same leading 16 bits ("bucket") are contiguous in every shard, so buckets split the
work into independent jobs. The one level that crosses buckets (a one-token match, when a
token is 8 bits wide) comes from a table of first occurrences instead.
"""

from __future__ import annotations

import numpy as np
from numba import njit

INF = np.iinfo(np.int64).max


def key_words(cap: int, elem_bits: int) -> int:
    """Number of uint64 words that hold a key of ``cap`` elements of ``elem_bits`` bits."""
    per_word = 64 // elem_bits
    return (cap + per_word - 1) // per_word


@njit(cache=True)
def is_doc_start(bits, p):
    return (bits[p >> 6] >> np.uint64(p & 63)) & np.uint64(1)


@njit(cache=True)
def doc_depth(bits, p, cap):
    """Tokens from ``p`` back to its document start, inclusive, at most ``cap``."""
    if cap <= 64 and p >= cap:
        lo = p - cap + 2  # a start at p - cap + 1 still leaves a full key
        i, r = lo >> 6, lo & 63
        window = bits[i] >> np.uint64(r)
        if r:
            window |= bits[i + 1] << np.uint64(64 - r)
        if cap - 1 < 64:
            window &= (np.uint64(1) << np.uint64(cap - 1)) - np.uint64(1)
        if window == 0:
            return cap
        top = cap - 2
        while not (window >> np.uint64(top)) & np.uint64(1):
            top -= 1
        return p - (lo + top) + 1
    d = 1
    while d < cap and not is_doc_start(bits, p - d + 1):
        d += 1
    return d


@njit(cache=True)
def _key_less(keys, a, b):
    for w in range(keys.shape[1]):
        if keys[a, w] != keys[b, w]:
            return keys[a, w] < keys[b, w]
    return a < b


@njit(cache=True)
def _sift_down(keys, head, heap, size, i):
    """Restore the heap property below ``heap[i]`` (runs ordered by their head rows' keys)."""
    while True:
        c = 2 * i + 1
        if c >= size:
            return
        if c + 1 < size and _key_less(keys, head[heap[c + 1]], head[heap[c]]):
            c += 1
        if not _key_less(keys, head[heap[c]], head[heap[i]]):
            return
        heap[i], heap[c] = heap[c], heap[i]
        i = c


@njit(cache=True)
def merge_sorted(keys, run_starts, run_ends):
    """Order of rows of ``keys`` merging the sorted runs ``run_starts[k]:run_ends[k]`` (equal
    keys in row order, so the runs must lie in the order they rank in).

    A binary heap over the runs' heads: O(M log S) key comparisons.
    """
    runs = len(run_starts)
    heap = np.empty(runs, dtype=np.int64)
    head = run_starts.copy()
    size = 0
    for k in range(runs):
        if head[k] < run_ends[k]:
            heap[size] = k
            size += 1
    for i in range(size // 2 - 1, -1, -1):
        _sift_down(keys, head, heap, size, i)
    order = np.empty(np.sum(run_ends - run_starts), dtype=np.int64)
    for m in range(len(order)):
        k = heap[0]
        order[m] = head[k]
        head[k] += 1
        if head[k] == run_ends[k]:
            size -= 1
            heap[0] = heap[size]
        _sift_down(keys, head, heap, size, 0)
    return order


@njit(cache=True)
def _common_words(x, y, elem_bits):
    """Leading key elements that the packed keys ``x`` and ``y`` (rows of words) share."""
    per_word = 64 // elem_bits
    mask = np.uint64((1 << elem_bits) - 1)
    common = 0
    for w in range(len(x)):
        d = x[w] ^ y[w]
        if d == 0:
            common += per_word
            continue
        for e in range(per_word):
            if (d >> np.uint64((per_word - 1 - e) * elem_bits)) & mask:
                break
            common += 1
        break
    return common


@njit(cache=True)
def merged_rows(keys, depth, follow, pos, order, elem_bits, last_key, last_depth, out):
    """Rows ``order`` of the arena (``keys``, ``depth``, ``follow``, ``pos``), in that order, into
    ``out`` (``pos``, ``follow``, ``first``: the first key word, ``lcp``: the common real-token
    prefix with the row before). The row before the first is ``last_key`` of ``last_depth[0]``
    elements (-1: none); both are left holding the last."""
    o_pos, o_follow, o_first, o_lcp = out
    for m in range(len(order)):
        i = order[m]
        d = np.int64(depth[i])
        if m > 0:
            j = order[m - 1]
            common = min(_common_words(keys[j], keys[i], elem_bits), np.int64(depth[j]), d)
        elif last_depth[0] >= 0:
            common = min(_common_words(last_key, keys[i], elem_bits), last_depth[0], d)
        else:
            common = 0
        o_lcp[m] = common
        o_pos[m] = pos[i]
        o_follow[m] = follow[i]
        o_first[m] = keys[i, 0]
    i = order[len(order) - 1]
    last_key[:] = keys[i]
    last_depth[0] = depth[i]


@njit(cache=True)
def count_not_above(keys, run, bound, bound_run):
    """How many of the sorted rows of ``keys`` (all of run ``run``) come before or at the row
    ``bound`` of run ``bound_run`` in merged order (keys first, then the run)."""
    a, b = 0, len(keys)
    while a < b:
        mid = (a + b) >> 1
        above = False
        decided = False
        for w in range(keys.shape[1]):
            if keys[mid, w] != bound[w]:
                above = keys[mid, w] > bound[w]
                decided = True
                break
        if not decided:
            above = run > bound_run
        if above:
            b = mid
        else:
            a = mid + 1
    return a


def sweep_state(cap: int) -> tuple[np.ndarray, np.ndarray]:
    """The state of one direction of the sweep before its first row: per level the smallest
    position (and with a follower, and that follower) since the LCP last fell below it, and
    (rows seen, top level, previous position, previous follower)."""
    lows = np.zeros((3, cap + 1), dtype=np.int64)
    lows[:2] = INF
    return lows, np.array([0, 0, 0, -1], dtype=np.int64)


@njit(cache=True)
def sweep_chunk(pos, follower, h, cap, lows, state, best_len, best_pos, best_tok):
    """One direction of the sweep over rows in the order it visits them; combines into best_*
    (max length, then smallest follower position). ``h[i]`` is the LCP of row ``i`` with the row
    visited just before it (for ``i = 0``: the previous chunk's last row). ``lows`` and
    ``state`` (see ``sweep_state``) carry on from chunk to chunk."""
    low, low_f, low_tok = lows[0], lows[1], lows[2]
    top = state[1]
    for i in range(len(pos)):
        t = pos[i]
        level = 0
        if state[0] > 0:
            level = min(np.int64(h[i]), cap)
            for lev in range(level + 1, top + 1):
                low[lev] = INF
                low_f[lev] = INF
            top = level
            # low[] and low_f[] are non-decreasing in the level: fold p in from the top down.
            p = state[2]
            lev = level
            while lev >= 1 and low[lev] > p:
                low[lev] = p
                lev -= 1
            if state[3] >= 0:
                lev = level
                while lev >= 1 and low_f[lev] > p:
                    low_f[lev] = p
                    low_tok[lev] = state[3]
                    lev -= 1
        state[0] += 1
        state[2], state[3] = t, follower[i]
        # largest level <= the LCP whose smallest position is before t (binary search)
        length, hi = 0, level
        while length < hi:
            mid = (length + hi + 1) // 2
            if low[mid] < t:
                length = mid
            else:
                hi = mid - 1
        if length == 0 or length < best_len[i]:
            continue
        if length > best_len[i]:
            best_len[i] = length
            best_pos[i] = INF
        if low_f[length] < t and low_f[length] < best_pos[i]:
            best_pos[i] = low_f[length]
            best_tok[i] = low_tok[length]
    state[1] = top


def sweep_features(pos, follower, lcp, cap):
    """Longest earlier match length, and the follower token of its smallest such position.

    ``pos``, ``follower`` (-1 for none) and ``lcp`` (with the previous row) are in merged
    (sorted) order. Returns ``(length, next_pos, next_tok)`` in the same order; ``next_pos`` is
    INF when no position achieving the length has a follower.
    """
    n = len(pos)
    best_len = np.zeros(n, dtype=np.int64)
    best_pos = np.full(n, INF, dtype=np.int64)
    best_tok = np.zeros(n, dtype=np.int64)
    sweep_chunk(pos, follower, lcp, cap, *sweep_state(cap), best_len, best_pos, best_tok)
    back = [np.ascontiguousarray(a[::-1]) for a in (best_len, best_pos, best_tok)]
    h = np.append(lcp[1:], 0)[::-1].copy()  # visited backwards: the LCP with the row after
    sweep_chunk(pos[::-1].copy(), follower[::-1].copy(), h, cap, *sweep_state(cap), *back)
    return tuple(a[::-1].copy() for a in back)


@njit(cache=True)
def first_occurrences(tokens, nxt, start, local_bits, first, first_f, first_tok):
    """Update, per token value, its first position and first position with a follower.

    Shards must be visited in order; ``nxt`` holds the first token of the next shard (if any),
    ``local_bits`` the document starts of the shard and of the position after it, counted from
    the shard's start (``start``).
    """
    n = len(tokens)
    for q in range(n):
        p = start + q
        v = tokens[q]
        if first[v] == INF:
            first[v] = p
        if first_f[v] == INF and not is_doc_start(local_bits, q + 1):
            first_f[v] = p
            first_tok[v] = tokens[q + 1] if q + 1 < n else nxt[0]


@njit(cache=True)
def brute_force_at(x, doc_bits, t, cap, valid):
    """Reference match length at ``t`` by trying every ``s < t``; marks valid next tokens.

    ``x`` is the global token stream (at least up to ``t + 1``). O(t * cap).
    """
    best = 0
    for s in range(t):
        length = 0
        while length < cap and x[s - length] == x[t - length]:
            length += 1
            if is_doc_start(doc_bits, s - length + 1) or is_doc_start(doc_bits, t - length + 1):
                break
        if length == 0 or length < best:
            continue
        if length > best:
            best = length
            valid[:] = False
        if s + 1 < len(x) and not is_doc_start(doc_bits, s + 1):
            valid[x[s + 1]] = True
    return best


def doc_start_bits(offsets: np.ndarray, n_total: int) -> np.ndarray:
    """Bitmap of the positions where a document starts: bit ``p % 64`` of word ``p // 64``."""
    bits = np.zeros(n_total // 64 + 2, dtype="<u8")
    starts = np.asarray(offsets[:-1], dtype=np.uint64)
    np.bitwise_or.at(bits, starts >> np.uint64(6), np.uint64(1) << (starts & np.uint64(63)))
    return bits


def brute_force_features(tokens: np.ndarray, doc_ids: np.ndarray, cap: int):
    """O(N^2) reference: per position, the match length and the set of valid next tokens.

    Follows the feature contract literally; for tests and small corpora only.
    """
    n = len(tokens)
    lengths = np.zeros(n, dtype=np.int64)
    valid_next: list[set[int]] = []
    for t in range(n):
        best, nexts = 0, set()
        for s in range(t):
            length = 0
            while (
                length < cap
                and s - length >= 0
                and doc_ids[s - length] == doc_ids[s]
                and doc_ids[t - length] == doc_ids[t]
                and tokens[s - length] == tokens[t - length]
            ):
                length += 1
            if length == 0 or length < best:
                continue
            if length > best:
                best, nexts = length, set()
            if s + 1 < n and doc_ids[s + 1] == doc_ids[s]:
                nexts.add(int(tokens[s + 1]))
        lengths[t] = best
        valid_next.append(nexts)
    return lengths, valid_next


@njit(cache=True)
def decode_run(lcp, depth, elements, separator, elem_bits, cap, current, keys):
    """Keys of front-coded entries (``kernels.sort.sort_shard``'s ``lcp``, ``depth`` and
    ``elements``) into rows of ``keys``: the real elements, then the separator when there are
    fewer than ``cap``; returns the elements used. ``current`` holds the key elements of the
    entry before the first (whatever they are at a bucket's first entry) and is left holding
    the last entry's, so that decoding can go on from there."""
    per_word = 64 // elem_bits
    e = 0
    for r in range(len(lcp)):
        d, common = np.int64(depth[r]), np.int64(lcp[r])
        for j in range(common, d):
            current[j] = elements[e]
            e += 1
        same = common // per_word if r > 0 else 0  # words of shared elements only: as above
        for w in range(same):
            keys[r, w] = keys[r - 1, w]
        for w in range(same, keys.shape[1]):
            word = np.uint64(0)
            for j in range(w * per_word, (w + 1) * per_word):
                word <<= np.uint64(elem_bits)
                if j < d:
                    word |= np.uint64(current[j])
                elif j == d and d < cap:
                    word |= np.uint64(separator)
            keys[r, w] = word
    return e
