"""A damaged index gives one clear error that names the file, never a crash or a wrong answer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import build_docs, random_documents

from teralm.cli import main
from teralm.errors import IndexDamaged
from teralm.index import Index

TERALM = str(Path(sys.executable).with_name("teralm"))
ENV = {**os.environ, "TQDM_DISABLE": "1"}
SHARD = "shard-00001"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    docs = random_documents(np.random.default_rng(7), 30, max_len=200)
    return build_docs(tmp_path_factory.mktemp("bytes"), docs, shard_tokens=1000).directory


@pytest.fixture(scope="module")
def built_bpe(tmp_path_factory) -> Path:
    docs = random_documents(np.random.default_rng(8), 30, alphabet="abcdefgh ", max_len=200)
    out = tmp_path_factory.mktemp("bpe")
    return build_docs(out, docs, shard_tokens=500, tokenizer="bpe:300").directory


@pytest.fixture
def index_dir(built, tmp_path) -> Path:
    """A copy of the built index, free to damage."""
    return Path(shutil.copytree(built, tmp_path / "index"))


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def remove(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() else path.unlink()


def set_values(path: Path, dtype: str, where, value) -> None:
    """Overwrite the entries ``where`` of the file read as an array of ``dtype``."""
    values = np.fromfile(path, dtype=dtype)
    values[where] = value
    values.tofile(path)


def run_teralm(*args) -> subprocess.CompletedProcess:
    return subprocess.run([TERALM, *args], capture_output=True, env=ENV, timeout=300, check=False)


def assert_one_line_error(result: subprocess.CompletedProcess, *words: str) -> str:
    """A clean non-zero exit (no signal, no traceback) with one line on stderr naming ``words``."""
    stderr = result.stderr.decode(errors="replace")
    assert result.returncode > 0, (result.returncode, stderr)
    assert len(stderr.strip().splitlines()) == 1, stderr
    for word in words:
        assert word in stderr, stderr
    return stderr


def verify_output(directory: Path, capsys) -> str:
    """``teralm verify-index``'s report; it must fail."""
    assert main(["verify-index", str(directory), "--samples", "8", "--quiet"]) == 1
    return capsys.readouterr().out


def query_text(directory: Path) -> str:
    ix = Index.open(directory)
    return ix.decode(ix.tokens(1200, 1230))


DAMAGES = [
    (truncate, f"{SHARD}.tokens"),
    (truncate, f"{SHARD}.match"),
    (truncate, "order.positions"),
    (truncate, "order.follow"),
    (truncate, "order.keys"),
    (truncate, "order.buckets"),
    (truncate, "documents.offsets"),
    (remove, "order.keys"),
    (remove, "documents.offsets"),
    (remove, "catalog.lmdb"),
]


@pytest.mark.parametrize("damage, name", DAMAGES, ids=lambda v: getattr(v, "__name__", v))
def test_open_and_verify_name_a_missing_or_truncated_file(index_dir, damage, name, capsys):
    damage(index_dir / name)
    with pytest.raises(IndexDamaged, match=f"{name}.*verify-index"):
        Index.open(index_dir)
    assert f"FAIL {name}" in verify_output(index_dir, capsys)


def test_match_length_beyond_max_match_is_refused(index_dir, capsys):
    ix = Index.open(index_dir)
    set_values(index_dir / f"{SHARD}.match", "u1", 10, 0x7F)
    with pytest.raises(IndexDamaged, match=f"{SHARD}.match.*verify-index"):
        ix.features(0, ix.num_tokens)
    assert f"FAIL {SHARD}.match" in verify_output(index_dir, capsys)


def test_bucket_table_out_of_order_is_refused(index_dir, capsys):
    text = query_text(index_dir)
    set_values(index_dir / "order.buckets", "<u8", 60_000, 1 << 30)
    ix = Index.open(index_dir)
    with pytest.raises(IndexDamaged, match="order.buckets.*verify-index"):
        ix.query.longest_match([ix.encode(text)])
    assert "FAIL order.buckets" in verify_output(index_dir, capsys)


def flip_positions(directory: Path) -> None:
    path = directory / "order.positions"
    set_values(path, "<u4", slice(None), np.fromfile(path, "<u4") ^ np.uint32(1 << 31))


def truncate_positions(directory: Path) -> None:
    truncate(directory / "order.positions")


def flip_buckets(directory: Path) -> None:
    set_values(directory / "order.buckets", "<u8", slice(20_000, None), 1 << 40)


def truncate_catalog(directory: Path) -> None:
    os.truncate(directory / "catalog.lmdb" / "data.mdb", 8192)  # its two header pages


@pytest.mark.parametrize(
    "damage", [truncate_positions, flip_positions, flip_buckets, truncate_catalog]
)
def test_query_of_damaged_index_exits_with_one_line(index_dir, damage, capsys):
    """These could crash the process (SIGSEGV, SIGBUS): reads past the end of a file."""
    text = query_text(index_dir)
    damage(index_dir)
    result = run_teralm("query", str(index_dir), text)
    assert_one_line_error(result, "teralm query: error:", str(index_dir), "verify-index")
    assert "FAIL" in verify_output(index_dir, capsys)


def _source_byte(directory: Path) -> tuple[Path, int]:
    """The data file of the catalog and the offset of a digit of a document's source name (a
    document record: start, length, source)."""
    data = directory / "catalog.lmdb" / "data.mdb"
    raw = data.read_bytes()
    at = raw.find(b'"source": "', raw.find(b'"length": ')) + len(b'"source": "')
    assert at > 20
    return data, at


@pytest.mark.parametrize("where", ["source name", "page header"])
def test_verify_checks_the_catalogs_content(index_dir, where, capsys):
    """A changed source name (still valid JSON) or a broken page of ``catalog.lmdb`` is found
    by verify-index (the manifest holds the document records' checksum)."""
    data, at = _source_byte(index_dir)
    raw = bytearray(data.read_bytes())
    if where == "source name":
        raw[at] = ord("7") if raw[at] != ord("7") else ord("8")
    else:
        page = at // 4096 * 4096
        raw[page : page + 16] = b"\xa5" * 16
    data.write_bytes(bytes(raw))
    assert "FAIL catalog.lmdb" in verify_output(index_dir, capsys)


def test_follower_outside_vocabulary_is_refused(built_bpe, tmp_path, capsys):
    directory = Path(shutil.copytree(built_bpe, tmp_path / "index"))
    ix = Index.open(directory)
    context = ix.tokens(1000, 1004)
    set_values(directory / "order.follow", "<u2", slice(None), 0xFFFF)
    result = run_teralm("query", str(directory), ix.decode(context))
    assert_one_line_error(result, "teralm query: error:", "verify-index")
    assert "FAIL order.follow" in verify_output(directory, capsys)


def edit_manifest(directory: Path, change) -> None:
    manifest = json.loads((directory / "manifest.json").read_text())
    change(manifest)
    (directory / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda m: m.pop("shards"), ["'shards'"]),
        (lambda m: m.update(num_tokens="many"), ["'num_tokens'"]),
        (lambda m: m["shards"][1].pop("files"), ["shard 1"]),
        (lambda m: m["shards"][1].update(num_tokens=999), ["num_tokens"]),
        (lambda m: m["order"]["files"]["keys"].update(bytes=8), ["order.keys"]),
    ],
    ids=["no shards", "num_tokens a string", "no files", "sizes disagree", "keys bytes"],
)
def test_malformed_manifest_is_refused(index_dir, change, words):
    edit_manifest(index_dir, change)
    with pytest.raises(IndexDamaged) as error:
        Index.open(index_dir)
    for word in ["manifest.json", *words]:
        assert word in str(error.value)


def test_cli_reports_malformed_manifest_in_one_line(index_dir):
    edit_manifest(index_dir, lambda m: m.pop("shards"))
    assert_one_line_error(run_teralm("query", str(index_dir), "abc"), "'shards'")
    assert_one_line_error(run_teralm("verify-index", str(index_dir)), "'shards'")


def test_verify_rejects_negative_samples(built):
    result = run_teralm("verify-index", str(built), "--samples", "-1")
    assert_one_line_error(result, "--samples")


def test_query_takes_non_utf8_bytes_for_a_byte_index(built):
    """The argument's bytes are searched as they are (Python passes them as surrogates)."""
    result = run_teralm("query", str(built), b"\xe9ab")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(b"longest match: 2 of 3 tokens")


def test_query_refuses_non_utf8_text_for_a_bpe_index(built_bpe):
    result = run_teralm("query", str(built_bpe), b"ab\xe9")
    assert_one_line_error(result, "UTF-8")
