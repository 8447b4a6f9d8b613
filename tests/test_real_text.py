"""Builds of real text: a folder of the Python standard library, and pydocs when present."""

from __future__ import annotations

import gzip
import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from conftest import SHARED_DATA, write_jsonl

from teralm.build_index import BuildConfig, build
from teralm.build_index.layout import Layout
from teralm.build_index.verify import verify
from teralm.errors import SourceError
from teralm.index import Index
from teralm.index import format as fmt

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def test_stdlib_folder_build(tmp_path):
    folder = STDLIB / "json"
    result = build(
        BuildConfig(
            str(folder), tmp_path / "ix", shard_tokens=20_000, progress=False, verify_samples=64
        )
    )
    ix = Index.open(tmp_path / "ix")
    files = sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)
    assert ix.num_documents == len(files)
    assert ix.num_tokens == sum(p.stat().st_size for p in files)
    first = ix.document_source(0)
    assert (folder / first).read_bytes() == ix.tokens(*ix.document_range(0)).tobytes()
    f = ix.features(0, ix.num_tokens)
    assert f.match_len.max() == 32 and (f.match_len >= 8).mean() > 0.3  # code repeats itself
    buckets = (fmt.NUM_BUCKETS + 1) * 8 / ix.num_tokens  # the bucket table, a fixed 512 KiB
    assert result.manifest["bytes_per_token"]["total"] == pytest.approx(8.25 + buckets, abs=0.03)
    assert verify(Layout.from_manifest(tmp_path / "ix", result.manifest), 200) == []


def test_incomplete_index_is_not_opened(tmp_path):
    (tmp_path / "ix").mkdir()
    with pytest.raises(ValueError, match="not a complete teralm index"):
        Index.open(tmp_path / "ix")


@pytest.mark.skipif(
    not (SHARED_DATA / "pydocs.jsonl.gz").exists(),
    reason="../shared/data/pydocs.jsonl.gz not present (team checkout only)",
)
def test_pydocs_subset_build(tmp_path):
    with gzip.open(SHARED_DATA / "pydocs.jsonl.gz", "rt") as f:
        docs = [json.loads(line)["text"] for _, line in zip(range(120), f)]
    write_jsonl(tmp_path / "sub.jsonl", docs)
    build(
        BuildConfig(
            str(tmp_path / "sub.jsonl"),
            tmp_path / "ix",
            shard_tokens=1 << 20,
            workers=2,
            progress=False,
        )
    )
    ix = Index.open(tmp_path / "ix")
    layout = Layout.from_manifest(ix.directory, ix.manifest)
    assert ix.num_tokens == sum(len(d.encode()) for d in docs)
    assert verify(layout, 100, seed=1) == []
    assert np.mean(ix.features(0, ix.num_tokens).match_len) > 8


def test_parquet_and_saved_dataset_sources(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = ["first document", "second one, longer", "third"]
    pq.write_table(pa.table({"body": texts, "title": ["a", "b", "c"]}), tmp_path / "c.parquet")
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "saved"))
    for source, field in ((tmp_path / "c.parquet", "body"), (tmp_path / "saved", "text")):
        out = tmp_path / f"ix-{source.name}"
        build(BuildConfig(str(source), out, text_field=field, progress=False))
        ix = Index.open(out)
        assert [ix.decode(ix.tokens(*ix.document_range(i))) for i in range(3)] == texts
    assert Index.open(tmp_path / "ix-c.parquet").document_source(1) == "b"
    splits = datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"text": texts}),
         "test": datasets.Dataset.from_dict({"text": ["held out"]})}
    )  # fmt: skip
    splits.save_to_disk(str(tmp_path / "splits"))
    build(BuildConfig(f"{tmp_path / 'splits'}:test", tmp_path / "ix-test", progress=False))
    assert Index.open(tmp_path / "ix-test").num_tokens == len("held out")
    with pytest.raises(SourceError, match="has no split 'dev' \\(it has: train, test\\)"):
        build(BuildConfig(f"{tmp_path / 'splits'}:dev", tmp_path / "ix-dev", progress=False))


def test_a_hub_name_offline_fails_at_once_naming_the_local_formats(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SourceError, match="HF_HUB_OFFLINE is set.*save_to_disk.*Parquet"):
        build(BuildConfig("wikitext", tmp_path / "out", progress=False))
