"""build-index under faults: a disk that fills in each pass, dying workers, bad flags and bad text."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import numpy as np
import psutil
import pytest
from conftest import folder_held, write_jsonl
from test_cli import ENV, assert_clean_failure, content_files, run_cli

from teralm.build_index import BuildConfig, build, features
from teralm.errors import SourceError
from teralm.files import LOCK
from teralm.index import format as fmt
from teralm.index.catalog import Catalog

SHARD_TOKENS = 100_000
PAGE = 4096
PASSES = ("tokenize", "sort", "features", "match files", "finalize")


class Tmpfs:
    """A size-limited tmpfs at ``path`` (needs root); ``resize`` frees or takes away space."""

    def __init__(self, path: Path, size: int):
        path.mkdir()
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "none", str(path)], capture_output=True
        )
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs (needs root): {mounted.stderr.decode()}")
        self.path = path

    def resize(self, size: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.path)], check=True)

    def unmount(self) -> None:
        """Lazily: a failed in-process build's traceback may still map files of the disk."""
        subprocess.run(["umount", "--lazy", str(self.path)], check=True)


def _word_documents() -> list[str]:
    """About 200k bytes of text with long repeats: two shards of SHARD_TOKENS."""
    rng = np.random.default_rng(7)
    words = ["alpha", "beta", "gamma", "delta", "\n"]
    return [" ".join(rng.choice(words, size=n)) for n in rng.integers(50, 700, size=100)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, Path]:
    """The corpus and its index built on an ordinary disk."""
    folder = tmp_path_factory.mktemp("reference")
    source = write_jsonl(folder / "corpus.jsonl", _word_documents())
    build(_config(source, folder / "index"))
    return source, folder / "index"


def _config(source: Path, out: Path) -> BuildConfig:
    """In-process (a pool only starts slower; the command-line test below runs one)."""
    return BuildConfig(
        str(source), out, shard_tokens=SHARD_TOKENS, verify_samples=0, progress=False
    )


def _pages(path: Path) -> int:
    return -(-path.stat().st_size // PAGE) * PAGE


def _fill_size(index: Path, fill_pass: str) -> int:
    """A tmpfs size that runs out halfway through what ``fill_pass`` writes (from the
    reference index's file sizes)."""

    def total(*kinds: str) -> int:
        return sum(_pages(p) for p in index.iterdir() if p.suffix.lstrip(".") in kinds)

    # the catalog as the build leaves it is rewritten compactly; while it runs, LMDB's file
    # holds old pages too, and a lock file
    catalog = 2 * sum(_pages(p) for p in (index / fmt.CATALOG).iterdir()) + 64 * 1024
    tokens, order = total("tokens", "offsets"), _order_bytes(index)
    prefix = 4 * total("tokens")  # pass 2's sorted positions, uint32 per byte token
    records = Catalog(index / fmt.CATALOG, readonly=True)
    sorted_ = sum(record["bytes"] for _, record in records.prefixed("p2/shard/"))
    records.close()
    written = {
        "tokenize": tokens // 2,
        "sort": tokens + prefix // 2,
        "features": tokens + sorted_ + order // 2,
    }
    return catalog + written[fill_pass]


def _order_bytes(index: Path) -> int:
    return sum(_pages(p) for p in index.iterdir() if p.name.startswith("order."))


def _unfinished_pass(out: Path) -> str:
    """The pass a stopped build was in, from its catalog's progress records."""
    catalog = Catalog(out / fmt.CATALOG, readonly=True)
    try:
        p1 = catalog.get("p1/done")
        if p1 is None:
            return "tokenize"
        if len(list(catalog.prefixed("p2/shard/"))) < len(p1["sizes"]):
            return "sort"
        if catalog.get("p3/done") is not None:
            return "finalize"
        jobs = catalog.get("p3/jobs")
        if jobs is None or len(list(catalog.prefixed("p3/job/"))) < len(jobs):
            return "features"
        return "match files"
    finally:
        catalog.close()


def _fill(disk: Path) -> None:
    """Take every free byte of ``disk``."""
    with open(disk / "filler", "wb", buffering=0) as f:
        while True:
            try:
                f.write(bytes(1 << 16))
            except OSError:
                return


@pytest.mark.parametrize("fill_pass", PASSES)
def test_full_disk_then_resume_gives_identical_index(tmp_path, reference, fill_pass, monkeypatch):
    source, ref = reference
    out = tmp_path / "disk" / "out"
    if fill_pass == "finalize":  # the earlier passes peak above the final size: fill it up
        disk = Tmpfs(tmp_path / "disk", 64 << 20)
        build(_config(source, out))
        (out / fmt.MANIFEST).unlink()  # as if killed just before writing it
        _fill(disk.path)
    elif fill_pass == "match files":  # it needs less than the merge before it: fill up then
        disk = Tmpfs(tmp_path / "disk", 64 << 20)
        remove_runs = features.remove_runs

        def remove_runs_then_fill(layout):
            remove_runs(layout)
            if not (disk.path / "filler").exists():
                _fill(disk.path)

        monkeypatch.setattr(features, "remove_runs", remove_runs_then_fill)
    else:
        disk = Tmpfs(tmp_path / "disk", _fill_size(ref, fill_pass))
    try:
        with pytest.raises((OSError, lmdb.Error)) as failed:
            build(_config(source, out))
        assert "No space left on device" in str(failed.value)
        assert _unfinished_pass(out) == fill_pass
        assert not (out / fmt.MANIFEST).exists()

        monkeypatch.undo()
        (disk.path / "filler").unlink(missing_ok=True)
        disk.resize(64 << 20)
        build(_config(source, out))
        assert content_files(out) == content_files(ref)
        assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in ref.iterdir())
    finally:
        disk.unmount()


def test_full_disk_in_a_worker_names_the_file(tmp_path, reference):
    """The ENOSPC of a pass 3 worker reaches the command line as itself, with the file."""
    source, ref = reference
    disk = Tmpfs(tmp_path / "disk", _fill_size(ref, "features"))
    out = disk.path / "out"
    try:
        args = ["build-index", source, "--out", out, "--shard-tokens", SHARD_TOKENS]
        result = run_cli(*args, "--workers", "2", "--quiet")
        assert_clean_failure(result, out, f"disk full writing {out}/", "run the same")
    finally:
        disk.unmount()


DIE_IN_WORKERS = """
import os, sys
from teralm.build_index.builder import _run_units
from teralm.errors import BuildError
if __name__ == "__main__":
    try:
        _run_units(os._exit, [(3,)] * 4, 2, print)
    except BuildError as e:
        print(e)
        sys.exit(1)
"""


def test_dead_worker_stops_the_build_with_a_message(tmp_path):
    """A worker killed mid-job (out of memory, kill -9) ends the build; it never waits forever."""
    script = tmp_path / "die.py"
    script.write_text(DIE_IN_WORKERS)
    try:
        result = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the build waited forever for a dead worker")
    assert result.returncode == 1, result.stderr
    assert "worker" in result.stdout and "run the same command again" in result.stdout


def test_a_second_build_of_one_out_is_refused_at_once(tmp_path, reference):
    """While one process writes ``--out``, a build into it is refused with one line naming
    that process, and writes nothing; two builds started together give the index one build
    gives (one builds, the other is refused or finds it complete)."""
    source, index = reference
    out = tmp_path / "out"
    cmd = [
        sys.executable, "-m", "teralm.cli", "build-index", str(source), "--out", str(out),
        "--shard-tokens", str(SHARD_TOKENS), "--workers", "2", "--verify-samples", "0", "--quiet",
    ]  # fmt: skip
    with folder_held(out) as holder:
        refused = run_cli(*cmd[3:])
    assert_clean_failure(refused, out, f"pid {holder}", "in use")
    assert refused.stderr.count("\n") == 1 and [p.name for p in out.iterdir()] == [LOCK]
    racing = [subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=ENV) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in racing]
    assert any(code == 0 for code, _ in results), results
    for code, stderr in results:
        assert code == 0 or ("in use by build-index (pid" in stderr and "Traceback" not in stderr)
    assert content_files(out) == content_files(index)
    verified = run_cli("verify-index", out)
    assert verified.returncode == 0, verified.stdout + verified.stderr


@pytest.mark.parametrize(
    "flag", ["--verify-samples=-1", "--workers=0", "--max-match=0", "--memory=1"]
)
def test_bad_flag_fails_before_any_work(tmp_path, flag):
    (tmp_path / "a.txt").write_text("some text " * 100)
    out = tmp_path / "out"
    result = run_cli("build-index", tmp_path / "a.txt", "--out", out, flag)
    assert_clean_failure(result, out, flag.split("=")[0])
    assert result.stderr.count("\n") == 1 and not out.exists()
    assert flag != "--memory=1" or "--memory 1 B is less than" in result.stderr


def test_a_tiny_shard_size_is_warned_about(tmp_path):
    (tmp_path / "a.txt").write_text("some text " * 100)
    result = run_cli(
        "build-index",
        tmp_path / "a.txt",
        "--out",
        tmp_path / "out",
        "--shard-tokens",
        1000,
        "--quiet",
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith("teralm build-index: warning: --shard-tokens 1,000 is small")


@pytest.mark.parametrize(
    "line, problem",
    [(b'{"text": "a\\ud800b"}', "surrogate"), (b'{"text": "a\xffb"}', "UTF-8")],
)
@pytest.mark.parametrize("tokenizer", ["bytes", "bpe:300"])
def test_bad_text_names_file_and_line(tmp_path, line, problem, tokenizer):
    path = tmp_path / "c.jsonl"
    path.write_bytes(json.dumps({"text": "fine"}).encode() + b"\n" + line + b"\n")
    config = BuildConfig(str(path), tmp_path / "out", tokenizer=tokenizer, progress=False)
    with pytest.raises(SourceError, match=f"{path}:2: .*{problem}"):
        build(config)


KILLED_AT_POOL_START = """
import os, signal, threading, time
from teralm.build_index.builder import _run_units
threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGKILL)).start()
_run_units(time.sleep, [(60,), (60,)], workers=2, on_done=print)
"""


def test_build_killed_as_its_workers_start_leaves_no_process(tmp_path):
    """kill -9 of the build before its pool workers are up: the workers must not outlive it
    (they would wait forever on a queue that nobody writes)."""
    build = subprocess.Popen([sys.executable, "-c", KILLED_AT_POOL_START], start_new_session=True)
    build.wait(timeout=60)

    def left() -> list[psutil.Process]:
        return [p for p in psutil.process_iter() if _group(p) == build.pid]

    deadline = time.monotonic() + 30
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = left()
    for p in survivors:
        p.kill()
    assert not survivors, [" ".join(p.cmdline())[:80] for p in survivors]


def _group(process: psutil.Process) -> int | None:
    try:
        return os.getpgid(process.pid) if process.status() != psutil.STATUS_ZOMBIE else None
    except (ProcessLookupError, psutil.NoSuchProcess):
        return None
