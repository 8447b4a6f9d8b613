"""Training faults: damaged run files, folders that are not runs, checkpoints outside the run."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import folder_held
from test_train import TINY, corpus, run_cli  # noqa: F401 (corpus is a fixture)

from teralm.model import checkpoint

CKPT = "ckpt-00000004"


@pytest.fixture(scope="module")
def finished_run(corpus, tmp_path_factory):  # noqa: F811
    """A tiny run of 4 steps with a checkpoint at step 4."""
    folder = tmp_path_factory.mktemp("finished")
    config = folder / "tiny.toml"
    config.write_text(TINY)
    run = folder / "run"
    args = ["--config", config, "--max-steps", "4", "--checkpoint-every", "4", "--quiet"]
    done = run_cli("train", "--index", corpus.directory, "--out", run, *args)
    assert done.returncode == 0, done.stderr
    assert json.loads((run / "latest.json").read_text())["checkpoint"] == CKPT
    return run


def one_line_error(result) -> str:
    """The single stderr line of a clean failure."""
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("teralm train: error: "), result.stderr
    return lines[0]


DAMAGE = {
    "latest.json": "[1, 2]",
    f"{CKPT}/state.json": "{}",
    "metrics.jsonl": '{"step": 1, "loss": 5.0}\nnot json\n',
    "config.json": "{not json",
}


@pytest.mark.parametrize("name", DAMAGE)
def test_damaged_run_file_gets_one_line_naming_it(corpus, finished_run, tmp_path, name):  # noqa: F811
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (run / name).write_text(DAMAGE[name])
    result = run_cli("train", "--index", corpus.directory, "--out", run, "--resume", "--quiet")
    assert str(run / name) in one_line_error(result)


def test_config_json_of_the_wrong_shape_is_named(corpus, finished_run, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (run / "config.json").write_text(json.dumps({"config": {"train": {"batch_size": "four"}}}))
    result = run_cli("train", "--index", corpus.directory, "--out", run, "--resume", "--quiet")
    message = one_line_error(result)
    assert str(run / "config.json") in message and "batch_size" in message


@pytest.mark.parametrize("resume", [False, True])
def test_folder_that_is_not_a_run_is_left_alone(corpus, tmp_path, resume):  # noqa: F811
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text('{"architectures": ["GPT2"]}')
    (out / "loss.png").write_text("precious")
    args = ["train", "--index", corpus.directory, "--out", out, "--max-steps", "1", "--quiet"]
    result = run_cli(*args, *(["--resume"] if resume else []))
    assert "choose another --out" in one_line_error(result)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "loss.png"]
    assert (out / "config.json").read_text() == '{"architectures": ["GPT2"]}'
    assert (out / "loss.png").read_text() == "precious"


def test_latest_json_may_name_only_the_runs_own_checkpoints(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    elsewhere = tmp_path / "elsewhere" / CKPT
    shutil.copytree(run / CKPT, elsewhere)
    (run / "ckpt-00000009").symlink_to(elsewhere)
    pointers = [f"../elsewhere/{CKPT}", str(elsewhere), f"{CKPT}/../../elsewhere/{CKPT}"]
    for name in [*pointers, "ckpt-00000009", "state.json", "."]:
        (run / "latest.json").write_text(json.dumps({"checkpoint": name, "step": 4}))
        with pytest.raises(ValueError, match="latest.json"):
            checkpoint.latest(run)
    (run / "latest.json").write_text(json.dumps({"checkpoint": CKPT, "step": 4}))
    assert checkpoint.latest(run) == run / CKPT


def test_zero_checkpoint_interval_is_refused(corpus, tmp_path):  # noqa: F811
    config = tmp_path / "tiny.toml"
    config.write_text(TINY.replace("checkpoint_every = 8", "checkpoint_every = 0"))
    args = ["--index", corpus.directory, "--out", tmp_path / "run", "--config", config]
    result = run_cli("train", *args, "--quiet")
    assert "checkpoint_every must be at least 1" in one_line_error(result)


def test_latest_json_outside_the_run_is_refused_by_the_cli(corpus, finished_run, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    shutil.copytree(run / CKPT, tmp_path / "elsewhere" / CKPT)
    (run / "latest.json").write_text(json.dumps({"checkpoint": f"../elsewhere/{CKPT}"}))
    result = run_cli("train", "--index", corpus.directory, "--out", run, "--resume", "--quiet")
    assert str(run / "latest.json") in one_line_error(result)


def test_a_run_being_written_is_not_resumed_beside_it(corpus, finished_run, tmp_path):  # noqa: F811
    """While one process holds the run's lock (a training run still going), a second
    ``--resume`` of the run stops with one line naming that process, and changes nothing;
    once the lock is free, the resume goes on."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    args = ["train", "--index", corpus.directory, "--out", run, "--resume", "--max-steps", "5"]
    with folder_held(run) as holder:
        message = one_line_error(run_cli(*args, "--quiet"))
        assert f"{run} is in use by a test's holder (pid {holder} on" in message
        held = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
        assert held.pop(checkpoint.LOCK).startswith(b"a test's holder (pid")
        assert held == {k: v for k, v in before.items() if k != checkpoint.LOCK}
    resumed = run_cli(*args, "--quiet")
    assert resumed.returncode == 0, resumed.stderr


def test_a_metrics_line_cut_short_by_a_kill_is_dropped_on_resume(corpus, finished_run, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 4.')  # the process died inside this write
    args = ["train", "--index", corpus.directory, "--out", run, "--resume", "--max-steps", "6"]
    resumed = run_cli(*args, "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps[-1] == 6


def test_a_full_disk_while_saving_a_checkpoint_is_one_line_and_keeps_the_last(tmp_path):
    """The save that does not fit is removed, the previous checkpoint stays the latest, and the
    error says so in one line."""
    import torch
    from test_faults_build import Tmpfs

    disk = Tmpfs(tmp_path / "disk", 1 << 20)
    try:
        small, large = torch.nn.Linear(8, 8), torch.nn.Linear(1024, 512)
        state = {"config": {}, "index": {}, "tokens": 0, "wall_s": 0.0}
        checkpoint.save(disk.path, 1, small, torch.optim.SGD(small.parameters()), state)
        with pytest.raises(ValueError) as failed:
            checkpoint.save(disk.path, 2, large, torch.optim.SGD(large.parameters()), state)
        message = str(failed.value)
        assert "\n" not in message and "cannot save checkpoint ckpt-00000002" in message
        assert "ckpt-00000001 is intact" in message and "--resume" in message
        assert checkpoint.latest(disk.path).name == "ckpt-00000001"
        assert sorted(p.name for p in disk.path.iterdir()) == ["ckpt-00000001", "latest.json"]
        checkpoint.load(disk.path / "ckpt-00000001")
    finally:
        disk.unmount()
