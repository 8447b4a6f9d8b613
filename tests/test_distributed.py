"""Data-parallel training: real processes under torchrun (gloo on 127.0.0.1), the exchanges'
compression against plain references, and bad settings."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import scipy.fft
import torch
from conftest import build_docs, cli_here, random_documents
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from test_cli import ENV, run_cli

from teralm.infer.precision import autocast
from teralm.kernels.fp8 import E4M3
from teralm.model import Transformer
from teralm.model.transformer import index_lm_loss
from teralm.train.compression import (
    DCTMessage,
    DCTTopK,
    dct_matrix,
    pack_bits,
    pack_signs,
    unpack_bits,
    unpack_signs,
)
from teralm.train.config import RunConfig
from teralm.train.data import FragmentSampler
from teralm.train.distributed import OneBit, OneBitMean, Traffic, World
from teralm.train.loop import learning_rate
from teralm.train.optim import DeMo, OneBitAdam, make_optimizer

CONFIG = """
[model]
n_layer = 1
n_head = 2
d_model = 16
max_seq_len = 16
precision = "fp32"
[train]
batch_size = 6
seq_len = 16
max_steps = 4
warmup_steps = 2
checkpoint_every = 100
log_every = 1
holdout_every = 5
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(5)
    docs = random_documents(rng, 40, alphabet="abcd", max_len=200)
    return build_docs(tmp_path_factory.mktemp("corpus"), docs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(processes: int, *args) -> list[str]:
    """``torchrun --nproc-per-node N -m teralm.cli ARGS`` on 127.0.0.1."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "-m", "teralm.cli", *map(str, args),
    ]  # fmt: skip


def torchrun_env() -> dict[str, str]:
    return {**ENV, "OMP_NUM_THREADS": "1"}


def torchrun(processes: int, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = torchrun_command(processes, *args)
    return subprocess.run(cmd, capture_output=True, text=True, env=torchrun_env(), timeout=timeout)


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    latest = json.loads((run / "latest.json").read_text())["checkpoint"]
    return load_file(run / latest / "model.safetensors")


def union_reference(ix, config: RunConfig, world: int) -> dict[str, torch.Tensor]:
    """One process training on the union of the ``world`` ranks' batches, written out plainly."""
    cfg = config.train
    config.model.vocab_size, config.model.max_match = ix.vocab_size, ix.max_match
    torch.manual_seed(cfg.seed)
    model = Transformer(config.model)
    optimizer = make_optimizer(model, cfg)
    samplers = [FragmentSampler(ix, cfg, infgram=True, share=(r, world)) for r in range(world)]
    for step in range(cfg.max_steps):
        reference_step(model, optimizer, cfg, step, [s.batch(step) for s in samplers])
    return {k: v.detach() for k, v in model.state_dict().items()}


def reference_step(model, optimizer, cfg, step: int, parts: list) -> None:
    """One AdamW step of ``model`` on the union of the batches ``parts``, written out plainly."""
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(cfg, step)
    tokens, next_token, match_len, targets, total, hits = (
        torch.cat([getattr(b, name) for b in parts])
        for name in ("tokens", "next_token", "match_len", "targets", "infgram_total", "infgram_hits")
    )  # fmt: skip
    with autocast(torch.device("cpu"), "fp32"):
        logits, gate = model(tokens, next_token, match_len, with_gate=True)
    mixed, own = index_lm_loss(logits, model.gate_logit(gate, total), targets, total, hits)
    (mixed + cfg.own_loss_weight * own).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("processes, comm", [(2, "allreduce"), (3, "allreduce"), (2, "powersgd")])
def test_allreduce_equals_one_process_on_the_union_of_batches(corpus, tmp_path, processes, comm):
    """After k steps on N processes the weights are those of one process stepping on all N
    ranks' fragments at once; the metrics count the all-reduce's bytes. PowerSGD's warm-up
    steps are DistributedDataParallel's plain all-reduce, so they give the same weights."""
    config = tmp_path / "run.toml"
    config.write_text(CONFIG)
    run = tmp_path / "run"
    out = torchrun(
        processes, "train", "--index", corpus.directory, "--out", run, "--config", config,
        "--quiet", "--comm", comm, "--powersgd-warmup", 100,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    got = final_weights(run)
    import tomllib

    want = union_reference(corpus, RunConfig.from_dict(tomllib.loads(CONFIG)), processes)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.allclose(got[name], want[name], atol=2e-5, rtol=1e-4), name
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    numel = sum(v.numel() for k, v in want.items() if not k.startswith("rope"))
    ring = 2 * (processes - 1) * 4 * numel // processes
    assert [r["sent_bytes"] for r in records] == [ring] * len(records)


def test_dct_is_scipys_orthonormal_dct_ii():
    x = torch.randn(5, 12, dtype=torch.float64)
    want = scipy.fft.dct(x.numpy(), type=2, norm="ortho", axis=-1)
    assert np.allclose((x @ dct_matrix(12).T).numpy(), want)
    compression = DCTTopK(chunk=4, k=16)
    m = torch.randn(8, 12, dtype=torch.float64)
    tiles = compression.transform(m).view(-1, 4, 4)
    assert np.allclose(tiles[1].numpy(), scipy.fft.dctn(m[:4, 4:8].numpy(), norm="ortho"))


@pytest.mark.parametrize("shape", [(8, 12), (10, 7), (12,), (13,), (3, 2, 5)])
def test_dct_top_k_keeps_the_largest_components_and_the_rest_is_the_residual(shape):
    """``decode(encode(x))`` holds exactly each chunk's k largest DCT components (all of them:
    ``x`` itself, edges zero-padded); ``x`` minus it is what was not sent."""
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64)
    everything = DCTTopK(chunk=4, k=16)
    assert torch.allclose(everything.decode(*everything.encode(x), x.shape), x)
    compression = DCTTopK(chunk=4, k=3)
    index, values = compression.encode(x)
    sent = compression.decode(index, values, x.shape)
    coefficients = compression.transform(x)
    for row in range(coefficients.shape[0]):  # brute force: sort each chunk's magnitudes
        top = torch.argsort(coefficients[row].abs(), descending=True)[:3]
        assert set(top.tolist()) == set(index[row].long().tolist())
    if all(n % 4 == 0 for n in (shape[0], np.prod(shape[1:]))):  # whole chunks: no padding
        residual = compression.transform(x - sent)
        kept = torch.zeros_like(residual, dtype=torch.bool).scatter_(1, index.long(), True)
        assert torch.allclose(residual[kept], torch.zeros(kept.sum(), dtype=torch.float64))
        assert torch.allclose(residual[~kept], coefficients[~kept])


@pytest.mark.parametrize("bits", [1, 5, 8, 12, 20])
def test_bit_packing_round_trips_and_is_numpys_packbits(bits):
    rng = np.random.default_rng(bits)
    values = rng.integers(0, 2**bits, size=37)
    packed = pack_bits(torch.from_numpy(values), bits)
    stream = ((values[:, None] >> np.arange(bits - 1, -1, -1)) & 1).astype(np.uint8).reshape(-1)
    assert packed.numpy().tobytes() == np.packbits(stream).tobytes()
    assert unpack_bits(packed, bits, 37).tolist() == values.tolist()


def dct_message_of(compression: DCTTopK, tensors: list[torch.Tensor]):
    """The DeMo message of ``tensors``, its encoder, and each tensor's sent components as
    ``sent_components`` writes them out."""
    message_of = DCTMessage(compression, [t.shape for t in tensors])
    parts, want = [], []
    for t in tensors:
        index, values = compression.encode(t)
        q, scale = DCTMessage.quantize(values)
        parts.append((index, q, scale))
        want.append(compression.scatter(*sent_components(compression, t), t.shape))
    return message_of.encode(parts), message_of, want


def test_dct_message_carries_each_tensors_components_in_e4m3():
    """One message for several tensors, decoded to the same components with e4m3 values, in
    the size that Elias-Fano coding of the indices gives."""
    torch.manual_seed(4)
    tensors = [torch.randn(16, 24), torch.randn(10), torch.randn(9, 3, 2)]
    message, message_of, want = dct_message_of(DCTTopK(chunk=8, k=5), tensors)
    assert message.dtype == torch.uint8 and message.numel() == message_of.nbytes
    # 8 x 8 chunks (width 64, k 5): 3 low bits (64 // 5 = 12), high parts 0..7, so 5 + 8 unary
    # bits a chunk and 3 + 8-bit records. The vector's chunks (width 8): no low bits, 5 + 8
    # unary bits, 8-bit records. [16, 24]: 6 chunks -> ceil(78 / 8) + ceil(330 / 8) = 10 + 42;
    # [10]: 2 chunks -> 4 + 10; [9, 3, 2] as 16 x 8 padded: 2 chunks -> 4 + 14. Scales 3 x 4.
    assert message_of.nbytes == 12 + (10 + 42) + (4 + 10) + (4 + 14)
    for got, expected in zip(message_of.coefficients(message), want):
        assert torch.equal(got, expected)


@settings(max_examples=40, deadline=None)
@given(chunk=st.integers(1, 12), k=st.integers(1, 160), seed=st.integers(0, 2**16))
def test_dct_message_round_trips_any_chunk_and_k(chunk, k, seed):
    """Every chunk size (powers of two or not) and every k, up to all of a chunk."""
    torch.manual_seed(seed)
    tensors = [torch.randn(13, 7), torch.randn(11), torch.randn(2, 3, 5)]
    message, message_of, want = dct_message_of(DCTTopK(chunk=chunk, k=k), tensors)
    assert message.numel() == message_of.nbytes
    for got, expected in zip(message_of.coefficients(message), want):
        assert torch.equal(got, expected)


def test_dct_message_with_a_broken_index_code_is_refused():
    torch.manual_seed(5)
    message, message_of, _ = dct_message_of(DCTTopK(chunk=8, k=5), [torch.randn(16, 24)])
    message[4:14] = 0  # the unary vectors of the high parts: no index left
    with pytest.raises(ValueError, match="corrupt"):
        message_of.coefficients(message)


def test_one_bit_message_is_signs_and_block_means():
    """Each value decodes to its sign times the mean magnitude of its block; the residual is
    exactly what the message misses."""
    torch.manual_seed(1)
    x = torch.randn(2500)
    x[7] = 0.0  # zero counts as positive
    signs, scales = pack_signs(x, block=1024)
    assert signs.dtype == torch.uint8 and signs.numel() == 313 and scales.numel() == 3
    decoded = unpack_signs(signs, scales, 2500, 1024)
    for start in range(0, 2500, 1024):
        block = x[start : start + 1024].double()
        mean = block.abs().mean()
        want = torch.where(block >= 0, mean, -mean)
        assert torch.allclose(decoded[start : start + 1024].double(), want, atol=1e-6)


def test_one_bit_error_feedback_carries_what_was_not_sent():
    """A step's gradient becomes its 1-bit message; what the message missed is added to the
    next step's gradient before it is compressed."""
    torch.manual_seed(2)
    p = torch.nn.Parameter(torch.zeros(3000))
    exchange = OneBit(World(), block=1024)
    g1, g2 = torch.randn(3000), torch.randn(3000)
    p.grad = g1.clone()
    exchange.exchange([p])
    first = unpack_signs(*pack_signs(g1, 1024), 3000, 1024)
    assert torch.allclose(p.grad, first) and torch.allclose(exchange.mean.residual, g1 - first)
    p.grad = g2.clone()
    exchange.exchange([p])
    corrected = g2 + (g1 - first)
    second = unpack_signs(*pack_signs(corrected, 1024), 3000, 1024)
    assert torch.allclose(p.grad, second, atol=1e-6)
    assert torch.allclose(exchange.mean.residual, corrected - second, atol=1e-6)


def test_one_bit_adam_warms_up_as_adamw_then_agrees_on_1_bit_momentum():
    """For its warm-up steps 1-bit Adam is torch's AdamW; then its second moment stays as the
    warm-up left it, its momentum becomes the 1-bit mean of ``beta1 * m + (1 - beta1) * g``,
    and it steps by that momentum over the frozen second moment."""
    torch.manual_seed(4)
    shapes = [(30, 20), (45,)]
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    groups = lambda ps: [{"params": ps[:1], "weight_decay": 0.1}, {"params": ps[1:]}]  # noqa: E731
    lr, betas, block = 0.01, (0.9, 0.95), 64
    onebit = OneBitAdam(groups(ours), lr, betas, 3, OneBitMean(World(), block, Traffic()))
    adamw = torch.optim.AdamW(groups(theirs), lr, betas, weight_decay=0.0, foreach=False)
    for _ in range(3):
        assert onebit.warming_up()
        grads = [torch.randn(s) for s in shapes]
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        onebit.step()
        adamw.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert not onebit.warming_up()
    before = [p.detach().clone() for p in ours]
    frozen = [onebit.state[p]["exp_avg_sq"].clone() for p in ours]
    grads = [torch.randn(s) for s in shapes]
    local = torch.cat(
        [(0.9 * onebit.state[p]["exp_avg"] + 0.1 * g).reshape(-1) for p, g in zip(ours, grads)]
    )
    for p, g in zip(ours, grads):
        p.grad = g
    onebit.step()
    agreed = compressed_mean([local], block).split([p.numel() for p in ours])
    for p, old, v, m, decay in zip(ours, before, frozen, agreed, (0.1, 0.0)):
        assert torch.equal(onebit.state[p]["exp_avg_sq"], v)
        torch.testing.assert_close(onebit.state[p]["exp_avg"].reshape(-1), m)
        step = lr / (1 - 0.9**4) * m.view_as(p) / ((v / (1 - 0.95**3)).sqrt() + 1e-8)
        torch.testing.assert_close(p.detach(), old * (1 - lr * decay) - step)
    residual = onebit.mean.local_state()["residual"]
    torch.testing.assert_close(residual, local - ones(local, block))


@pytest.mark.parametrize("comm", ["onebit", "powersgd", "demo"])
def test_compressed_exchanges_train_on_two_processes(corpus, tmp_path, comm):
    """Loss falls, and a step sends a small fraction of what the all-reduce sends."""
    config = tmp_path / "run.toml"
    config.write_text(CONFIG.replace("max_steps = 4", "max_steps = 30"))
    run = tmp_path / "run"
    out = torchrun(
        2, "train", "--index", corpus.directory, "--out", run, "--config", config,
        "--comm", comm, "--demo-chunk", 8, "--demo-topk", 4, "--powersgd-rank", 1,
        "--powersgd-warmup", 5, "--onebit-warmup", 5, "--quiet",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert np.mean([r["loss"] for r in records[-5:]]) < np.mean([r["loss"] for r in records[:5]])
    numel = sum(v.numel() for k, v in final_weights(run).items())
    allreduce = 2 * (2 - 1) * 4 * numel // 2
    assert 0 < records[-1]["sent_bytes"] < allreduce / 4


def descendants(pid: int) -> list[int]:
    """The processes started by ``pid``, and by them, ... (Linux)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        found += map(int, children)
        todo += map(int, children)
    return found


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "comm",
    [  # DeMo's momentum is the most state a rank keeps; the others are as slow, so on demand
        pytest.param("onebit", marks=pytest.mark.slow),
        pytest.param("powersgd", marks=pytest.mark.slow),
        "demo",
    ],
)
def test_two_processes_killed_with_sigkill_resume_the_same_curve(corpus, tmp_path, comm):
    """A 2-process run killed by SIGKILL mid-run and resumed with --resume logs the same losses
    and ends with the same weights as one never interrupted: every rank's own state (1-bit
    residuals, PowerSGD's error feedback and factors, DeMo's momentum) is in the checkpoint."""
    steps = 300
    config = tmp_path / "run.toml"
    config.write_text(
        CONFIG.replace("max_steps = 4", f"max_steps = {steps}").replace(
            "checkpoint_every = 100", "checkpoint_every = 20"
        )
    )
    args = [
        "train", "--index", corpus.directory, "--config", config, "--comm", comm,
        "--demo-chunk", 8, "--demo-topk", 4, "--powersgd-rank", 1, "--powersgd-warmup", 5,
        "--quiet",
    ]  # fmt: skip
    whole = torchrun(2, *args, "--out", tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr
    run = tmp_path / "killed"
    launcher = subprocess.Popen(
        torchrun_command(2, *args, "--out", run), env=torchrun_env(), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    pointer = run / "latest.json"
    deadline = time.monotonic() + 120
    while not (pointer.exists() and json.loads(pointer.read_text())["step"] >= 40):
        assert launcher.poll() is None and time.monotonic() < deadline, "the run ended early"
        time.sleep(0.01)
    for pid in [launcher.pid, *descendants(launcher.pid)]:  # torchrun and its workers at once
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    launcher.wait()
    killed_at = json.loads(pointer.read_text())["step"]
    assert killed_at < steps, "the run finished before it was killed"
    resumed = torchrun(2, *args, "--out", run, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    if comm == "powersgd":
        # its first step after the resume holds its factors at other offsets of memory (DDP's
        # first order of parameters), so BLAS rounds their products differently in the last
        # bits; 260 steps of this tiny model grow that to about 3e-5 of the loss
        assert np.allclose(losses(run), losses(tmp_path / "whole"), rtol=1e-3, atol=0)
        return
    assert losses(run) == losses(tmp_path / "whole")
    want, got = final_weights(tmp_path / "whole"), final_weights(run)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_two_machines_with_their_own_disks_train_one_run_written_by_rank_0(corpus, tmp_path):
    """Two torchrun nodes on 127.0.0.1, each with its own --out (as two hosts without a shared
    disk have): both finish, and only rank 0's folder holds the run."""
    config = tmp_path / "run.toml"
    config.write_text(CONFIG)
    port, nodes = free_port(), []
    for rank, out in enumerate((tmp_path / "main", tmp_path / "peer")):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
            str(rank), "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
            str(port), "-m", "teralm.cli", "train", "--index", str(corpus.directory), "--out",
            str(out), "--config", str(config), "--quiet",
        ]  # fmt: skip
        nodes.append(
            subprocess.Popen(command, env=torchrun_env(), stderr=subprocess.PIPE, text=True)
        )
    for node in nodes:
        assert node.wait(timeout=300) == 0, node.stderr.read()
    assert len((tmp_path / "main" / "metrics.jsonl").read_text().splitlines()) == 4
    peer = tmp_path / "peer"
    assert not peer.exists() or not any(peer.iterdir()), list(peer.iterdir())


def test_bad_settings_get_a_clear_error(corpus, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(CONFIG)
    args = ["train", "--index", corpus.directory, "--config", config, "--quiet"]
    odd = torchrun(4, *args, "--out", tmp_path / "odd")
    assert odd.returncode != 0
    assert "batch_size 6 (the global batch) is not a multiple of the 4 processes" in odd.stderr
    zero = cli_here(*args, "--out", tmp_path / "zero", "--comm", "demo", "--demo-chunk", 0)
    assert zero.returncode == 1 and "demo_chunk and demo_topk must be at least 1" in zero.stderr
    early = cli_here(
        *args, "--out", tmp_path / "early", "--comm", "powersgd", "--powersgd-warmup", 1
    )
    assert early.returncode == 1 and "powersgd_warmup at least 2" in early.stderr
    frozen = cli_here(*args, "--out", tmp_path / "frozen", "--comm", "onebit", "--onebit-warmup", 0)
    assert frozen.returncode == 1 and "onebit_warmup must be at least 1" in frozen.stderr
    galore = cli_here(
        *args, "--out", tmp_path / "galore", "--comm", "onebit", "--optimizer", "galore"
    )
    assert galore.returncode == 1 and "or onebit_target gradient" in galore.stderr
    unknown = cli_here(*args, "--out", tmp_path / "unknown", "--comm", "carrier-pigeon")
    assert unknown.returncode == 2 and "invalid choice: 'carrier-pigeon'" in unknown.stderr
    names = ("zero", "early", "frozen", "galore", "unknown")
    assert not any((tmp_path / name).exists() for name in names)


@pytest.mark.parametrize(
    "comm",
    ["demo", pytest.param("onebit", marks=pytest.mark.slow), pytest.param("powersgd", marks=pytest.mark.slow)],
)  # fmt: skip
def test_one_process_runs_the_exchanges_code_paths(corpus, tmp_path, comm):
    """World size 1 exercises the exchanges (DeMo's sign step, 1-bit error feedback, PowerSGD
    on a process group of one) too."""
    config = tmp_path / "run.toml"
    config.write_text(CONFIG)
    out = run_cli(
        "train", "--index", corpus.directory, "--out", tmp_path / comm, "--config", config,
        "--comm", comm, "--powersgd-warmup", 2, "--quiet",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert final_weights(tmp_path / comm).keys()
    assert os.path.exists(tmp_path / comm / "loss.png")


def test_demo_sends_the_top_components_and_keeps_the_rest_in_its_momentum():
    """One DeMo step on one process: the momentum keeps what was not sent, and the weights
    move by the learning rate against the sign of what was."""
    torch.manual_seed(3)
    p = torch.nn.Parameter(torch.randn(16, 24))
    start, g = p.detach().clone(), torch.randn(16, 24)
    compression = DCTTopK(chunk=8, k=5)
    optimizer = DeMo([{"params": [p], "weight_decay": 0.0}], 0.01, 0.9, compression, World())
    p.grad = g.clone()
    optimizer.step()
    sent = compression.decode(*sent_components(compression, g), g.shape)
    assert torch.allclose(optimizer.state[p]["momentum"], g - sent, atol=1e-6)
    assert torch.allclose(p.detach(), start - 0.01 * torch.sign(sent))
    assert optimizer.traffic.sent == 0  # alone: nothing to send


def sent_components(compression: DCTTopK, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k components of ``x``'s chunks with their values as e4m3 carries them (one scale
    for the tensor: its largest sent magnitude becomes 448), written out plainly."""
    index, values = compression.encode(x)
    scale = 448.0 / values.abs().max()
    return index, (values * scale).to(E4M3).float() / scale


def compressed_mean(grads: list[torch.Tensor], block: int) -> torch.Tensor:
    """The 1-bit compressed all-reduce of ``grads`` (one per rank) on one process: shard ``j``
    of the vector is the mean of the ranks' 1-bit messages of it, sent on as a 1-bit message of
    that mean (each shard whole blocks, the last one shorter)."""
    world, n = len(grads), grads[0].numel()
    length = -(-n // world // block) * block
    out = []
    for start in range(0, n, length):
        pieces = [g[start : start + length] for g in grads]
        mean = sum(ones(x, block) for x in pieces) / world
        out.append(ones(mean, block))
    return torch.cat(out)


def exchange_on_rank(rank: int, world: int, port: int, out: str) -> None:
    """Rank ``rank`` of a gloo group: a 1-bit exchange and a DeMo step of its own gradient
    (seeded by rank); the results go to ``out``."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    me = World(rank, world)
    g = torch.randn(16, 25, generator=torch.Generator().manual_seed(rank))
    p = torch.nn.Parameter(torch.zeros(16, 25))
    p.grad = g.clone()
    exchange = OneBit(me, block=64)
    exchange.exchange([p])
    onebit = p.grad.clone()
    q = torch.nn.Parameter(torch.zeros(16, 25))
    q.grad = g.clone()
    optimizer = DeMo([{"params": [q], "weight_decay": 0.0}], 0.01, 0.9, DCTTopK(8, 5), me)
    optimizer.step()
    result = {"onebit": onebit, "demo": q.detach().clone(), **exchange.local_state()}
    save_file(result, f"{out}-{rank}.safetensors")
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # as teralm train does under torchrun: no interpreter shutdown beside gloo


def test_two_processes_agree_on_the_mean_of_their_decoded_messages(tmp_path):
    """Over gloo, every rank ends with the mean of all ranks' decoded messages (1-bit) and with
    the sign step of the mean of their sent DCT components (DeMo), as computed here alone."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "rank")
    mp.spawn(exchange_on_rank, args=(2, free_port(), out), nprocs=2, join=True)
    grads = [torch.randn(16, 25, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    flat = [g.reshape(-1) for g in grads]
    onebit = compressed_mean(flat, 64)
    compression = DCTTopK(8, 5)
    sent = sum(compression.decode(*sent_components(compression, g), g.shape) for g in grads) / 2
    shards = [(0, 256), (256, 400)]  # 400 values: two shards of whole 64-value blocks
    for rank in range(2):
        got = load_file(f"{out}-{rank}.safetensors")
        assert torch.allclose(got["onebit"].reshape(-1), onebit, atol=1e-6)
        assert torch.allclose(got["demo"], -0.01 * torch.sign(sent))
        own = torch.cat([ones(flat[rank][a:b], 64) for a, b in shards])
        assert torch.allclose(got["residual"], flat[rank] - own, atol=1e-6)
        a, b = shards[rank]
        mean = sum(ones(g[a:b], 64) for g in flat) / 2
        shard_residual = torch.zeros(256)  # as long on every rank
        shard_residual[: b - a] = mean - ones(mean, 64)
        assert torch.allclose(got["shard_residual"], shard_residual, atol=1e-6)


def ones(x: torch.Tensor, block: int) -> torch.Tensor:
    """What the 1-bit message of ``x`` stands for."""
    return unpack_signs(*pack_signs(x, block), x.numel(), block)
