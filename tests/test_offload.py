"""Memory-lean updates: CPU offload of the optimizer and per-layer updates in the backward, each
equal to the ordinary update in place, bit for bit, and resumable."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import build_docs, random_documents
from test_cli import run_cli
from test_galore import CONFIG as GALORE_CONFIG

from teralm.model import checkpoint
from teralm.train.galore import GaLoreAdamW
from teralm.train.offload import Offloaded
from teralm.train.per_layer import PerLayer


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.ReLU(), torch.nn.Linear(20, 5))


def adamw(groups):
    return torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1, fused=True)


def galore(groups):
    """8-bit GaLore, the groups of matrices projected."""
    projected = {"rank": 3, "gap": 2, "scale": 0.5}
    groups = [{**g, **projected} if g["params"][0].ndim == 2 else g for g in groups]
    return GaLoreAdamW(groups, lr=0.01, eight_bit=True)


def groups_of(net: torch.nn.Module) -> list[dict]:
    matrices = [p for p in net.parameters() if p.ndim == 2]
    return [{"params": matrices}, {"params": [p for p in net.parameters() if p.ndim < 2]}]


def steps(net, optimizer, count: int, seed: int) -> list[float]:
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(count):
        x = torch.randn(8, 12, generator=generator)
        loss = net(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("make", [adamw, galore])
@pytest.mark.parametrize("masters", [False, True])
def test_offloaded_training_equals_training_in_place(make, masters):
    here, there = model(), model()
    want = steps(here, make(groups_of(here)), 6, seed=1)
    got = steps(there, Offloaded(groups_of(there), make, masters=masters), 6, seed=1)
    assert got == want
    for a, b in zip(here.parameters(), there.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("masters", [False, True])
def test_offloaded_state_survives_a_checkpoint(tmp_path, masters):
    """Saved (masters included) and restored into a fresh model and optimizer, the offloaded
    run goes on exactly as the uninterrupted one."""
    whole = model()
    whole_opt = Offloaded(groups_of(whole), adamw, masters=masters)
    want = steps(whole, whole_opt, 3, seed=2) + steps(whole, whole_opt, 3, seed=3)

    first = model()
    first_opt = Offloaded(groups_of(first), adamw, masters=masters)
    steps(first, first_opt, 3, seed=2)
    state = {"config": {}, "index": {}, "tokens": 0, "wall_s": 0.0}
    checkpoint.save(tmp_path, 3, first, first_opt, state)
    weights, tensors, state = checkpoint.load(checkpoint.latest(tmp_path))
    assert any(k.endswith(".master") for k in tensors) == masters

    resumed = model()
    resumed_opt = Offloaded(groups_of(resumed), adamw, masters=masters)
    resumed.load_state_dict(weights)
    tensors.pop("torch_rng")
    checkpoint.restore_optimizer(resumed_opt, tensors, state["optimizer"])
    assert steps(resumed, resumed_opt, 3, seed=3) == want[3:]
    for a, b in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_teralm_train_with_offload_ends_with_the_weights_trained_in_place(tmp_path):
    """``teralm train --offload`` (each kind, one with AdamW and one with 8-bit GaLore) ends with
    the weights of the same run without it, bit for bit, on the CPU."""
    rng = np.random.default_rng(7)
    corpus = build_docs(tmp_path / "corpus", random_documents(rng, 30, "abcd", 150))
    config = tmp_path / "run.toml"
    config.write_text(GALORE_CONFIG.replace("max_steps = 6", "max_steps = 4"))
    for optimizer, kind in (("adamw", "optimizer+master"), ("galore8bit", "optimizer")):
        runs = {}
        for offload in ("none", kind):
            run = tmp_path / f"{optimizer}-{offload}"
            out = run_cli(
                "train", "--index", corpus.directory, "--config", config, "--out", run,
                "--optimizer", optimizer, "--offload", offload, "--quiet",
            )  # fmt: skip
            assert out.returncode == 0, out.stderr
            runs[offload] = checkpoint.load(checkpoint.latest(run))[0]
        for name, want in runs["none"].items():
            assert torch.equal(runs[kind][name], want), (optimizer, kind, name)


@pytest.mark.parametrize("make", [adamw, galore])
def test_per_layer_updates_equal_the_ordinary_update(make):
    """Stepped from the backward one parameter at a time, the weights after each step are those
    of one step of the whole optimizer; no gradient is left after the backward."""
    here, there = model(), model()
    want = steps(here, make(groups_of(here)), 4, seed=4)
    per_layer = PerLayer(groups_of(there), make)
    got = steps(there, per_layer, 4, seed=4)
    assert got == want
    for a, b in zip(here.parameters(), there.parameters()):
        assert torch.equal(a, b) and b.grad is None
    state = copy.deepcopy(per_layer.state_dict())  # as a checkpoint keeps it
    again = model()
    again.load_state_dict(there.state_dict())
    resumed = PerLayer(groups_of(again), make)
    resumed.load_state_dict(state)
    assert steps(again, resumed, 2, seed=5) == steps(there, per_layer, 2, seed=5)


def test_teralm_train_per_layer_equals_the_ordinary_step_and_refuses_what_needs_all(tmp_path):
    """``--per-layer-update`` (no clipping) ends with the weights of the ordinary step; with
    clipping by global norm it is refused before anything is written."""
    rng = np.random.default_rng(8)
    corpus = build_docs(tmp_path / "corpus", random_documents(rng, 30, "abcd", 150))
    config = tmp_path / "run.toml"
    config.write_text(GALORE_CONFIG.replace("max_steps = 6", "max_steps = 4\ngrad_clip = 0.0"))
    args = ["train", "--index", corpus.directory, "--config", config, "--quiet"]
    weights = []
    for extra in ([], ["--per-layer-update"]):
        run = tmp_path / f"run{len(extra)}"
        out = run_cli(*args, "--out", run, "--optimizer", "galore8bit", *extra)
        assert out.returncode == 0, out.stderr
        weights.append(checkpoint.load(checkpoint.latest(run))[0])
    for name, want in weights[0].items():
        assert torch.equal(weights[1][name], want), name
    clipped = tmp_path / "clipped.toml"
    clipped.write_text(GALORE_CONFIG)
    refused = run_cli(
        "train", "--index", corpus.directory, "--config", clipped, "--out", tmp_path / "no",
        "--per-layer-update", "--quiet",
    )  # fmt: skip
    assert refused.returncode == 1 and "it needs grad_accum 1, grad_clip 0" in refused.stderr
    assert not (tmp_path / "no").exists()
