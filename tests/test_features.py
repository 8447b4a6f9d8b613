"""Stored causal features equal an O(N^2) brute force, whatever the sharding."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import build_docs, build_source, random_documents, write_jsonl

from teralm.index import Index
from teralm.index import format as fmt
from teralm.kernels.match import brute_force_features


def doc_ids_of(ix: Index) -> np.ndarray:
    ids = np.empty(ix.num_tokens, dtype=np.int64)
    for i in range(ix.num_documents):
        a, b = ix.document_range(i)
        ids[a:b] = i
    return ids


def assert_features_match_brute_force(ix: Index) -> None:
    tokens = ix.tokens(0, ix.num_tokens)
    lengths, valid_next = brute_force_features(tokens, doc_ids_of(ix), ix.max_match)
    got = ix.features(0, ix.num_tokens)
    np.testing.assert_array_equal(got.match_len, lengths)
    for t, (nxt, valid) in enumerate(zip(got.next_token, valid_next)):
        if valid:
            assert nxt in valid, f"position {t}: next {nxt} not among {valid}"
        else:
            assert nxt == ix.no_token, f"position {t}: next {nxt}, expected none"
    assert_order_correct(ix, doc_ids_of(ix))


def reversed_key(tokens, doc_ids, t: int, lowest: int, separator: int) -> list[int]:
    """The reversed context of ``t`` back to its document start (or ``lowest``), then the
    separator."""
    key, j = [], t
    while j >= lowest and doc_ids[j] == doc_ids[t]:
        key.append(int(tokens[j]))
        j -= 1
    return key + [separator]


def assert_order_correct(ix: Index, doc_ids: np.ndarray) -> None:
    """``order.positions`` holds every position once, sorted by the first ``sort_depth`` key
    elements, then shard, then whole key; ``order.follow[i]`` is the token after the i-th
    position, or the separator; ``order.keys`` holds the first key word of every KEY_SAMPLE-th
    position."""
    tokens, separator = ix.tokens(0, ix.num_tokens), ix.manifest["separator"]
    m = ix.manifest
    width, depth, shard = m["order"]["width"], m["order"]["depth"], m["shard_tokens"]
    raw = np.fromfile(fmt.order_file(ix.directory, "positions"), dtype=np.uint8)
    p = fmt.positions(raw, width)
    assert sorted(p.tolist()) == list(range(ix.num_tokens))
    lowest = [max(0, (t // shard) * shard - m["context_overlap"]) for t in range(ix.num_tokens)]
    keys = [reversed_key(tokens, doc_ids, t, lowest[t], separator) for t in range(ix.num_tokens)]
    sort_keys = [(keys[t][:depth], t // shard, keys[t]) for t in p.tolist()]
    assert sort_keys == sorted(sort_keys)
    dtype = fmt.sort_dtype(tokens.dtype, separator)
    follow = np.fromfile(fmt.order_file(ix.directory, "follow"), dtype=dtype)
    inside = p + 1 < ix.num_tokens
    inside[inside] = doc_ids[p[inside] + 1] == doc_ids[p[inside]]
    expected = np.full(len(p), separator)
    expected[inside] = tokens[p[inside] + 1]
    np.testing.assert_array_equal(follow, expected)
    sampled = np.fromfile(fmt.order_file(ix.directory, "keys"), dtype=fmt.KEY_DTYPE)
    bits = 8 * dtype.itemsize
    assert sampled.tolist() == [
        first_key_word(tokens, doc_ids, t, bits, separator) for t in p[:: fmt.KEY_SAMPLE]
    ]
    buckets = np.fromfile(fmt.order_file(ix.directory, "buckets"), dtype=fmt.BUCKET_DTYPE)
    lead = [first_key_word(tokens, doc_ids, t, bits, separator) >> 48 for t in p.tolist()]
    assert buckets[-1] == ix.num_tokens
    np.testing.assert_array_equal(np.searchsorted(lead, np.arange(1 << 16)), buckets[:-1])


def first_key_word(tokens, doc_ids, t: int, bits: int, separator: int) -> int:
    """The reversed context of ``t`` cut at its document start, then the separator, packed
    big-endian into 64 bits (zeros after the separator)."""
    key = []
    for j in range(64 // bits):
        if t - j < 0 or doc_ids[t - j] != doc_ids[t]:
            key.append(separator)
            break
        key.append(int(tokens[t - j]))
    key += [0] * (64 // bits - len(key))
    return sum(v << (bits * (len(key) - 1 - i)) for i, v in enumerate(key))


@pytest.mark.parametrize("seed", range(6))
def test_single_shard_matches_brute_force(tmp_path, seed):
    rng = np.random.default_rng(seed)
    docs = random_documents(rng, int(rng.integers(1, 12)), alphabet="ab"[: 1 + seed % 2])
    ix = build_docs(tmp_path, docs, shard_tokens=1 << 20, max_match=int(rng.integers(2, 40)))
    assert ix.stream.sizes == [ix.num_tokens]
    assert_features_match_brute_force(ix)


@pytest.mark.parametrize("seed", range(10))
def test_random_shards_and_documents_match_brute_force(tmp_path, seed):
    """The odd seeds stream pass 3 in chunks of 16 entries per shard (the least memory)."""
    from teralm.build_index.builder import WORKER_BYTES

    rng = np.random.default_rng(100 + seed)
    docs = random_documents(rng, int(rng.integers(2, 20)), max_len=int(rng.integers(3, 150)))
    shard = int(rng.integers(1, 120))
    memory = {"memory": 2 * WORKER_BYTES + (100 << 10)} if seed % 2 else {}
    max_match = int(rng.integers(1, 70))
    ix = build_docs(tmp_path, docs, shard_tokens=shard, max_match=max_match, **memory)
    assert len(ix.stream.sizes) == -(-ix.num_tokens // shard)
    assert_features_match_brute_force(ix)


def test_bpe_index_matches_brute_force(tmp_path):
    rng = np.random.default_rng(7)
    docs = random_documents(rng, 15, alphabet="ab c", max_len=120)
    ix = build_docs(tmp_path, docs, tokenizer="bpe:300", shard_tokens=40)
    assert ix.manifest["tokenizer"] == "bpe" and ix.stream.dtype == np.dtype("<u2")
    assert ix.vocab_size <= 300
    assert_features_match_brute_force(ix)


def test_all_byte_values_use_a_wide_separator(tmp_path):
    data = bytes(range(256)) * 3 + b"abcabcabc" + bytes(range(100, 200))
    (tmp_path / "all.bin").write_bytes(data)
    from teralm.build_index import BuildConfig, build

    build(
        BuildConfig(str(tmp_path / "all.bin"), tmp_path / "index", shard_tokens=300, progress=False)
    )
    ix = Index.open(tmp_path / "index")
    assert ix.manifest["separator"] == 256
    assert_features_match_brute_force(ix)


def test_parallel_workers_give_identical_files(tmp_path):
    rng = np.random.default_rng(3)
    docs = random_documents(rng, 40, max_len=300)
    one = build_docs(tmp_path / "one", docs, shard_tokens=500, workers=1)
    two = build_docs(tmp_path / "two", docs, shard_tokens=500, workers=2)
    assert len(one.manifest["shards"]) > 1
    assert one.manifest["shards"] == two.manifest["shards"]


def test_features_independent_of_sharding_where_contract_is_exact(tmp_path):
    rng = np.random.default_rng(11)
    docs = random_documents(rng, 25, max_len=200)
    a = build_docs(tmp_path / "a", docs, shard_tokens=10_000)
    b = build_docs(tmp_path / "b", docs, shard_tokens=37)
    np.testing.assert_array_equal(
        a.features(0, a.num_tokens).match_len, b.features(0, b.num_tokens).match_len
    )


def test_read_api(tmp_path):
    docs = ["hello world", "hello there", "", "wörld"]
    ix = build_docs(tmp_path, docs, shard_tokens=7)
    assert ix.num_documents == 3  # the empty document holds no tokens
    assert ix.num_tokens == sum(len(d.encode()) for d in docs)
    assert ix.decode(ix.tokens(*ix.document_range(2))) == "wörld"
    np.testing.assert_array_equal(ix.encode("hello"), np.frombuffer(b"hello", np.uint8))
    assert ix.document_range(1) == (11, 22)
    f = ix.features(11, 16)  # "hello" again: matches grow 1..5
    assert f.match_len.tolist() == [1, 2, 3, 4, 5]
    assert ix.decode(f.next_token[-1:]) == " "
    assert ix.features(0, 1).next_token[0] == ix.no_token
    assert ix.document_source(0) == "0"
    with pytest.raises(IndexError):
        ix.document_range(3)


def test_tiny_memory_budget_gives_identical_files(tmp_path):
    """A budget that makes pass 3 stream its merge in small chunks of every shard changes
    no byte of the index."""
    from test_cli import content_files

    from teralm.build_index.builder import WORKER_BYTES

    rng = np.random.default_rng(12)
    source = write_jsonl(tmp_path / "corpus.jsonl", random_documents(rng, 600, max_len=600))
    large = build_source(source, tmp_path / "large", shard_tokens=30_000)
    memory = (
        2 * WORKER_BYTES + 28 * 100_000
    )  # what sorting needs: chunks of ~1,500 entries per shard
    small = build_source(source, tmp_path / "small", shard_tokens=30_000, memory=memory)
    assert content_files(large.directory) == content_files(small.directory)
    assert large.manifest["order"] == small.manifest["order"]


def test_pass3_job_replaces_work_files_a_killed_run_left(tmp_path, monkeypatch):
    """A job that spills finds the files of an earlier run of it (killed before its cleanup)
    and gives the same index as a clean build."""
    from test_cli import content_files

    from teralm.build_index import features
    from teralm.build_index.builder import WORKER_BYTES

    rng = np.random.default_rng(13)
    docs = random_documents(rng, 600, max_len=600)  # jobs of ~45,000 entries, 8,300 in memory
    source = write_jsonl(tmp_path / "corpus.jsonl", docs)
    options = {"shard_tokens": 30_000, "workers": 1, "memory": 2 * WORKER_BYTES + 28 * 100_000}
    clean = build_source(source, tmp_path / "clean", **options)
    real_job, left = features.features_job, []

    def after_a_killed_run(layout, firsts, spans, global_start, *memory):
        for path in features.work_paths(layout, global_start).values():
            path.write_bytes(bytes(range(256)) * 64)
            left.append(path)
        return real_job(layout, firsts, spans, global_start, *memory)

    monkeypatch.setattr(features, "features_job", after_a_killed_run)
    resumed = build_source(source, tmp_path / "resumed", **options)
    assert left and not any(path.exists() for path in left)
    assert content_files(clean.directory) == content_files(resumed.directory)


def test_index_of_an_older_format_is_refused(tmp_path):
    ix = build_docs(tmp_path, ["hello world", "hello there"])
    manifest = json.loads((ix.directory / fmt.MANIFEST).read_text())
    manifest["version"] = 3
    (ix.directory / fmt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="format version 3.*reads version 4.*rebuild"):
        Index.open(ix.directory)
