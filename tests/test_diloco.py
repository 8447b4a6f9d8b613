"""DiLoCo on torchft: real worker processes and a real Lighthouse on 127.0.0.1, the exchanges'
wire formats and the recovery transport, against plain references."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import build_docs, cli_here, random_documents
from test_cli import ENV, run_cli
from test_distributed import CONFIG, final_weights, reference_step, torchrun, torchrun_env

os.environ.setdefault("RUST_LOG", "error")  # torchft's Rust side: no note of every quorum
pytest.importorskip("torchft", reason="mode diloco runs on torchft (pip install 'teralm[ft]')")

from teralm.model import Transformer  # noqa: E402
from teralm.train.compression import DCTMessage, DCTTopK, ShardedSignMean, SignMessage  # noqa: E402
from teralm.train.config import RunConfig  # noqa: E402
from teralm.train.data import FragmentSampler  # noqa: E402
from teralm.train.diloco import DCTExchange, lighthouse_server  # noqa: E402
from teralm.train.distributed import Traffic  # noqa: E402
from teralm.train.ft_transport import SafetensorsTransport, decode_state, encode_state  # noqa: E402
from teralm.train.optim import make_optimizer  # noqa: E402

CHECK_BYTES = 16  # a round's digest check between two workers: 2 fp64 values, all-reduced
DIGEST = re.compile(r"worker (\d+): (\d+) rounds, [\d,]+ bytes sent; global weights sha256 (\w+)")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(11)
    docs = random_documents(rng, 40, alphabet="abcd", max_len=200)
    return build_docs(tmp_path_factory.mktemp("corpus"), docs)


@pytest.fixture
def lighthouse():
    """A Lighthouse that forms a quorum of whoever is up."""
    with lighthouse_server("127.0.0.1:0", min_replicas=1, join_timeout_s=5) as url:
        yield url


@pytest.fixture
def pair():
    """A Lighthouse that waits for two workers: rounds in step however the processes start."""
    with lighthouse_server("127.0.0.1:0", min_replicas=2, join_timeout_s=5) as url:
        yield url


def worker(corpus, config: Path, run: Path, url: str, replica: int, *flags) -> subprocess.Popen:
    """``teralm train --mode diloco`` worker ``replica`` of the run, against ``url``."""
    command = [
        sys.executable, "-m", "teralm.cli", "train", "--index", corpus.directory, "--out", run,
        "--config", config, "--mode", "diloco", "--lighthouse", url, "--replica-id", replica,
        "--outer-timeout", 30, *flags,
    ]  # fmt: skip
    return subprocess.Popen(
        list(map(str, command)), env=torchrun_env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def finished(workers: list[subprocess.Popen], timeout: float = 240) -> list[str]:
    """Each worker's stderr once all have exited 0 (within ``timeout`` seconds, or fail)."""
    errors = []
    for w in workers:
        _, err = w.communicate(timeout=timeout)
        assert w.returncode == 0, err
        errors.append(err)
    return errors


def digests(errors: list[str]) -> set[str]:
    """The global weights' sha256 each worker reported at its end."""
    return {DIGEST.search(err).group(3) for err in errors}


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def wait_for_records(run: Path, done, alive, what: str, stall_s: float = 120.0) -> list[dict]:
    """Poll the run's metrics until ``done(records)``; fail as ``what`` when ``alive()`` turns
    false or no new record has come for ``stall_s`` seconds (a stall, not a deadline: a busy
    machine only takes longer)."""
    seen, since = -1, time.monotonic()
    while True:
        rows = records(run) if (run / "metrics.jsonl").exists() else []
        if done(rows):
            return rows
        if len(rows) != seen:
            seen, since = len(rows), time.monotonic()
        assert alive() and time.monotonic() - since < stall_s, what
        time.sleep(0.05)


def config_file(tmp_path: Path, name: str = "run.toml", **train) -> Path:
    text = CONFIG
    for key, value in train.items():
        line = f"{key} = {value}"
        if re.search(rf"^{key} = .*$", text, flags=re.M):
            text = re.sub(rf"^{key} = .*$", line, text, flags=re.M)
        else:
            text += line + "\n"
    path = tmp_path / name
    path.write_text(text)
    return path


def averaging_reference(ix, config: RunConfig, workers: int) -> dict[str, torch.Tensor]:
    """DiLoCo with one inner step a round, outer SGD at learning rate 1 without momentum,
    written out plainly: every step each worker steps its own AdamW from the global weights on
    its own fragments, and the global weights become the mean of the workers'."""
    cfg = config.train
    config.model.vocab_size, config.model.max_match = ix.vocab_size, ix.max_match
    models, optimizers, samplers = [], [], []
    for r in range(workers):
        torch.manual_seed(cfg.seed)
        models.append(Transformer(config.model))
        optimizers.append(make_optimizer(models[-1], cfg))
        samplers.append(FragmentSampler(ix, cfg, infgram=True, share=(r, workers)))
    shared = {k: v.detach().clone() for k, v in models[0].named_parameters()}
    for step in range(cfg.max_steps):
        for model, optimizer, sampler in zip(models, optimizers, samplers):
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(shared[name])
            reference_step(model, optimizer, cfg, step, [sampler.batch(step)])
        shared = {
            name: torch.stack([dict(m.named_parameters())[name].detach() for m in models]).mean(0)
            for name in shared
        }
    return shared


def test_one_step_rounds_average_the_workers_steps_and_track_synchronous_training(
    corpus, tmp_path, pair
):
    """With one inner step a round and outer SGD at learning rate 1 without momentum, a round
    makes the global weights the mean of the workers' (the plain reference, to fp32 rounding),
    and both workers end with the same weights. Synchronous data-parallel AdamW (one step on
    the mean gradient, not the mean of each worker's Adam step) stays close for a few steps."""
    config = config_file(tmp_path)
    run = tmp_path / "run"
    flags = ["--replicas", 2, "--inner-steps", 1, "--outer-lr", 1, "--outer-momentum", 0]
    errors = finished([worker(corpus, config, run, pair, k, *flags) for k in (0, 1)])
    assert len(digests(errors)) == 1
    import tomllib

    want = averaging_reference(corpus, RunConfig.from_dict(tomllib.loads(config.read_text())), 2)
    got = final_weights(run)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=2e-6)
    numel = sum(v.numel() for v in want.values())
    assert [r["sent_bytes"] for r in records(run)] == [4 * (numel + 1) + CHECK_BYTES] * 4
    sync = torchrun(2, "train", "--index", corpus.directory, "--out", tmp_path / "sync",
                    "--config", config, "--quiet")  # fmt: skip
    assert sync.returncode == 0, sync.stderr
    for name, value in final_weights(tmp_path / "sync").items():
        if name in want:
            assert (value - got[name]).abs().max() < 4 * 4 * 3e-3, name  # 4 steps of lr 3e-3


def test_a_killed_worker_leaves_the_others_training_and_rejoins_with_their_weights(
    corpus, tmp_path, lighthouse
):
    """Three workers; one is killed with SIGKILL mid-run. The other two go on in rounds of two
    (the loss still falls; nothing waits past the 30 s outer timeout), the killed worker
    started again with --resume takes the current state from a live peer, and all three end
    with the same global weights."""
    config = config_file(tmp_path, max_steps=600, log_every=5, checkpoint_every=50)
    run = tmp_path / "run"
    flags = ["--replicas", 3, "--inner-steps", 5]
    workers = [worker(corpus, config, run, lighthouse, k, *flags) for k in range(3)]
    wait_for_records(
        run, lambda rows: len(rows) >= 12, lambda: workers[2].poll() is None, "no rounds"
    )
    os.kill(workers[2].pid, signal.SIGKILL)
    workers[2].wait()
    killed_at = records(run)[-1]["step"]
    assert killed_at < 600, "the run finished before the kill"
    wait_for_records(
        run, lambda rows: any(r["workers"] == 2 for r in rows), lambda: True,
        "the others stopped after the kill",
    )  # fmt: skip
    workers[2] = worker(corpus, config, run, lighthouse, 2, *flags, "--resume")
    errors = finished(workers)
    assert len(digests(errors)) == 1, errors
    seen = [r["workers"] for r in records(run)]
    assert 2 in seen and seen[-1] == 3
    steps = [r["step"] for r in records(run)]
    assert steps == sorted(set(steps)) and steps[-1] == 600
    losses = [r["loss"] for r in records(run)]
    assert np.mean(losses[-10:]) < np.mean(losses[:10])


@pytest.mark.parametrize(
    "compress, delay",
    [("onebit", 0.0), ("demo", 0.0), ("none", 0.5)],
    ids=["onebit", "demo", "async"],
)
def test_compressed_and_asynchronous_rounds_train_and_agree(
    corpus, tmp_path, pair, compress, delay
):
    """1-bit and DCT pseudo-gradients, and TScale's asynchronous rounds: the loss falls, both
    workers end with the same weights, and a round sends one message of the size the wire
    format gives (an all-gather of two messages sends one; 1-bit sends half its shards' messages
    in an all-to-all, then its reply)."""
    config = config_file(
        tmp_path, max_steps=60, log_every=5, checkpoint_every=60, demo_chunk=8, demo_topk=4
    )
    run = tmp_path / "run"
    flags = [
        "--replicas", 2, "--inner-steps", 10, "--outer-compress", compress, "--outer-async", delay,
    ]  # fmt: skip
    errors = finished([worker(corpus, config, run, pair, k, *flags) for k in (0, 1)])
    assert len(digests(errors)) == 1
    shapes = [p.shape for p in shaped_parameters(corpus, config)]
    numel = sum(math.prod(s) for s in shapes)
    message = {
        "onebit": 4 + 2 * SignMessage(math.ceil(numel / 2 / 256) * 256, 256).nbytes,
        "demo": 4 + DCTMessage(DCTTopK(8, 4), shapes).nbytes,
        "none": 4 * (numel + 1),
    }[compress]
    sent = [r["sent_bytes"] for r in records(run)]
    assert sent == [0, message + CHECK_BYTES] * 6  # a record every 5 steps, a round every 10
    losses = [r["loss"] for r in records(run)]
    assert np.mean(losses[-3:]) < np.mean(losses[:3])


def shaped_parameters(ix, config: Path) -> list[torch.Tensor]:
    import tomllib

    model_config = RunConfig.from_dict(tomllib.loads(config.read_text())).model
    model_config.vocab_size, model_config.max_match = ix.vocab_size, ix.max_match
    return list(Transformer(model_config).parameters())


def test_the_dct_exchange_sends_what_its_wire_format_carries_and_averages_by_weight():
    """What a worker's DCT message stands for is what the sync exchange's wire format decodes;
    the mean of several messages is weighted by their inner steps (a worker with none counts
    for nothing)."""
    torch.manual_seed(3)
    like = [torch.randn(12, 20), torch.randn(20), torch.randn(5, 3, 4)]
    exchange = DCTExchange(None, None, Traffic(), 4, 3)
    messages, sent = [], []
    for _ in range(3):
        corrected = [torch.randn_like(x) for x in like]
        body, stands_for = exchange.encode(corrected)
        assert all(torch.equal(a, b) for a, b in zip(exchange.decode(body, like), stands_for))
        for c, s in zip(corrected, stands_for):
            index, values = exchange.compression.encode(c)
            q, scale = DCTMessage.quantize(values)
            want = exchange.compression.decode(index, DCTMessage.dequantize(q, scale), c.shape)
            assert torch.equal(s, want)
        messages.append(body)
        sent.append(stands_for)
    weights = [2.0, 0.0, 6.0]
    mean = exchange.average(messages, weights, like)
    for i, m in enumerate(mean):
        torch.testing.assert_close(m, (2 * sent[0][i] + 6 * sent[2][i]) / 8)
    assert exchange.average(messages, [0.0, 0.0, 0.0], like) is None


def test_the_two_stage_sign_mean_weights_its_workers_and_keeps_what_replies_miss():
    """ShardedSignMean by hand for 3 workers of 45 values in blocks of 8 (shards of 16, 16 and
    13 values): each shard's message is the 1-bit message of that slice; a reply is the 1-bit
    message of the weighted mean of the shard's messages plus the residual, and its residual
    is what that reply missed."""
    torch.manual_seed(5)
    mean = ShardedSignMean(45, 3, 8)
    assert mean.length == 16 and mean.real == [16, 16, 13]
    wire = SignMessage(16, 8)

    def ones(x):
        return wire.decode(wire.encode(x), x.numel())

    vectors = [torch.randn(45) for _ in range(3)]
    outgoing = [mean.encode(v) for v in vectors]
    for v, messages in zip(vectors, outgoing):
        assert torch.equal(
            mean.decode(messages), torch.cat([ones(v[a : a + 16]) for a in (0, 16, 32)])
        )
    weights, replies = [2.0, 0.0, 6.0], []
    for shard, start in enumerate((0, 16, 32)):
        k = mean.real[shard]
        residual = torch.zeros(16)
        residual[:k] = torch.randn(k)
        incoming = torch.stack([messages[shard] for messages in outgoing])
        reply, missed = mean.reply(incoming, weights, shard, residual)
        want = (
            residual[:k]
            + (2 * ones(vectors[0][start : start + k]) + 6 * ones(vectors[2][start : start + k]))
            / 8
        )
        torch.testing.assert_close(wire.decode(reply, k), ones(want))
        torch.testing.assert_close(missed[:k], want - ones(want))
        assert not missed[k:].any()
        replies.append(reply)
    assert mean.decode(replies).shape == (45,)


def test_recovery_state_travels_as_safetensors_and_json():
    """A worker's state (tensors, an AdamW state, steps) arrives whole over HTTP; garbage is
    refused rather than unpickled."""
    from datetime import timedelta

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    state = {
        "user": {"weights": dict(model.state_dict()), "step": 7, "betas": (0.9, 0.95)},
        "optimizer": optimizer.state_dict()["param_groups"],
        "torchft": {"step": 3, "batches_committed": 6, "note": None},
    }
    back = decode_state(encode_state(state))
    assert torch.equal(back["user"]["weights"]["weight"], model.weight.detach())
    assert back["user"]["step"] == 7 and back["user"]["betas"] == [0.9, 0.95]
    assert back["torchft"] == state["torchft"] and back["optimizer"][0]["lr"] == 1e-3
    with pytest.raises(ValueError, match="not a teralm state message"):
        decode_state(b"\x80\x04not safetensors")
    sender = SafetensorsTransport("127.0.0.1", timedelta(seconds=5))
    receiver = SafetensorsTransport("127.0.0.1", timedelta(seconds=5))
    try:
        sender.send_checkpoint([1], 4, state, timedelta(seconds=5))
        got = receiver.recv_checkpoint(0, sender.metadata(), 4, timedelta(seconds=5))
        assert torch.equal(got["user"]["weights"]["bias"], model.bias.detach())
        with pytest.raises(OSError):  # a step it does not hold: an HTTP error, not a hang
            receiver.recv_checkpoint(0, sender.metadata(), 5, timedelta(seconds=2))
    finally:
        sender.shutdown()
        receiver.shutdown()


def test_every_worker_started_by_lighthouse_auto_names_the_global_weights(corpus, tmp_path):
    """``--lighthouse auto`` starts the workers (all but the first quiet); each one ends with
    the sha256 of the global weights, and they agree."""
    command = [
        sys.executable, "-m", "teralm.cli", "train", "--index", corpus.directory, "--out",
        tmp_path / "run", "--config", config_file(tmp_path), "--mode", "diloco", "--replicas", 2,
        "--lighthouse", "auto", "--outer-timeout", 30,
    ]  # fmt: skip
    done = subprocess.run(
        list(map(str, command)), env=torchrun_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    lines = DIGEST.findall(done.stderr)
    assert sorted(int(w) for w, _, _ in lines) == [0, 1], done.stderr
    assert len({sha for _, _, sha in lines}) == 1


def test_a_lighthouse_that_goes_away_ends_the_worker_with_a_clear_error(corpus, tmp_path):
    """A worker whose lighthouse stops answering exits with a message naming it once the outer
    timeout passes; one started with no lighthouse at all says it cannot reach it."""
    from test_distributed import free_port

    port = free_port()
    house = subprocess.Popen(
        [sys.executable, "-m", "teralm.cli", "lighthouse", "--bind", f"127.0.0.1:{port}"],
        stdout=subprocess.PIPE, text=True, env=ENV,
    )  # fmt: skip
    assert "lighthouse at http://127.0.0.1" in house.stdout.readline()
    url = f"http://127.0.0.1:{port}"
    config = config_file(tmp_path, max_steps=100000, log_every=5, checkpoint_every=100000)
    run = tmp_path / "run"
    alone = worker(corpus, config, run, url, 0, "--inner-steps", 5, "--outer-timeout", 5)
    wait_for_records(run, lambda rows: len(rows) > 0, lambda: alone.poll() is None, "no round")
    house.kill()
    house.wait()
    _, err = alone.communicate(timeout=60)
    assert alone.returncode == 1
    assert f"no quorum from the lighthouse at {url} within 5 s" in err
    gone = run_cli(
        "train", "--index", corpus.directory, "--out", tmp_path / "other", "--config", config,
        "--mode", "diloco", "--lighthouse", url, "--outer-timeout", 3,
    )  # fmt: skip
    assert gone.returncode == 1 and f"cannot reach the lighthouse at {url}" in gone.stderr


def test_a_stopped_job_resumes_from_the_main_workers_checkpoint(corpus, tmp_path, pair):
    """Both workers stop at a checkpoint; started again with --resume and a later max_steps,
    they go on from its global weights and outer state, and the metrics continue without
    repeating a step."""
    config = config_file(tmp_path, max_steps=20, log_every=5, checkpoint_every=10)
    run = tmp_path / "run"
    flags = ["--replicas", 2, "--inner-steps", 5]
    finished([worker(corpus, config, run, pair, k, *flags) for k in (0, 1)])
    again = [worker(corpus, config, run, pair, k, *flags, "--resume", "--max-steps", 40) for k in (0, 1)]  # fmt: skip
    errors = finished(again)
    assert len(digests(errors)) == 1
    assert [r["step"] for r in records(run)] == [5, 10, 15, 20, 25, 30, 35, 40]
    assert json.loads((run / "latest.json").read_text())["step"] == 40


def test_workers_that_reached_a_step_apart_take_the_main_workers_weights_when_they_meet(
    corpus, tmp_path, pair
):
    """Two workers train to the same step in quorums of their own (other seeds, other runs),
    then resume against one Lighthouse: torchft sees no step to heal, the digest check sees
    the weights differ, the second takes the main's, and both end with the same weights."""
    flags = ["--inner-steps", 5, "--replicas", 2]
    runs, configs = [tmp_path / "a", tmp_path / "b"], []
    with contextlib.ExitStack() as stack:
        apart = []
        for k, run in enumerate(runs):
            run.mkdir()
            configs.append(config_file(run, "run.toml", max_steps=10, checkpoint_every=10, seed=k))
            url = stack.enter_context(lighthouse_server("127.0.0.1:0", 1, join_timeout_s=1))
            apart.append(worker(corpus, configs[k], run / "out", url, k, *flags))
        assert len(digests(finished(apart))) == 2
    errors = finished([
        worker(corpus, configs[k], run / "out", pair, k, *flags, "--resume", "--max-steps", 20)
        for k, run in enumerate(runs)
    ])  # fmt: skip
    assert len(digests(errors)) == 1
    assert ["took the main worker's, at step 15" in err for err in errors] == [False, True]


def test_diloco_settings_that_cannot_work_are_refused(corpus, tmp_path):
    config = config_file(tmp_path)
    args = ["train", "--index", corpus.directory, "--config", config, "--quiet"]
    cases = {
        ("--lighthouse", "http://127.0.0.1:9"): "--lighthouse belongs to mode diloco",
        ("--mode", "diloco", "--outer-async", 0.7): "outer_async must be 0",
        ("--mode", "diloco", "--replicas", 4): "not a multiple of the 4 replicas",
        (
            "--mode",
            "diloco",
            "--inner-steps",
            3,
            "--checkpoint-every",
            10,
        ): "multiple of inner_steps",
        ("--mode", "diloco", "--comm", "demo"): "leave comm at allreduce",
    }
    for i, (flags, message) in enumerate(cases.items()):
        out = cli_here(*args, "--out", tmp_path / f"run{i}", *flags)
        assert out.returncode == 1 and message in out.stderr, (flags, out.stderr)
    under = torchrun(2, *args, "--out", tmp_path / "torchrun", "--mode", "diloco",
                     "--lighthouse", "http://127.0.0.1:9")  # fmt: skip
    assert under.returncode != 0 and "not under torchrun" in under.stderr
