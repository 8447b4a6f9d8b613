"""Features of a fragment against its own earlier text, against a literal brute force."""

from __future__ import annotations

import numpy as np
import pytest

from teralm.kernels.fragment import fragment_features
from teralm.kernels.match import doc_start_bits

NO_TOKEN = 99


def features(x: np.ndarray, starts: np.ndarray, cap: int, start: int = 0, counts: bool = True):
    """The kernel on ``x`` placed at corpus position ``start``, ``starts`` marking its documents."""
    offsets = np.r_[start + np.flatnonzero(starts), start + len(x)]
    bits = doc_start_bits(offsets, start + len(x))
    return fragment_features(x, bits, start, cap, NO_TOKEN, counts)


def brute_fragment(x: np.ndarray, starts: np.ndarray, cap: int):
    """The contract read literally, O(n³): ``(next_token, match_len, total, hits)``."""
    n = len(x) - 1
    out = np.zeros((4, n), dtype=np.int64)
    for i in range(n):
        common = []
        for s in range(i):
            length = 0
            while length < cap and s - length >= 0 and x[s - length] == x[i - length]:
                length += 1
                if starts[s - length + 1] or starts[i - length + 1]:
                    break
            common.append(length)
        best = max(common, default=0)
        followed = [s for s in range(i) if not starts[s + 1]]
        firsts = [s for s in followed if common[s] == best]
        out[0, i] = x[firsts[0] + 1] if best > 0 and firsts else NO_TOKEN
        out[1, i] = best
        for m in range(best, 0, -1):  # back off while no occurrence has a follower
            seen = [s for s in followed if common[s] >= m]
            if seen:
                out[2, i] = len(seen)
                out[3, i] = sum(int(x[s + 1] == x[i + 1]) for s in seen)
                break
    return tuple(out)


@pytest.mark.parametrize("seed", range(6))
def test_fragment_features_match_a_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 90))
    x = rng.integers(0, [2, 3, 4, 8, 3, 2][seed], size=n + 1)
    starts = rng.random(n + 1) < [0.0, 0.05, 0.1, 0.0, 0.2, 0.02][seed]
    cap = int(rng.integers(1, 12))
    got = features(x, starts, cap, start=int(rng.integers(0, 200)))
    for name, a, b in zip(
        ("next_token", "match_len", "total", "hits"), got, brute_fragment(x, starts, cap)
    ):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_fragment_inputs_never_see_the_token_they_predict():
    """Position i's next token, match length and ∞-gram total depend on tokens ≤ i only; its
    hits on the target i + 1 too, and on nothing later."""
    rng = np.random.default_rng(5)
    x = rng.integers(0, 3, size=120)
    starts = rng.random(120) < 0.05
    base = features(x, starts, 16)
    for i in rng.integers(0, 119, size=25):
        y = x.copy()
        y[i + 1 :] = rng.integers(0, 3, size=len(y) - i - 1)
        changed = features(y, starts, 16)
        for a, b in zip(base[:3], changed[:3]):
            np.testing.assert_array_equal(a[: i + 1], b[: i + 1])
        np.testing.assert_array_equal(base[3][:i], changed[3][:i])


def test_repeats_give_long_matches_and_their_counts():
    x = np.frombuffer(b"abcabcabx", dtype=np.uint8).astype(np.int64)
    next_token, match_len, total, hits = features(x, np.zeros(9, bool), 8)
    assert list(match_len) == [0, 0, 0, 1, 2, 3, 4, 5]
    assert list(next_token[3:]) == list(x[1:6])  # the token after the earliest match
    assert list(total) == [0, 0, 0, 1, 1, 1, 1, 1] and list(hits) == [0, 0, 0, 1, 1, 1, 1, 0]


def test_counts_can_be_left_out():
    rng = np.random.default_rng(2)
    x, starts = rng.integers(0, 3, size=60), rng.random(60) < 0.1
    with_counts, without = features(x, starts, 8), features(x, starts, 8, counts=False)
    for a, b in zip(with_counts[:2], without[:2]):
        np.testing.assert_array_equal(a, b)
    assert with_counts[2].any() and not without[2].any() and not without[3].any()
