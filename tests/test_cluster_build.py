"""build-index --cluster: on a Ray cluster of two nodes on this machine, the same files as a local
build, also when a unit's worker is killed; a unit's own error ends the build as itself."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest
from conftest import write_jsonl
from test_cli import run_cli

from teralm.build_index import BuildConfig, build, builder, cluster
from teralm.errors import BuildError
from teralm.index import format as fmt

ray = pytest.importorskip("ray")

SHARD_TOKENS = 40_000
STORE_BYTES = 80 << 20  # per node's object store: the units pass only small tuples
_NUMBERED_JOB = builder._numbered_job  # pass 3's unit, before a test replaces it


@pytest.fixture(scope="module")
def head() -> Iterator[str]:
    """The address of a Ray cluster of two nodes (head and worker, 1 CPU each) on this machine,
    whose workers can import this module."""
    from ray.cluster_utils import Cluster

    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), saved]))
    nodes = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": STORE_BYTES}
    )
    try:
        nodes.add_node(num_cpus=1, object_store_memory=STORE_BYTES)
        yield nodes.address
    finally:
        nodes.shutdown()
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, Path]:
    """A corpus of about 190k bytes (five shards) and its index built locally, in-process."""
    folder = tmp_path_factory.mktemp("reference")
    rng = np.random.default_rng(11)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "\n"]
    docs = [" ".join(rng.choice(words, size=n)) for n in rng.integers(20, 400, size=150)]
    source = write_jsonl(folder / "corpus.jsonl", docs)
    build(_config(source, folder / "index"))
    return source, folder / "index"


def _config(source: Path, out: Path, **kwargs) -> BuildConfig:
    return BuildConfig(str(source), out, shard_tokens=SHARD_TOKENS, progress=False, **kwargs)


def _manifest(index: Path) -> dict:
    return json.loads((index / fmt.MANIFEST).read_text())


def _features_jobs(index: Path) -> int:
    return json.loads((index / fmt.BUILD_STATS).read_text())["features_jobs"]


def assert_same_index(out: Path, ref: Path) -> None:
    """Every file byte for byte (the catalog and the manifest too), but the build's stats."""
    assert fmt.content_digests(out) == fmt.content_digests(ref)


def test_cluster_build_equals_local_build(tmp_path, head, reference):
    source, ref = reference
    out = tmp_path / "index"
    args = ["build-index", source, "--out", out, "--shard-tokens", SHARD_TOKENS]
    result = run_cli(*args, "--workers", "2", "--cluster", head, "--quiet")
    assert result.returncode == 0, result.stderr
    assert len(_manifest(out)["shards"]) == 5 and _features_jobs(out) >= 3
    assert_same_index(out, ref)


def _features_job_or_die(i, layout, *job):
    """Pass 3's unit, which records where it ran; in the first call of a build to finish its
    work, the worker process then kills itself, so that its result never arrives (the others
    take half a second more: Ray may otherwise run short jobs one after another on one node)."""
    rows = _NUMBERED_JOB(i, layout, *job)
    folder = Path(layout.directory).parent
    node = ray.get_runtime_context().get_node_id()
    (folder / "ran").mkdir(exist_ok=True)
    (folder / "ran" / f"{i}.{node}.{os.getpid()}").touch()
    try:
        with open(folder / "killed", "x") as f:
            f.write(str(i))
    except FileExistsError:
        time.sleep(0.5)  # two jobs at once, so each of the two 1-CPU nodes runs one
        return rows
    os.kill(os.getpid(), signal.SIGKILL)


def test_killed_worker_is_retried_to_the_same_index(tmp_path, head, reference, monkeypatch):
    source, ref = reference
    monkeypatch.setattr(builder, "_numbered_job", _features_job_or_die)
    build(_config(source, tmp_path / "index", workers=2, cluster=head))
    killed = int((tmp_path / "killed").read_text())
    runs = [name.split(".") for name in os.listdir(tmp_path / "ran")]
    assert len([pid for i, _, pid in runs if int(i) == killed]) == 2  # killed, then run again
    assert len({node for _, node, _ in runs}) == 2
    assert_same_index(tmp_path / "index", ref)


def _fail_or_hang(folder: Path, i: int) -> None:
    """Unit 1 records its process and hangs; unit 0 waits for it, then fails (disk full)."""
    (folder / f"try-{i}-{os.getpid()}").touch()
    if i == 1:
        time.sleep(600)
    while not list(folder.glob("try-1-*")):
        time.sleep(0.05)
    raise OSError(errno.ENOSPC, "No space left on device", str(folder / "shard-00000.match"))


def test_unit_error_is_raised_as_itself_and_kills_the_rest(tmp_path, head):
    with cluster.connect(head) as run_units:
        with pytest.raises(OSError) as failed:
            run_units(_fail_or_hang, [(tmp_path, 0), (tmp_path, 1)], 2, print)
        assert type(failed.value) is OSError and failed.value.errno == errno.ENOSPC
        assert failed.value.filename == str(tmp_path / "shard-00000.match")
        assert len(list(tmp_path.glob("try-0-*"))) == 1  # an error of its own: not retried
        [hung] = [int(p.name.split("-")[2]) for p in tmp_path.glob("try-1-*")]
        deadline = time.monotonic() + 60
        while psutil.pid_exists(hung) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not psutil.pid_exists(hung), "the hanging unit's worker was not killed"


def test_unreachable_cluster_fails_at_once(tmp_path, reference):
    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(BuildError, match=f"cannot reach the Ray cluster at {address}"):
        build(_config(reference[0], tmp_path / "out", cluster=address))


def test_cluster_without_ray_says_what_to_install(tmp_path, reference, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(BuildError, match=r"pip install teralm\[cluster\]"):
        build(_config(reference[0], tmp_path / "out", cluster="auto"))


BUILD_WITHOUT_RAY = """
import sys
from teralm.cli import build_index_main
code = build_index_main(sys.argv[1:])
assert not [m for m in sys.modules if m.split(".")[0] == "ray"], "a local build imported ray"
sys.exit(code)
"""


def test_local_build_imports_no_ray(tmp_path, reference):
    args = [reference[0], "--out", tmp_path / "index", "--shard-tokens", SHARD_TOKENS]
    result = subprocess.run(
        [sys.executable, "-c", BUILD_WITHOUT_RAY, *map(str, args), "--workers", "1", "--quiet"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
