"""build-index from the command line: resume after kill -9, bad input, verify-index."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import random_documents, write_jsonl

from teralm.build_index import BuildConfig, build
from teralm.index import Index
from teralm.index import format as fmt

ENV = {**os.environ, "TQDM_DISABLE": "1"}


def run_cli(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "teralm.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
        **kwargs,
    )


def assert_clean_failure(result: subprocess.CompletedProcess, out: Path, *words: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    message = result.stderr.strip().splitlines()[-1]  # above it: progress bars only
    assert message.startswith("teralm build-index: error: "), result.stderr
    for word in words:
        assert word in message, message
    assert not (out / "manifest.json").exists()


def content_files(directory: Path) -> dict[str, str]:
    """The sha256 of every file of an index folder (the catalog's and the manifest included),
    but the build's stats."""
    digests = fmt.content_digests(directory)
    assert fmt.MANIFEST in digests and f"{fmt.CATALOG}/data.mdb" in digests
    return digests


def test_killed_build_resumes_to_identical_index(tmp_path):
    rng = np.random.default_rng(5)
    docs = [
        " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "\n"], size=n))
        for n in rng.integers(100, 3000, size=300)
    ]
    source = write_jsonl(tmp_path / "corpus.jsonl", docs)
    build(BuildConfig(str(source), tmp_path / "ref", shard_tokens=100_000, progress=False))
    reference = Index.open(tmp_path / "ref")

    out = tmp_path / "killed"
    args = [
        sys.executable,
        "-m",
        "teralm.cli",
        "build-index",
        source,
        "--out",
        out,
        "--shard-tokens",
        "100000",
        "--workers",
        "2",
        "--quiet",
    ]
    kills = 0
    for delay in rng.uniform(1.0, 6.0, size=4):
        proc = subprocess.Popen(
            list(map(str, args)),
            env=ENV,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(delay)
        if proc.poll() is not None:
            break
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        kills += 1
    assert kills >= 1
    finished = run_cli(*args[3:])
    assert finished.returncode == 0, finished.stderr
    assert content_files(out) == content_files(reference.directory)
    assert Index.open(out).manifest["shards"] == reference.manifest["shards"]
    again = run_cli(*args[3:])
    assert again.returncode == 0 and "already complete" in again.stdout


def test_two_builds_of_one_input_give_the_same_files(tmp_path):
    """``sha256sum`` over every file of two builds of the same corpus and flags (one on a pool
    of workers with another memory budget): the same, but the build's stats."""
    rng = np.random.default_rng(2)
    source = write_jsonl(tmp_path / "corpus.jsonl", random_documents(rng, 80, max_len=3000))
    sums = []
    for name, more in (("a", []), ("b", ["--workers", "2", "--memory", "700M"])):
        out = tmp_path / name
        built = run_cli("build-index", source, "--out", out, "--shard-tokens", 20_000, *more)
        assert built.returncode == 0, built.stderr
        assert (out / fmt.BUILD_STATS).exists()
        listed = subprocess.run(
            "find . -type f ! -name build-stats.json -print0 | sort -z | xargs -0 sha256sum",
            shell=True, cwd=out, capture_output=True, text=True, check=True,
        )  # fmt: skip
        sums.append(listed.stdout)
    assert sums[0] == sums[1]
    assert "./catalog.lmdb/data.mdb" in sums[0] and "./manifest.json" in sums[0]


def test_missing_source(tmp_path):
    result = run_cli("build-index", tmp_path / "nope.txt", "--out", tmp_path / "out")
    assert_clean_failure(result, tmp_path / "out", "no such file")


def test_enwik_offline_names_url_and_path(tmp_path):
    env = {**ENV, "TERALM_CACHE": str(tmp_path / "cache"), "http_proxy": "http://127.0.0.1:9"}
    result = subprocess.run(
        [sys.executable, "-m", "teralm.cli", "build-index", "enwik8", "--out", tmp_path / "o"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert_clean_failure(
        result, tmp_path / "o", "mattmahoney.net/dc/enwik8.zip", str(tmp_path / "cache" / "enwik8")
    )


def test_empty_corpus(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    result = run_cli("build-index", tmp_path / "empty.txt", "--out", tmp_path / "out")
    assert_clean_failure(result, tmp_path / "out", "no text")


def test_non_utf8_in_bpe_mode(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("café crème".encode("latin-1") * 50)
    result = run_cli(
        "build-index", tmp_path / "latin1.txt", "--out", tmp_path / "out", "--tokenizer", "bpe:300"
    )
    assert_clean_failure(result, tmp_path / "out", "UTF-8", "--tokenizer bytes")


def test_vocabulary_over_uint16(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    result = run_cli(
        "build-index", tmp_path / "a.txt", "--out", tmp_path / "out", "--tokenizer", "bpe:70000"
    )
    assert_clean_failure(result, tmp_path / "out", "65535")


def test_bad_json_line(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    result = run_cli("build-index", tmp_path / "c.jsonl", "--out", tmp_path / "out")
    assert_clean_failure(result, tmp_path / "out", "c.jsonl:2", "invalid JSON")


def test_different_index_refused_unless_forced(tmp_path):
    (tmp_path / "a.txt").write_text("one corpus " * 20)
    (tmp_path / "b.txt").write_text("another corpus " * 20)
    out = tmp_path / "out"
    assert run_cli("build-index", tmp_path / "a.txt", "--out", out).returncode == 0
    manifest = (out / "manifest.json").read_bytes()
    refused = run_cli("build-index", tmp_path / "b.txt", "--out", out)
    assert refused.returncode != 0 and "--force" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert (out / "manifest.json").read_bytes() == manifest  # nothing lost
    forced = run_cli("build-index", tmp_path / "b.txt", "--out", out, "--force")
    assert forced.returncode == 0
    assert Index.open(out).num_tokens == len("another corpus " * 20)


def test_a_build_that_finished_nothing_is_taken_over(tmp_path):
    """A build stopped by bad input before its first shard leaves a catalog; a correct build
    into the same --out goes ahead without --force."""
    (tmp_path / "c.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    (tmp_path / "a.txt").write_text("one corpus " * 20)
    out = tmp_path / "out"
    failed = run_cli("build-index", tmp_path / "c.jsonl", "--out", out)
    assert failed.returncode != 0 and (out / "catalog.lmdb").exists()
    again = run_cli("build-index", tmp_path / "a.txt", "--out", out)
    assert again.returncode == 0, again.stderr
    assert Index.open(out).num_tokens == len("one corpus " * 20)


def test_foreign_folder_is_never_deleted(tmp_path):
    (tmp_path / "a.txt").write_text("text")
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    result = run_cli("build-index", tmp_path / "a.txt", "--out", out, "--force")
    assert_clean_failure(result, out, "choose another folder")
    assert (out / "thesis.tex").read_text() == "precious"


def test_full_disk(tmp_path):
    (tmp_path / "big.txt").write_bytes(os.urandom(600_000))
    mnt = tmp_path / "small"
    mnt.mkdir()
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        result = run_cli("build-index", tmp_path / "big.txt", "--out", mnt / "out")
        assert_clean_failure(result, mnt / "out", "disk full", "resume")
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_summary_and_verify_index(tmp_path):
    rng = np.random.default_rng(1)
    write_jsonl(tmp_path / "c.jsonl", random_documents(rng, 30, max_len=400))
    out = tmp_path / "out"
    built = run_cli("build-index", tmp_path / "c.jsonl", "--out", out, "--shard-tokens", "1000")
    assert built.returncode == 0, built.stderr
    for word in ("tokens", "documents", "shards", "bytes/tok", "tokenize", "features", "peak RSS"):
        assert word in built.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    # tokens 1, match 2, positions 4, follow 1, sampled keys 0.25, and the bucket table
    buckets = (fmt.NUM_BUCKETS + 1) * 8 / manifest["num_tokens"]
    assert manifest["bytes_per_token"]["total"] == pytest.approx(8.25 + buckets, abs=0.03)
    ok = run_cli("verify-index", out, "--samples", "50")
    assert ok.returncode == 0 and "OK" in ok.stdout, ok.stdout + ok.stderr
    match = out / "shard-00001.match"
    data = bytearray(match.read_bytes())
    data[10] ^= 0x05
    match.write_bytes(bytes(data))
    bad = run_cli("verify-index", out)
    assert bad.returncode == 1 and "shard-00001.match" in bad.stdout


def test_the_cli_docstrings_name_every_command():
    from teralm import cli

    help_text = run_cli("--help").stdout
    commands = help_text.split("{", 1)[1].split("}", 1)[0].split(",")
    assert len(commands) >= 10
    for name in commands:
        assert name in cli.main.__doc__, name
    for name, module in cli.COMMANDS.items():
        assert name in module.__doc__, name


def test_help_is_plain_text():
    """``teralm --help`` and each command's help read as text, without docstring markup."""
    from conftest import cli_here

    for args in (["--help"], ["train", "--help"], ["serve", "--help"], ["build-index", "--help"]):
        shown = cli_here(*args)
        assert shown.returncode == 0 and "usage: teralm" in shown.stdout
        assert "``" not in shown.stdout, args


def test_python_dash_m_teralm_runs_the_cli():
    shown = run_cli_module("--help")
    assert shown.returncode == 0 and "usage: teralm" in shown.stdout, shown.stderr


def run_cli_module(*args) -> subprocess.CompletedProcess:
    """``python -m teralm ARGS``, as ``torchrun -m teralm`` starts it."""
    return subprocess.run(
        [sys.executable, "-m", "teralm", *map(str, args)], capture_output=True, text=True, env=ENV
    )
