"""Shared fixtures: random corpora with planted repeats, and builds of them."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from teralm.build_index import BuildConfig, build
from teralm.index import Index

os.environ.setdefault("TQDM_DISABLE", "1")

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def cli_here(*args) -> subprocess.CompletedProcess:
    """``teralm ARGS`` run in this process (for commands that are refused before any work: the
    CLI's own code path, without a new interpreter's import of torch), as ``run_cli`` gives it."""
    from teralm import cli

    argv, out, err = list(map(str, args)), io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as e:  # argparse's usage errors
            code = e.code
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


HOLD_LOCK = """
import sys
from teralm.files import folder_lock
with folder_lock(sys.argv[1], "a test's holder"):
    print("held", flush=True)
    sys.stdin.readline()
"""


@contextlib.contextmanager
def folder_held(folder: Path):
    """Another process holds ``folder``'s writer lock while the block runs: its pid."""
    folder.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(folder)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        yield holder.pid
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def random_documents(
    rng: np.random.Generator, num_docs: int, alphabet: str = "abc", max_len: int = 60
) -> list[str]:
    """Small-alphabet documents, some with long substrings copied from earlier ones."""
    docs: list[str] = []
    for _ in range(num_docs):
        n = int(rng.integers(1, max_len))
        text = "".join(rng.choice(list(alphabet), size=n))
        if docs and rng.random() < 0.6:
            src = docs[int(rng.integers(len(docs)))]
            a = int(rng.integers(len(src)))
            piece = src[a : a + int(rng.integers(1, 45))]
            cut = int(rng.integers(len(text) + 1))
            text = text[:cut] + piece + text[cut:]
        docs.append(text)
    return docs


def write_jsonl(path: Path, docs: list[str]) -> Path:
    with open(path, "w") as f:
        for i, text in enumerate(docs):
            f.write(json.dumps({"id": i, "text": text}) + "\n")
    return path


def build_docs(tmp_path: Path, docs: list[str], **kwargs) -> Index:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return build_source(write_jsonl(tmp_path / "corpus.jsonl", docs), tmp_path / "index", **kwargs)


def build_source(source: Path, out: Path, **kwargs) -> Index:
    """The index of ``source`` built in ``out`` (two builds of one source have the same files)."""
    build(BuildConfig(source=str(source), out=out, progress=False, **kwargs))
    return Index.open(out)


@pytest.fixture
def rng(request) -> np.random.Generator:
    return np.random.default_rng(abs(hash(request.node.name)) % 2**32)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> dict:
    """A tiny model trained for 30 steps on a built index, for the server tests: the index, the
    run folder and the model loaded from it as ``teralm serve`` loads it."""
    import torch

    from teralm.infer.load import load_model
    from teralm.model import ModelConfig
    from teralm.train.config import RunConfig, TrainConfig
    from teralm.train.loop import train

    base = tmp_path_factory.mktemp("tiny-run")
    rng = np.random.default_rng(21)
    ix = build_docs(base / "corpus", random_documents(rng, 30, alphabet="abcde", max_len=300))
    config = RunConfig(
        ModelConfig(n_layer=2, n_head=2, d_model=32, max_seq_len=48, attention="tscale", window=8),
        TrainConfig(batch_size=4, seq_len=32, max_steps=30, warmup_steps=3, holdout_every=10),
    )
    train(ix, config, base / "run", progress=False)
    model, _, _ = load_model(base / "run", torch.device("cpu"), generating=True)
    return {"ix": ix, "run": base / "run", "model": model}
