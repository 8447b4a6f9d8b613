"""Index features of a fragment against its own earlier text, as if the index held nothing else.

Training shows a share of its fragments this way (``TrainConfig.dropout_features = "self"``): as
text new to the index, whose only matches are short repeats of itself, so the model learns what a
match of a few tokens with a count of one or two is worth. The features follow the stored ones'
contract (``teralm.kernels.match``) and the ∞-gram's (``teralm.kernels.query.causal_counts``),
with the fragment as the whole corpus. O(n²) for a fragment of n tokens, by one row of common
suffix lengths updated per position.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from teralm.kernels.match import is_doc_start


@njit(cache=True, nogil=True)
def fragment_features(tokens, doc_bits, start, cap, no_token, counts=True):
    """Per input position ``i < n`` of ``tokens[0..n]`` (predicting ``tokens[i + 1]``), where
    ``tokens[j]`` is corpus position ``start + j`` and ``doc_bits`` the corpus's document-start
    bitmap (``teralm.kernels.match.doc_start_bits``):

    - ``match_len[i]``: the longest suffix of ``tokens[:i + 1]`` (at most ``cap`` tokens, not
      reaching back across a document start) that also ends at some ``s < i``;
    - ``next_token[i]``: the token after the smallest such ``s`` that has one in its document
      (``no_token`` when none has);
    - ``total[i]``, ``hits[i]``: the ∞-gram of target ``i + 1``: occurrences of that suffix,
      backed off while none has a follower, ending at ``s < i`` with a follower in their document,
      and how many followers equal ``tokens[i + 1]`` (0, 0 when no token repeats, or when
      ``counts`` is false).

    Returns ``(next_token, match_len, total, hits)``, int64 arrays of length n.
    """
    n = len(tokens) - 1
    doc_start = np.zeros(n + 1, dtype=np.bool_)
    for j in range(n + 1):
        doc_start[j] = is_doc_start(doc_bits, start + j)
    next_token = np.full(n, no_token, dtype=np.int64)
    match_len = np.zeros(n, dtype=np.int64)
    total = np.zeros(n, dtype=np.int64)
    hits = np.zeros(n, dtype=np.int64)
    common = np.zeros(max(n, 1), dtype=np.int64)  # common suffix length of i and s, for s < i
    for i in range(n):
        for s in range(i - 1, -1, -1):  # downwards: common[s - 1] still holds row i - 1
            if tokens[s] != tokens[i]:
                common[s] = 0
            elif s == 0 or doc_start[s] or doc_start[i]:
                common[s] = 1
            else:
                common[s] = min(cap, common[s - 1] + 1)
        best, best_followed, first = 0, 0, -1
        for s in range(i):
            length = common[s]
            if length > best:
                best, first = length, -1
            followed = not doc_start[s + 1]
            if followed and length == best and first < 0 and length > 0:
                first = s
            if followed and length > best_followed:
                best_followed = length
        match_len[i] = best
        if first >= 0:
            next_token[i] = tokens[first + 1]
        m = min(best, best_followed)
        if m == 0 or not counts:
            continue
        for s in range(i):
            if common[s] >= m and not doc_start[s + 1]:
                total[i] += 1
                hits[i] += tokens[s + 1] == tokens[i + 1]
    return next_token, match_len, total, hits
