"""Query engine against brute force on random corpora with planted repeats."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from conftest import build_docs, random_documents
from test_features import doc_ids_of

from teralm.index import Index
from teralm.index import format as fmt
from teralm.index.query import OnlineMatcher, push_all
from teralm.index.reader import RESIDENT_ORDER, resident_kinds
from teralm.kernels import query as kq


def occurrences(x, doc_ids, suffix) -> list[int]:
    """End positions p with x[p-k+1..p] == suffix (k tokens) inside one document."""
    n, k = len(x), len(suffix)
    if k == 0:
        return list(range(n))
    return [
        p
        for p in range(k - 1, n)
        if doc_ids[p - k + 1] == doc_ids[p] and list(x[p - k + 1 : p + 1]) == list(suffix)
    ]


def has_follower(doc_ids, p) -> bool:
    return p + 1 < len(doc_ids) and doc_ids[p + 1] == doc_ids[p]


def brute_longest(x, doc_ids, context):
    for size in range(len(context), -1, -1):
        ends = occurrences(x, doc_ids, context[len(context) - size :])
        nexts = Counter(int(x[p + 1]) for p in ends if has_follower(doc_ids, p))
        if nexts:
            return size, len(ends), nexts
    return 0, len(x), Counter()


def random_contexts(rng, x, count):
    contexts = []
    for _ in range(count):
        if rng.random() < 0.7 and len(x) > 2:
            a = int(rng.integers(0, len(x) - 1))
            piece = list(x[a : a + int(rng.integers(1, 30))])
        else:
            piece = []
        contexts.append(
            [int(t) for t in rng.integers(97, 100, size=int(rng.integers(0, 6)))] + piece
        )
    return contexts


@pytest.fixture(params=[0, 1, 2, 3])
def corpus(request, tmp_path):
    """Random corpora; the last one's order compares only 8 key elements (max_match 2), so most
    contexts are longer than its depth and are searched shard by shard inside their block. The
    second is opened with all its files in memory, the last with those a lookup reads first."""
    rng = np.random.default_rng(40 + request.param)
    docs = random_documents(rng, 12, max_len=90)
    max_match = 32 if request.param < 3 else 2
    ix = build_docs(tmp_path, docs, shard_tokens=int(rng.integers(20, 200)), max_match=max_match)
    assert ix.manifest["order"]["depth"] == max(max_match, 8)
    if request.param in (1, 3):
        first = {"buckets", "keys", "tokens"}
        memory = 1 << 40 if request.param == 1 else _bytes_of(ix, first)
        ix = Index.open(ix.directory, memory=memory)
        assert ix.resident == (set(RESIDENT_ORDER) if request.param == 1 else first)
    return ix, rng


def _bytes_of(ix: Index, kinds: set[str]) -> int:
    files = {p: p.stat().st_size for p in ix.directory.iterdir() if p.is_file()}
    return sum(size for p, size in files.items() if p.suffix.lstrip(".") in kinds)


def test_memory_holds_the_files_lookups_read_first():
    manifest = {
        "order": {"files": {k: {"bytes": b} for k, b in (("buckets", 8), ("keys", 25))}},
        "shards": [{"files": {"tokens": {"bytes": 50}}}] * 2,
    }
    manifest["order"]["files"] |= {"follow": {"bytes": 60}, "positions": {"bytes": 400}}
    for memory, kinds in [
        (0, set()),
        (32, {"buckets"}),
        (33, {"buckets", "keys"}),
        (133, {"buckets", "keys", "tokens"}),
        (100, {"buckets", "keys", "follow"}),  # tokens do not fit: the next kind that does
        (193, {"buckets", "keys", "tokens", "follow"}),
        (593, set(RESIDENT_ORDER)),
    ]:
        assert resident_kinds(manifest, memory) == kinds, memory


def test_longest_match_and_distribution_equal_brute_force(corpus):
    ix, rng = corpus
    x, doc_ids = ix.tokens(0, ix.num_tokens), doc_ids_of(ix)
    contexts = random_contexts(rng, x, 40)
    match = ix.query.longest_match(contexts)
    dists = ix.query.next_token_distribution(contexts)
    for c, context in enumerate(contexts):
        length, count, nexts = brute_longest(x, doc_ids, context)
        assert (match.length[c], match.count[c]) == (length, count), context
        tokens, counts = dists[c]
        assert dict(zip(tokens.tolist(), counts.tolist())) == dict(nexts)
        assert list(counts) == sorted(counts, reverse=True)


def test_probability_equals_brute_force(corpus):
    ix, rng = corpus
    x, doc_ids = ix.tokens(0, ix.num_tokens), doc_ids_of(ix)
    contexts = random_contexts(rng, x, 40)
    tokens = [int(t) for t in rng.choice(np.unique(x), size=len(contexts))]
    got = ix.query.probability(contexts, tokens)
    for c, (context, w) in enumerate(zip(contexts, tokens)):
        length, count, nexts = brute_longest(x, doc_ids, context)
        hits = len(occurrences(x, doc_ids, list(context[len(context) - length :]) + [w]))
        assert hits == nexts[w] or length == 0  # the empty suffix counts document starts too
        assert (got.length[c], got.count[c], got.hits[c]) == (length, count, hits)
        assert got.prob[c] == pytest.approx(hits / count)
        k = next(
            k
            for k in range(length, -2, -1)
            if k < 0 or occurrences(x, doc_ids, list(context[len(context) - k :]) + [w])
        )
        assert got.backoff_length[c] == k
        if k >= 0:
            suffix = context[len(context) - k :]
            followed = len(occurrences(x, doc_ids, list(suffix) + [w]))
            want = followed / len(occurrences(x, doc_ids, suffix))
            assert got.backoff_prob[c] == pytest.approx(want)
        if hits:
            assert got.backoff_prob[c] == got.prob[c]


def test_sharded_equals_unsharded(tmp_path):
    rng = np.random.default_rng(9)
    docs = random_documents(rng, 20, max_len=150)
    one = build_docs(tmp_path / "one", docs, shard_tokens=1 << 20)
    many = build_docs(tmp_path / "many", docs, shard_tokens=33)
    contexts = random_contexts(rng, one.tokens(0, one.num_tokens), 50)
    a, b = one.query.longest_match(contexts), many.query.longest_match(contexts)
    np.testing.assert_array_equal(a.length, b.length)
    np.testing.assert_array_equal(a.count, b.count)
    for (ta, ca), (tb, cb) in zip(
        one.query.next_token_distribution(contexts, top_k=3),
        many.query.next_token_distribution(contexts, top_k=3),
    ):
        np.testing.assert_array_equal(ta, tb)
        np.testing.assert_array_equal(ca, cb)


def test_online_matcher_equals_brute_force_step_by_step(corpus):
    ix, rng = corpus
    x, doc_ids = ix.tokens(0, ix.num_tokens), doc_ids_of(ix)
    for _ in range(4):
        a = int(rng.integers(0, len(x) - 1))
        text = [int(t) for t in x[a : a + 40]] + [int(t) for t in rng.integers(97, 100, size=15)]
        matcher = OnlineMatcher(ix, max_len=12)
        for i, token in enumerate(text):
            length, nxt = matcher.push(token)
            prefix = text[: i + 1]
            want = max(
                k
                for k in range(min(12, len(prefix)) + 1)
                if occurrences(x, doc_ids, prefix[len(prefix) - k :])
            )
            assert length == want, (prefix, length, want)
            ends = occurrences(x, doc_ids, prefix[len(prefix) - want :]) if want else []
            valid = {int(x[p + 1]) for p in ends if has_follower(doc_ids, p)}
            assert (nxt in valid) if valid else nxt == ix.no_token


def test_matchers_pushed_together_equal_one_by_one(corpus):
    """push_all (one search for every matcher that needs one) = each matcher's own push."""
    ix, rng = corpus
    x = ix.tokens(0, ix.num_tokens)
    texts = []
    for _ in range(5):
        a = int(rng.integers(0, len(x) - 1))
        texts.append([int(t) for t in x[a : a + 30]] + rng.integers(97, 100, size=10).tolist())
    together = [OnlineMatcher(ix, max_len=12) for _ in texts]
    alone = [OnlineMatcher(ix, max_len=12) for _ in texts]
    for step in range(min(map(len, texts))):
        tokens = [t[step] for t in texts]
        lengths = [f[0] for f in push_all(together, tokens)]
        assert lengths == [m.push(t)[0] for m, t in zip(alone, tokens)]


def test_online_matcher_agrees_with_stored_features(corpus):
    ix, _ = corpus
    stored = ix.features(0, ix.num_tokens)
    for doc in range(ix.num_documents):
        start, stop = ix.document_range(doc)
        matcher = OnlineMatcher(ix)
        online = [length for length, _ in matcher.extend(ix.tokens(start, stop))]
        assert all(o >= s for o, s in zip(online, stored.match_len[start:stop]))


def test_documents_attribution(corpus):
    ix, rng = corpus
    x = ix.tokens(0, ix.num_tokens)
    context = list(x[10:25])
    hits = ix.query.documents(context, k=3)
    length = int(ix.query.longest_match([context]).length[0])
    assert 1 <= len(hits) <= 3 and length > 0
    for hit in hits:
        start, _ = ix.document_range(hit["document"])
        at = start + hit["offset"]
        assert list(ix.tokens(at, at + length)) == context[len(context) - length :]
        assert hit["source"] == ix.document_source(hit["document"])
        assert ix.decode(context[len(context) - length :]) in hit["snippet"]


def test_one_lookup_answers_as_the_three_queries(corpus):
    ix, rng = corpus
    x, doc_ids = ix.tokens(0, ix.num_tokens), doc_ids_of(ix)
    for context in random_contexts(rng, x, 20):
        found = ix.query.lookup(context, top_k=3, sources=2)
        length, count, nexts = brute_longest(x, doc_ids, context)
        assert (found.length, found.count) == (length, count), context
        tokens, counts = ix.query.next_token_distribution([context], top_k=3)[0]
        assert found.tokens.tolist() == tokens.tolist()
        assert found.counts.tolist() == counts.tolist()
        assert found.documents == (ix.query.documents(context, k=2) if length else [])


def test_edge_cases(corpus):
    ix, _ = corpus
    empty = ix.query.longest_match([[]])
    assert empty.length[0] == 0 and empty.count[0] == ix.num_tokens
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ix.query.longest_match([[300]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        OnlineMatcher(ix).push(-1)
    unseen = ix.query.longest_match([[ord("z")]])  # a byte the corpus never holds
    assert unseen.length[0] == 0
    separator = ix.manifest["separator"]
    assert ix.query.longest_match([[ord("a"), separator]]).length[0] == 0


def test_query_cli(corpus):
    import subprocess
    import sys

    ix, _ = corpus
    start = next(a for a, b in map(ix.document_range, range(ix.num_documents)) if b - a > 18)
    text = ix.decode(ix.tokens(start + 2, start + 17))
    out = subprocess.run(
        [sys.executable, "-m", "teralm.cli", "query", str(ix.directory), text],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("longest match: 15 of 15 tokens")
    assert "[doc " in out.stdout


def test_large_ranges_are_sampled_deterministically(corpus):
    ix, _ = corpus
    exact = dict(zip(*(a.tolist() for a in ix.query.next_token_distribution([[]])[0])))
    tokens, counts = ix.query.next_token_distribution([[]], exact_limit=10)[0]
    stride = -(-ix.num_tokens // 10)
    assert all(c % stride == 0 for c in counts) and set(tokens.tolist()) <= set(exact)
    again = ix.query.next_token_distribution([[]], exact_limit=10)[0]
    assert tokens.tolist() == again[0].tolist() and counts.tolist() == again[1].tolist()


def test_one_byte_matches_are_exact_past_max_support(corpus):
    ix, _ = corpus
    context = [ord("a")]
    exact = ix.query.next_token_distribution([context])
    table = ix.query.next_token_distribution([context], exact_limit=2)
    assert ix.query.longest_match([context]).count[0] > 2
    for (ta, ca), (tb, cb) in zip(exact, table):
        assert ta.tolist() == tb.tolist() and ca.tolist() == cb.tolist()


def test_causal_counts_equal_brute_force(corpus):
    """The ∞-gram of a position seeing only earlier text (training's counts)."""
    ix, rng = corpus
    x, doc_ids = ix.tokens(0, ix.num_tokens), doc_ids_of(ix)
    limits = [int(t) for t in rng.integers(1, ix.num_tokens, size=60)]
    contexts = []
    for t in limits:
        start = t - 1
        while start > 0 and doc_ids[start - 1] == doc_ids[t - 1] and t - start < 40:
            start -= 1
        contexts.append([int(v) for v in x[start:t]])
    targets = [int(x[t]) for t in limits]
    ends = np.cumsum([len(c) for c in contexts])
    text = [v for c in contexts for v in c]
    got = ix.query.causal_counts(text, ends - [len(c) for c in contexts], ends, limits, targets)
    for (length, total, hits), context, limit, target in zip(got, contexts, limits, targets):
        want = (0, 0, 0)
        for size in range(len(context), 0, -1):
            ends = [
                p
                for p in occurrences(x, doc_ids, context[len(context) - size :])
                if p + 1 < limit and has_follower(doc_ids, p)
            ]
            if ends:
                want = (size, len(ends), sum(int(x[p + 1]) == target for p in ends))
                break
        assert (length, total, hits) == want, (context, limit)


def brute_followers(x, doc_ids, context, limit, cap, k):
    """The longest suffix of ``context`` (at most ``cap`` tokens) seen followed by a token
    before ``limit``: (its length, occurrences, its k most frequent followers with counts)."""
    for size in range(min(len(context), cap), 0, -1):
        ends = [
            p
            for p in occurrences(x, doc_ids, context[len(context) - size :])
            if p + 1 < limit and has_follower(doc_ids, p)
        ]
        if ends:
            counts = Counter(int(x[p + 1]) for p in ends)
            return size, len(ends), sorted(counts.items(), key=lambda tc: (-tc[1], tc[0]))[:k]
    return 0, 0, []


def contexts_before(x, doc_ids, limits, longest=40):
    """Each limit's context inside its document (at most ``longest`` tokens), laid end to end:
    (contexts, text, begins, ends)."""
    contexts = []
    for t in limits:
        start = t - 1
        while start > 0 and doc_ids[start - 1] == doc_ids[t - 1] and t - start < longest:
            start -= 1
        contexts.append([int(v) for v in x[start:t]])
    ends = np.cumsum([len(c) for c in contexts])
    return contexts, [v for c in contexts for v in c], ends - [len(c) for c in contexts], ends


def check_followers(got, c, level, want, k):
    length, total, top = want
    assert (got.lengths[c, level], got.totals[c, level]) == (length, total)
    tokens = [t for t, _ in top] + [-1] * (k - len(top))
    counts = [n for _, n in top] + [0] * (k - len(top))
    assert got.tokens[c, level].tolist() == tokens and got.counts[c, level].tolist() == counts


def test_causal_followers_equal_brute_force(corpus):
    """The top followers of a position's context at several lengths, seeing only earlier text
    (the index input beyond the one stored follower), and with a limit past the corpus's end,
    seeing all of it (as serving does)."""
    ix, rng = corpus
    x, doc_ids = ix.tokens(0, ix.num_tokens), doc_ids_of(ix)
    limits = [int(t) for t in rng.integers(1, ix.num_tokens, size=50)] + [ix.num_tokens + 5] * 5
    contexts, text, begins, ends = contexts_before(x, doc_ids, limits[:50])
    tail = [[int(v) for v in x[a : a + int(rng.integers(1, 12))]] for a in rng.integers(0, 400, 5)]
    contexts += tail
    text += [v for c in tail for v in c]
    ends = np.cumsum([len(c) for c in contexts])
    begins = ends - [len(c) for c in contexts]
    caps, k = [32, 8, 3], 3
    got = ix.query.causal_followers(text, begins, ends, limits, caps, k)
    assert got.tokens.shape == (len(contexts), len(caps), k)
    for c, (context, limit) in enumerate(zip(contexts, limits)):
        for level, cap in enumerate(caps):
            check_followers(got, c, level, brute_followers(x, doc_ids, context, limit, cap, k), k)


@pytest.mark.parametrize("shard_tokens", [1 << 20, 37])
def test_causal_followers_see_nothing_at_or_after_their_position(tmp_path, shard_tokens):
    """Two corpora that agree before position t (documents alike, tokens from t on redrawn)
    give every position up to t the same followers, in one shard or in many."""
    rng = np.random.default_rng(7)
    docs = random_documents(rng, 14, max_len=80)
    t = len("".join(docs[:7])) + 5
    flat = list("".join(docs))
    flat[t:] = rng.choice(list("abc"), size=len(flat) - t)
    cut, changed = 0, []
    for doc in docs:
        changed.append("".join(flat[cut : cut + len(doc)]))
        cut += len(doc)
    found = []
    for name, texts in (("a", docs), ("b", changed)):
        ix = build_docs(tmp_path / name, texts, shard_tokens=shard_tokens)
        x, doc_ids = ix.tokens(0, ix.num_tokens), doc_ids_of(ix)
        limits = [p for p in range(1, t + 1) if doc_ids[p] == doc_ids[p - 1]]
        contexts, text, begins, ends = contexts_before(x, doc_ids, limits)
        found.append(ix.query.causal_followers(text, begins, ends, limits, [16, 4], 4))
        assert (len(ix.manifest["shards"]) == 1) == (shard_tokens > ix.num_tokens)
    for a, b in zip(vars(found[0]).values(), vars(found[1]).values()):
        np.testing.assert_array_equal(a, b)
    assert (found[0].lengths > 0).mean() > 0.5


def test_earlier_followers_scan_equals_numpy_at_both_order_widths(corpus):
    """The causal counts' scan over a rank range, on 4-byte positions (read as words) and the
    same order written 5 bytes a position (read byte by byte), against numpy."""
    ix, rng = corpus
    corpus4 = ix.query.corpus
    n = len(corpus4[6])
    positions = fmt.positions(np.asarray(corpus4[4]), 4).astype(np.int64)
    wide = np.zeros((n, 5), np.uint8)
    wide[:, :4] = np.asarray(corpus4[4]).reshape(n, 4)
    corpus5 = (*corpus4[:4], wide.ravel(), 5, *corpus4[6:])
    follow = np.asarray(corpus4[6]).astype(np.int64)
    separator = ix.query.separator
    for _ in range(40):
        lo, hi = sorted(int(v) for v in rng.integers(0, n + 1, size=2))
        stride, limit = int(rng.integers(1, 5)), int(rng.integers(0, ix.num_tokens + 2))
        target = int(follow[rng.integers(0, n)])
        ranks = np.arange(lo, hi, stride)
        ok = (positions[ranks] + 1 < limit) & (follow[ranks] != separator)
        want = (int(ok.sum()), int((ok & (follow[ranks] == target)).sum()))
        for table in (corpus4, corpus5):
            got = kq._earlier_followers(table, lo, hi, stride, limit, target, separator)
            assert tuple(got) == want, (lo, hi, stride, limit, target)


def test_sampled_causal_counts_never_call_a_context_seen_before_unseen(corpus):
    """Near the corpus start nearly every occurrence of a short context comes after the
    position, so a sample of them can miss the few before it: those are then counted exactly
    (the context was seen, and the ∞-gram says so); elsewhere the sample's count stands."""
    ix, _ = corpus
    x, doc_ids = ix.tokens(0, ix.num_tokens), doc_ids_of(ix)
    limits = [t for t in range(2, min(120, ix.num_tokens)) if doc_ids[t - 1] == doc_ids[t - 2]]
    contexts = [[int(x[t - 2]), int(x[t - 1])] for t in limits]
    exact_limit = max(len(occurrences(x, doc_ids, c[1:])) for c in contexts) // 32 + 1
    text = [v for c in contexts for v in c]
    ends = np.arange(2, 2 * len(contexts) + 1, 2)
    targets = [int(x[t]) for t in limits]
    got = ix.query.causal_counts(text, ends - 2, ends, limits, targets, exact_limit)
    rescanned = 0
    for (length, total, hits), context, limit, target in zip(got, contexts, limits, targets):
        for size in (2, 1):
            seen = [
                p
                for p in occurrences(x, doc_ids, context[2 - size :])
                if p + 1 < limit and has_follower(doc_ids, p)
            ]
            if seen:
                break
        assert (length > 0) == bool(seen), (context, limit)
        if not seen:
            continue
        assert length == size
        exact = (len(seen), sum(int(x[p + 1]) == target for p in seen))
        stride = -(-len(occurrences(x, doc_ids, context[2 - size :])) // exact_limit)
        if (total, hits) == exact:
            rescanned += stride > 1 and total % stride != 0
        else:
            assert total % stride == 0 and hits % stride == 0, (context, limit)
    assert rescanned > 0
