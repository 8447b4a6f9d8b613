"""A short-window model beside the index (PPM-style): what followed the last few tokens earlier in
the same document, counted within a window of recent text.

The index answers from the whole corpus; this answers from the text at hand, where a name or a
phrase that just appeared is likely to come again, and it needs no index (generated text has it
too). Occurrences are found in one scan of the window per position, which counts the followers
of the longest suffix seen so far: O(window) comparisons, most of them ending at the first token.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from teralm.kernels.query import take_top


@njit(cache=True, nogil=True, inline="always")
def _common_suffix(text, p, q, limit):
    """How many tokens (at most ``limit``) ending at ``p`` equal those ending at ``q``."""
    m = 0
    while m < limit and text[p - m] == text[q - m]:
        m += 1
    return m


@njit(cache=True, nogil=True)
def window_followers(text, targets, lows, order, k, vocab):
    """For each target position ``t = targets[c]`` of ``text`` (the token there may be past the
    text's end: only ``text[:t]`` is read), the longest suffix of at most ``order`` tokens of
    ``text[lows[c]:t]`` that also ends at some ``p`` with ``p + 1 < t`` and starts at or after
    ``lows[c]``, and the ``k`` tokens that follow its occurrences most often (ties: the smaller
    token first).

    Returns ``(lengths, totals, tokens, counts)``: per target, the suffix's length (0: none
    occurs), its occurrences, and the top ``k`` followers [targets, k] with their counts (-1
    and 0 past the last)."""
    n = len(targets)
    lengths = np.zeros(n, dtype=np.int64)
    totals = np.zeros(n, dtype=np.int64)
    tokens = np.full((n, k), -1, dtype=np.int64)
    counts = np.zeros((n, k), dtype=np.int64)
    tally = np.zeros(vocab, dtype=np.int64)
    seen = np.empty(vocab, dtype=np.int64)
    for c in range(n):
        t, lo = targets[c], lows[c]
        best, total, n_seen = 0, 0, 0  # the longest suffix that occurs, and what follows it
        for p in range(lo, t - 1):
            m = _common_suffix(text, p, t - 1, min(order, p - lo + 1))
            if m == 0 or m < best:
                continue
            if m > best:  # a longer suffix: forget the shorter one's followers
                for j in range(n_seen):
                    tally[seen[j]] = 0
                best, total, n_seen = m, 0, 0
            follower = text[p + 1]
            if tally[follower] == 0:
                seen[n_seen] = follower
                n_seen += 1
            tally[follower] += 1
            total += 1
        if best:
            lengths[c], totals[c] = best, total
            take_top(tally, seen, n_seen, tokens[c], counts[c])
    return lengths, totals, tokens, counts
