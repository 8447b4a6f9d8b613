"""Helpers shared by the benchmarks: measured subprocesses, tables, JSON results, data paths."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "benchmarks" / "results"
CACHE = ROOT / "benchmarks" / "cache"
PYDOCS = SHARED_DATA / "pydocs.jsonl.gz"
CORPORA = {
    "pydocs": PYDOCS,
    "manpages": CACHE / "manpages.jsonl.gz",
    "headers": CACHE / "headers.jsonl.gz",
}
# the recipes that make the corpora not in the shared data, from this machine's files
RECIPES = {"manpages": "make_manpages.py", "headers": "make_headers.py"}
TERALM = [sys.executable, "-m", "teralm.cli"]  # the CLI in this Python


def run_measured(cmd: list[str], interval: float = 0.2, **kwargs) -> dict:
    """Run ``cmd``; return wall seconds, peak RSS of its process tree, exit code and output tail."""
    began = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs
    )
    root = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        total = 0
        try:
            for p in [root, *root.children(recursive=True)]:
                total += p.memory_info().rss
        except psutil.Error:
            pass
        peak = max(peak, total)
        time.sleep(interval)
    output = proc.stdout.read()
    return {
        "wall_s": time.perf_counter() - began,
        "peak_rss": peak,
        "returncode": proc.returncode,
        "output": output[-3000:],
    }


def teralm_cli(*args) -> str:
    """Run ``teralm ARGS...`` in this Python; its stdout, or exit with its stderr on failure."""
    out = subprocess.run([*TERALM, *map(str, args)], capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"teralm {args[0]} failed:\n{out.stderr}")
    return out.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_process(run: Path, index: Path, *flags) -> Iterator[tuple[int, subprocess.Popen]]:
    """``teralm serve`` of ``run`` with ``index`` on a free local port, once /health answers:
    yields the port and the process (exits with its stderr if it dies first). Its stderr (the
    access log: a line per request) goes to a file, not a pipe that nobody reads while the load
    runs, which would block the server once the pipe is full."""
    port = free_port()
    cmd = [*TERALM, "serve", "--index", index, "--run", run, "--port", port, *flags]
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen(list(map(str, cmd)), stdout=subprocess.DEVNULL, stderr=log)
        try:
            while True:
                if server.poll() is not None:
                    log.seek(0)
                    sys.exit(f"teralm serve failed:\n{log.read()}")
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                    break
                except OSError:
                    time.sleep(0.5)
            yield port, server
        finally:
            server.terminate()
            server.wait(timeout=60)


def quality_work(corpus: str) -> Path:
    """Where a corpus's text, index and bench_quality's runs are kept."""
    return CACHE / ("quality" if corpus == "pydocs" else f"quality-{corpus}")


def corpus_index(corpus: str = "pydocs") -> tuple[Path, Path]:
    """A corpus's JSONL file and its byte index, built once under ``quality_work(corpus)`` and
    shared by the benchmarks: ``pydocs`` (the team's shared data), ``manpages`` (this machine's
    manual pages, rendered by make_manpages.py the first time) or ``headers`` (its C and C++
    headers, by make_headers.py)."""
    source = CORPORA[corpus]
    if not source.exists() and corpus == "pydocs":
        sys.exit(f"{PYDOCS} not found: the benchmark reads the team's shared data folder")
    if not source.exists():
        recipe = ROOT / "benchmarks" / RECIPES[corpus]
        subprocess.run([sys.executable, recipe, "--out", source], check=True)
    work = quality_work(corpus)
    data = work / f"{corpus}.jsonl"
    if not data.exists():
        work.mkdir(parents=True, exist_ok=True)
        with gzip.open(source, "rb") as f, open(data, "wb") as out:
            shutil.copyfileobj(f, out)
    index = work / "index"
    teralm_cli("build-index", data, "--out", index, "--quiet")
    return data, index


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Plain-text table; ``columns`` are (key, header, format spec); the first column is a label."""

    def cell(row, key, spec):
        value = row.get(key)
        return "-" if value is None else format(value, spec)

    widths = [max(len(h), 8, *(len(cell(r, k, s)) for r in rows)) for k, h, s in columns]

    def line(cells):
        first, *rest = cells
        return "  ".join(
            [f"{first:<{widths[0]}}", *(f"{c:>{w}}" for c, w in zip(rest, widths[1:]))]
        )

    lines = [line([h for _, h, _ in columns])]
    lines.append("-" * len(lines[0]))
    lines += [line([cell(r, k, s) for k, _, s in columns]) for r in rows]
    return "\n".join(lines)


def save(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1))
    return path


def write_documents(out: Path, documents: Iterable[tuple[str, str]]) -> str:
    """Write ``(path, text)`` documents as gzipped JSON lines ``{"id", "path", "text"}`` (the
    layout of pydocs.jsonl.gz) to ``out``, atomically; a summary line with the sha256 of the
    JSON lines (not of their gzip, which zlib's version sways), so two machines can tell whether
    they have the same corpus."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    count = text_bytes = 0
    digest = hashlib.sha256()
    with gzip.GzipFile(partial, "wb", mtime=0) as f:
        for path, text in documents:
            line = json.dumps({"id": count, "path": path, "text": text}, ensure_ascii=False) + "\n"
            f.write(line.encode())
            digest.update(line.encode())
            count += 1
            text_bytes += len(text.encode())
    os.replace(partial, out)
    return (
        f"{out}: {count:,} documents, {text_bytes:,} bytes of text, {out.stat().st_size:,} bytes "
        f"gzipped, sha256 of the JSON lines {digest.hexdigest()}"
    )
