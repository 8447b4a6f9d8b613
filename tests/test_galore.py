"""GaLore against AdamW and against its own definition; 8-bit moments against their bound."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import build_docs, cli_here, random_documents
from test_cli import run_cli

from teralm.model import checkpoint
from teralm.train import galore
from teralm.train.galore import BLOCK, Blockwise8bit, GaLoreAdamW


def matrices(*shapes: tuple[int, int]) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]


def gradients(params, steps: int) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [[torch.randn(p.shape, generator=generator) for p in params] for _ in range(steps)]


def train(optimizer, params, grads) -> None:
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        optimizer.step()


def test_full_rank_with_the_identity_projection_is_adamw(monkeypatch):
    """Projected onto the identity at full rank, scale 1, GaLore's steps are AdamW's."""
    monkeypatch.setattr(galore, "subspace", lambda grad, rank: torch.eye(min(grad.shape)))
    ours, theirs = matrices((6, 9), (9, 6)), matrices((6, 9), (9, 6))
    grads = gradients(ours, 6)
    group = {"weight_decay": 0.1, "rank": 6, "gap": 2, "scale": 1.0}
    train(GaLoreAdamW([{"params": ours, **group}], lr=0.01, betas=(0.9, 0.95)), ours, grads)
    reference = torch.optim.AdamW(theirs, lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)
    train(reference, theirs, grads)
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-6)


def test_subspace_is_the_top_singular_vectors():
    """A rank-r gradient projected and projected back is itself, from either side."""
    torch.manual_seed(2)
    for m, n in ((8, 20), (20, 8)):
        g = torch.randn(m, 3) @ torch.randn(3, n)
        projection = galore.subspace(g, 3)
        assert projection.shape == (min(m, n), 3)
        back = GaLoreAdamW.project_back(GaLoreAdamW.project(g, projection), projection, g)
        assert torch.allclose(back, g, atol=1e-4)
        assert torch.allclose(projection.T @ projection, torch.eye(3), atol=1e-5)


def test_projection_is_recomputed_on_the_gap_and_the_moments_are_kept(monkeypatch):
    """With gap 3 the projection is recomputed at steps 0, 3 and 6 (from that step's gradient);
    at a switch the moments go on from their old values, not re-projected."""
    calls = []
    real = galore.subspace

    def recording(grad, rank):
        calls.append(grad.clone())
        return real(grad, rank)

    monkeypatch.setattr(galore, "subspace", recording)
    (p,) = matrices((5, 12))
    grads = gradients([p], 7)
    optimizer = GaLoreAdamW(
        [{"params": [p], "weight_decay": 0.0, "rank": 2, "gap": 3, "scale": 0.25}], lr=0.01
    )
    train(optimizer, [p], grads[:3])
    before = optimizer.state[p]["exp_avg"].clone()
    train(optimizer, [p], grads[3:4])
    assert len(calls) == 2 and torch.equal(calls[1], grads[3][0])
    projected = real(grads[3][0], 2).T @ grads[3][0]
    assert torch.allclose(optimizer.state[p]["exp_avg"], 0.9 * before + 0.1 * projected, atol=1e-6)
    train(optimizer, [p], grads[4:])
    assert len(calls) == 3 and torch.equal(calls[2], grads[6][0])
    assert optimizer.state[p]["exp_avg"].shape == (2, 12)


@pytest.mark.parametrize("kind", ["normal", "heavy-tailed", "tiny and huge"])
@pytest.mark.parametrize("n", [1, BLOCK, 3 * BLOCK + 17])
def test_eight_bit_round_trip_is_within_its_bound(kind, n):
    torch.manual_seed(3)
    if kind == "normal":
        x = torch.randn(n)
    elif kind == "heavy-tailed":
        x = torch.distributions.StudentT(1.5).sample((n,))
    else:
        x = torch.randn(n) * 10.0 ** torch.randint(-12, 6, (n,)).float()
    q, scales = Blockwise8bit.quantize(x)
    assert q.dtype == torch.uint8 and q.numel() == n and scales.numel() == -(-n // BLOCK)
    back = Blockwise8bit.dequantize(q, scales, x.shape)
    for start in range(0, n, BLOCK):
        block, got = x[start : start + BLOCK].double(), back[start : start + BLOCK].double()
        bound = torch.maximum(block.abs() / 16, block.abs().max() / 458752)
        assert ((got - block).abs() <= bound * (1 + 1e-6)).all()


def test_eight_bit_galore_follows_galore():
    """On a quadratic, 8-bit moments change the descent by little: the distance to the target
    falls as with fp32 moments, within 10% at every step, to under half in 60 steps."""
    start, target = (m.detach() for m in matrices((16, 40), (16, 40)))
    curves = []
    for eight_bit in (False, True):
        p = torch.nn.Parameter(start.clone())
        group = {"params": [p], "weight_decay": 0.0, "rank": 16, "gap": 10, "scale": 1.0}
        optimizer = GaLoreAdamW([group], lr=0.05, eight_bit=eight_bit)
        distances = []
        for _ in range(60):
            p.grad = (p.detach() - target).clone()
            optimizer.step()
            distances.append((p.detach() - target).norm())
        curves.append(torch.stack(distances))
    full, eight = curves
    assert full[-1] < 0.5 * (start - target).norm()
    assert ((eight - full).abs() <= 0.1 * full).all()


CONFIG = """
[model]
n_layer = 1
n_head = 2
d_model = 16
max_seq_len = 16
precision = "fp32"
[train]
batch_size = 4
seq_len = 16
max_steps = 6
warmup_steps = 2
checkpoint_every = 3
log_every = 1
holdout_every = 5
galore_rank = 4
galore_gap = 2
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(6)
    docs = random_documents(rng, 30, alphabet="abcd", max_len=150)
    return build_docs(tmp_path_factory.mktemp("corpus"), docs)


@pytest.mark.parametrize(
    "optimizer", ["galore", pytest.param("galore8bit", marks=pytest.mark.slow)]
)  # 8-bit state resumes through the same code; on demand
def test_training_resumes_with_galore_as_if_never_stopped(corpus, tmp_path, optimizer):
    """A run with GaLore's optimizer, resumed from its step-3 checkpoint (its projections,
    moments and step counts saved), ends with the weights of the uninterrupted run."""
    config = tmp_path / "run.toml"
    config.write_text(CONFIG)
    args = ["train", "--index", corpus.directory, "--config", config, "--optimizer", optimizer]
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    for run in (whole, stopped):
        out = run_cli(*args, "--out", run, "--quiet")
        assert out.returncode == 0, out.stderr
    (stopped / "latest.json").write_text(json.dumps({"checkpoint": "ckpt-00000003", "step": 3}))
    shutil.rmtree(stopped / "ckpt-00000006")
    _, moments, _ = checkpoint.load(stopped / "ckpt-00000003")
    assert any(name.endswith(".projection") for name in moments)
    resumed = run_cli(*args, "--out", stopped, "--resume", "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    want, got = (checkpoint.load(checkpoint.latest(r))[0] for r in (whole, stopped))
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_optimizer_choices_that_cannot_work_are_refused(corpus, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(CONFIG)
    args = ["train", "--index", corpus.directory, "--config", config, "--quiet"]
    out = run_cli(*args, "--out", tmp_path / "run")
    assert out.returncode == 0, out.stderr
    switched = cli_here(*args, "--out", tmp_path / "run", "--resume", "--optimizer", "galore")
    assert switched.returncode == 1
    assert "the run was trained with other settings: optimizer" in switched.stderr
    both = cli_here(*args, "--out", tmp_path / "demo", "--optimizer", "galore", "--comm", "demo")
    assert both.returncode == 1 and "comm demo is an optimizer of its own" in both.stderr
    offloaded = cli_here(
        *args, "--out", tmp_path / "d2", "--offload", "optimizer", "--comm", "demo"
    )
    assert offloaded.returncode == 1 and "use offload none" in offloaded.stderr
