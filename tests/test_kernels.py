"""Fast kernels against their plain references on random inputs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from teralm.kernels import match as km
from teralm.kernels.sort import sort_shard, sort_shard_reference


def context_key(context, starts, i, separator):
    key = []
    while True:
        key.append(int(context[i]))
        if i in starts or i == 0:
            return key + [separator]
        i -= 1


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=120),
    cuts=st.lists(st.integers(1, 119), max_size=6),
    overlap=st.integers(0, 20),
    wide=st.booleans(),
)
def test_sort_shard_equals_reference(tokens, cuts, overlap, wide):
    context = np.array(tokens, dtype=np.uint16 if wide else np.uint8)
    overlap = min(overlap, len(context) - 1)
    starts = np.array(sorted({c for c in cuts if c < len(context)}), dtype=np.int64)
    separator = 300 if wide else 9
    fast = sort_shard(context, overlap, starts, separator, context.dtype, 8, -1)["order"]
    slow = sort_shard_reference(context, overlap, starts, separator)
    assert sorted(fast.tolist()) == list(range(len(context) - overlap))
    start_set = set(starts.tolist())
    keys = [context_key(context, start_set, overlap + int(p), separator) for p in fast]
    ref = [context_key(context, start_set, overlap + int(p), separator) for p in slow]
    assert keys == ref


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=150),
    cuts=st.lists(st.integers(1, 149), max_size=6),
    overlap=st.integers(0, 20),
    cap=st.integers(2, 12),
    wide=st.booleans(),
    last_follower=st.integers(-1, 3),
)
def test_sort_shard_front_codes_each_key(tokens, cuts, overlap, cap, wide, last_follower):
    """lcp, depth, follower, stored elements and bucket starts, entry by entry from the keys."""
    context = np.array(tokens, dtype=np.uint16 if wide else np.uint8)
    overlap = min(overlap, len(context) - 1)
    starts = np.array(sorted({c for c in cuts if c < len(context)}), dtype=np.int64)
    separator = 300 if wide else 9
    run = sort_shard(context, overlap, starts, separator, context.dtype, cap, last_follower)
    start_set = set(starts.tolist())
    counts, stored = np.zeros(1 << 16, np.int64), np.zeros(1 << 16, np.int64)
    elements, previous = [], (None, [])
    for k, p in enumerate(run["order"].tolist()):
        key = context_key(context, start_set, overlap + p, separator)[:-1][:cap]
        padded = [*key, separator]
        bucket = padded[0] if wide else padded[0] << 8 | padded[1]
        common = 0
        if previous[0] == bucket:
            while common < min(len(key), len(previous[1])) and key[common] == previous[1][common]:
                common += 1
        i = overlap + p
        if i + 1 < len(context):
            follower = separator if i + 1 in start_set else int(context[i + 1])
        else:
            follower = separator if last_follower < 0 else last_follower
        assert (run["depth"][k], run["lcp"][k], run["follow"][k]) == (len(key), common, follower)
        elements += key[common:]
        counts[bucket] += 1
        stored[bucket] += len(key) - common
        previous = (bucket, key)
    assert run["elements"].tolist() == elements
    assert run["starts"][0].tolist() == [0, *np.cumsum(counts).tolist()]
    assert run["starts"][1].tolist() == [0, *np.cumsum(stored).tolist()]


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=150),
    cuts=st.lists(st.integers(1, 149), max_size=6),
    wide=st.booleans(),
    split=st.floats(0, 1),
)
def test_decode_run_packs_each_key(tokens, cuts, wide, split):
    """Keys decoded from the front-coded run, in two calls as pass 3 reads them, against each
    entry's key packed from the context: elements, the separator, zeros."""
    context = np.array(tokens, dtype=np.uint16 if wide else np.uint8)
    starts = np.array(sorted({c for c in cuts if c < len(context)}), dtype=np.int64)
    separator, bits = (300, 16) if wide else (9, 8)
    cap = 32
    run = sort_shard(context, 0, starts, separator, context.dtype, cap, -1)
    words = km.key_words(cap, bits)
    keys = np.empty((len(context), words), dtype=np.uint64)
    current = np.zeros(words * 64 // bits, dtype=np.int64)
    m = int(split * len(context))
    used = km.decode_run(run["lcp"][:m], run["depth"][:m], run["elements"], separator, bits, cap,
                         current, keys[:m])  # fmt: skip
    km.decode_run(run["lcp"][m:], run["depth"][m:], run["elements"][used:], separator, bits, cap,
                  current, keys[m:])  # fmt: skip
    start_set = set(starts.tolist())
    for row, p in zip(keys, run["order"].tolist()):
        key = context_key(context, start_set, p, separator)[:-1][:cap]
        elements = [*key, separator] if len(key) < cap else key
        elements += [0] * (words * 64 // bits - len(elements))
        packed = [sum(e << (bits * (64 // bits - 1 - j)) for j, e in enumerate(elements[w : w + 64 // bits]))
                  for w in range(0, len(elements), 64 // bits)]  # fmt: skip
        assert row.tolist() == packed


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2), min_size=2, max_size=200),
    cuts=st.lists(st.integers(1, 199), max_size=5),
    cap=st.integers(1, 40),
)
def test_brute_force_at_equals_reference(tokens, cuts, cap):
    x = np.array(tokens, dtype=np.uint8)
    starts = sorted({0, *(c for c in cuts if c < len(x))})
    offsets = np.array([*starts, len(x)], dtype=np.uint64)
    doc_ids = np.repeat(np.arange(len(starts)), np.diff(offsets.astype(np.int64)))
    lengths, valid_next = km.brute_force_features(x, doc_ids, cap)
    bits = km.doc_start_bits(offsets, len(x))
    valid = np.zeros(256, dtype=np.bool_)
    for t in range(len(x)):
        valid[:] = False
        assert km.brute_force_at(x, bits, t, cap, valid) == lengths[t]
        assert set(np.flatnonzero(valid).tolist()) == valid_next[t]


def test_merge_sorted_merges_runs():
    rng = np.random.default_rng(0)
    runs = [np.sort(rng.integers(0, 50, size=n)).astype(np.uint64) for n in (0, 5, 17, 1, 30)]
    gaps = [rng.integers(0, 4) for _ in runs]  # rows between the runs that are not merged
    keys = np.concatenate([np.r_[np.full(g, 99, np.uint64), r] for g, r in zip(gaps, runs)])
    ends = np.cumsum([g + len(r) for g, r in zip(gaps, runs)]).astype(np.int64)
    starts = ends - [len(r) for r in runs]
    order = km.merge_sorted(keys[:, None], starts, ends)
    inside = [i for a, b in zip(starts, ends) for i in range(a, b)]
    assert sorted(order.tolist()) == inside
    assert np.all(np.diff(keys[order].astype(np.int64)) >= 0)
    assert all(a < b for a, b in zip(order[:-1], order[1:]) if keys[a] == keys[b])  # row order


@pytest.mark.parametrize("runs", [1, 2, 3, 37, 64])
def test_merge_sorted_equals_a_sort_of_keys_then_rows(runs):
    """Many runs of two-word keys with many ties: the merge is the sort by (words, row)."""
    rng = np.random.default_rng(runs)
    sizes = rng.integers(0, 40, size=runs)
    keys = rng.integers(0, 3, size=(int(sizes.sum()), 2)).astype(np.uint64)
    ends = np.cumsum(sizes).astype(np.int64)
    starts = ends - sizes
    for a, b in zip(starts, ends):
        keys[a:b] = keys[a:b][np.lexsort(keys[a:b].T[::-1])]
    order = km.merge_sorted(keys, starts, ends)
    rows = np.arange(len(keys))
    assert order.tolist() == np.lexsort((rows, keys[:, 1], keys[:, 0])).tolist()
