"""Pass 1 in pieces: a source read piece by piece gives its documents, and the pass run on a pool
of processes, or stopped and resumed, writes the same shards and catalog as one process."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import write_jsonl
from test_sources import enwik_like, reference_split

from teralm.build_index import BuildConfig, build, builder, sources, tokenize
from teralm.build_index.sources import Source, resolve_source
from teralm.index import format as fmt
from teralm.index.catalog import Catalog
from teralm.index.tokenizer import ByteTokenizer
from teralm.kernels.sort import byte_histogram


def documents(source: Source) -> list:
    return [document for document, _ in source.documents()]


def test_enwik_pieces_give_the_pages_of_the_whole_file(tmp_path, monkeypatch):
    data = enwik_like(60)
    path = tmp_path / "enwik8"
    path.write_bytes(data)
    expected = [document for document, _ in reference_split(data, "enwik8")]
    for piece in (1, 5, 8, 9, 64, 333, len(data) - 1, len(data), 1 << 24):
        monkeypatch.setattr(sources, "PIECE_BYTES", piece)
        source = Source("enwik8", "enwik", path)
        assert len(source.pieces()) == -(-len(data) // piece)
        assert documents(source) == expected, piece


def test_json_lines_pieces_keep_line_numbers_and_labels(tmp_path, monkeypatch):
    rng = np.random.default_rng(3)
    lines, expected = [], []
    for i in range(200):
        if rng.random() < 0.1:
            lines.append("   ")
            continue
        text = "".join(rng.choice(list("ab\u00e9\n"), size=int(rng.integers(0, 40))))
        record = {"text": text, **({"title": f"t{i}"} if rng.random() < 0.3 else {})}
        lines.append(json.dumps(record, ensure_ascii=bool(i % 2)))
        expected.append((record.get("title", f"c.jsonl:{len(lines)}"), text))
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(lines) + "\n")
    size = path.stat().st_size
    for piece in (1, 2, 17, 100, 1000, size - 1, size, 1 << 24):
        monkeypatch.setattr(sources, "PIECE_BYTES", piece)
        assert documents(resolve_source(str(path))) == expected, piece


def test_a_bad_line_in_a_later_piece_is_named_by_its_line_number(tmp_path, monkeypatch):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": "x" * i}) + "\n" for i in range(50)) + "{oops\n")
    monkeypatch.setattr(sources, "PIECE_BYTES", 64)
    with pytest.raises(sources.SourceError, match=f"{path}:51: invalid JSON"):
        documents(resolve_source(str(path)))


def test_parquet_pieces_are_row_groups(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"text": [f"doc {i}" for i in range(2500)]})
    pq.write_table(table, tmp_path / "c.parquet", row_group_size=700)
    source = resolve_source(str(tmp_path / "c.parquet"))
    assert [(p.start, p.stop) for p in source.pieces()] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    got = [document for p in source.pieces() for document, _ in source.read(p)]
    assert got == [(f"c.parquet:{i + 1}", f"doc {i}") for i in range(2500)]


def _corpus(tmp_path) -> tuple:
    """A JSON lines corpus of documents of all sizes (some empty, some over a shard)."""
    rng = np.random.default_rng(11)
    words = ["alpha", "beta", "gamma", "\u00e9t\u00e9", "\n"]
    docs = [" ".join(rng.choice(words, size=n)) for n in rng.integers(0, 900, size=120)]
    docs[7] = ""
    docs[40] = " ".join(rng.choice(words, size=6000))  # longer than a shard
    return write_jsonl(tmp_path / "corpus.jsonl", docs)


def _records(out) -> dict:
    """Pass 1's records: the documents and the shards."""
    catalog = Catalog(out / fmt.CATALOG, readonly=True)
    try:
        return dict(catalog.prefixed(b"doc/")) | dict(catalog.prefixed(b"p1/shard/"))
    finally:
        catalog.close()


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe:300"])
def test_parallel_pass_1_writes_what_one_process_writes(tmp_path, monkeypatch, tokenizer):
    source = _corpus(tmp_path)
    monkeypatch.setattr(sources, "PIECE_BYTES", 4000)  # pieces are cut here, in the parent
    outs = []
    for workers in (1, 2):
        outs.append(tmp_path / f"w{workers}")
        config = BuildConfig(
            str(source),
            outs[-1],
            tokenizer=tokenizer,
            shard_tokens=10_000,
            workers=workers,
            verify_samples=0,
            progress=False,
        )
        build(config)
    assert fmt.content_digests(outs[0]) == fmt.content_digests(outs[1])
    assert len(_shards(outs[0])) > 5
    assert _records(outs[0]) == _records(outs[1])


class Stop(Exception):
    pass


@pytest.mark.parametrize("after", [1, 3, 9, 14])
def test_pass_1_stopped_after_some_pieces_resumes_to_the_same_shards(tmp_path, monkeypatch, after):
    source = resolve_source(str(_corpus(tmp_path)))
    monkeypatch.setattr(sources, "PIECE_BYTES", 9000)
    source = Source(source.name, source.kind, source.path)
    reference = tmp_path / "reference"
    reference.mkdir()
    _pass_1(source, reference, builder._run_units)

    def stopping(fn, args, workers, on_done):
        seen = []

        def done(result):
            if len(seen) == after:
                raise Stop
            seen.append(result)
            on_done(result)

        builder._run_units(fn, args, workers, done)

    out = tmp_path / "stopped"
    out.mkdir()
    with pytest.raises(Stop):
        _pass_1(source, out, stopping)
    _pass_1(source, out, builder._run_units)
    assert _records(out) == _records(reference)
    assert _shards(out) == _shards(reference)


def _shards(out) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("shard-*.tokens"))}


def _pass_1(source: Source, out, run_units) -> None:
    catalog = Catalog(out / fmt.CATALOG)
    try:
        tokenize.tokenize_pass(source, ByteTokenizer(), catalog, out, 7_000, False, run_units, 2)
    finally:
        catalog.close()


def test_byte_histogram_is_bincount():
    rng = np.random.default_rng(0)
    for n in (0, 1, 3, 4, 5, 1000, 65_539):
        tokens = rng.integers(0, 256, size=n).astype(np.uint8)
        if n > 100:
            tokens[: n // 2] = 7  # runs of one value
        assert (byte_histogram(tokens) == np.bincount(tokens, minlength=256)).all(), n


def test_a_rebuild_with_another_bpe_model_in_one_process_uses_the_new_model(tmp_path):
    """The tokenizer a process keeps for pass 1 is the model file's of now, not of an earlier
    build of the same folder."""
    source = _corpus(tmp_path)
    options = {"shard_tokens": 10_000, "verify_samples": 0, "progress": False}
    build(BuildConfig(str(source), tmp_path / "out", tokenizer="bpe:260", **options))
    build(BuildConfig(str(source), tmp_path / "out", tokenizer="bpe:280", force=True, **options))
    build(BuildConfig(str(source), tmp_path / "fresh", tokenizer="bpe:280", **options))
    assert _shards(tmp_path / "out") == _shards(tmp_path / "fresh")
