"""Precision choice: ``auto`` follows what the CPU can do, and a run records what it chose."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import build_docs, random_documents

from teralm.infer import choose_precision, precision
from teralm.model import ModelConfig, Transformer
from teralm.train.config import PRESETS, RunConfig, TrainConfig
from teralm.train.loop import train

CPU = torch.device("cpu")


def cpu_probe(
    monkeypatch, avx512_bf16: bool, amx: bool, capability: str = "AVX512", speedup: float = 1.5
) -> None:
    """Make torch report these CPU features, and bf16 time at ``speedup`` times fp32's speed
    (the timing is refused on a CPU without native bf16: it must not run there)."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)

    def timed(width: int) -> float:
        assert avx512_bf16 or amx, "bf16 timed on a CPU without native bf16"
        return speedup

    monkeypatch.setattr(precision, "cpu_bf16_speedup", timed)


@pytest.mark.parametrize(
    "avx512_bf16, amx, speedup, chosen",
    [
        (False, False, 1.5, "fp32"),
        (True, False, 1.5, "bf16"),
        (False, True, 1.5, "bf16"),
        (True, False, 0.7, "fp32"),  # native bf16 that runs slower (a VM's Xeon without AMX)
        (True, True, 1.05, "fp32"),  # within the margin: fp32
    ],
)
def test_auto_follows_native_and_measured_bf16(monkeypatch, avx512_bf16, amx, speedup, chosen):
    cpu_probe(monkeypatch, avx512_bf16, amx, speedup=speedup)
    choice = choose_precision("auto", CPU)
    assert choice.precision == chosen and choice.warning is None
    assert "AVX512" in choice.reason
    assert (f"{speedup:.2f}x" in choice.reason) == (avx512_bf16 or amx)


@pytest.mark.parametrize("avx512_bf16", [False, True])
def test_auto_generates_in_fp32_on_every_cpu(monkeypatch, avx512_bf16):
    """Generation's ``auto`` is the fused fp32 decoder's precision, native bf16 or not; an
    explicit choice is kept."""
    cpu_probe(monkeypatch, avx512_bf16, False)
    choice = choose_precision("auto", CPU, generating=True)
    assert choice.precision == "fp32" and "fused fp32 decoder" in choice.reason
    assert choose_precision("bf16", CPU, generating=True).precision == "bf16"


def test_explicit_slow_choices_run_with_a_warning(monkeypatch):
    cpu_probe(monkeypatch, False, False, "AVX2")
    bf16 = choose_precision("bf16", CPU)
    assert bf16.precision == "bf16" and "slower than fp32" in bf16.warning
    fp8 = choose_precision("fp8", CPU)
    assert fp8.precision == "fp8" and "emulation" in fp8.warning
    assert choose_precision("fp32", CPU).warning is None
    cpu_probe(monkeypatch, True, False)
    assert choose_precision("bf16", CPU).warning is None
    cpu_probe(monkeypatch, True, False, speedup=0.7)
    warning = choose_precision("bf16", CPU).warning
    assert "bf16 measured at 0.70x fp32's speed (width 256): auto would take fp32" in warning


def test_presets_default_to_auto_and_models_refuse_it():
    assert PRESETS["tiny"]["model"]["precision"] == "auto"
    with pytest.raises(ValueError, match="resolve it first"):
        Transformer(ModelConfig(n_layer=1, n_head=1, d_model=8, precision="auto"))


def test_run_records_the_precision_it_chose_and_why(monkeypatch, tmp_path):
    cpu_probe(monkeypatch, False, False, "AVX2")
    ix = build_docs(tmp_path / "corpus", random_documents(np.random.default_rng(3), 20))
    config = RunConfig(
        ModelConfig(n_layer=1, n_head=2, d_model=16, max_seq_len=16, precision="auto"),
        TrainConfig(batch_size=2, seq_len=16, max_steps=2, warmup_steps=1, holdout_every=5),
    )
    train(ix, config, tmp_path / "run", progress=False)
    record = json.loads((tmp_path / "run" / "config.json").read_text())
    assert record["config"]["model"]["precision"] == "fp32"
    assert record["precision"]["precision"] == "fp32"
    assert "AVX2 without native bf16" in record["precision"]["reason"]


def test_a_resumed_auto_run_keeps_its_precision(monkeypatch, tmp_path):
    """bf16 measured faster when the run began, slower when it is resumed: it stays bf16."""
    cpu_probe(monkeypatch, True, False, speedup=1.5)
    ix = build_docs(tmp_path / "corpus", random_documents(np.random.default_rng(3), 20))
    model = ModelConfig(n_layer=1, n_head=2, d_model=16, max_seq_len=16, precision="auto")
    config = RunConfig(
        model, TrainConfig(batch_size=2, seq_len=16, max_steps=2, warmup_steps=1, holdout_every=5)
    )
    train(ix, config, tmp_path / "run", progress=False)
    cpu_probe(monkeypatch, True, False, speedup=0.5)
    config.model.precision, config.train.max_steps = "auto", 3
    train(ix, config, tmp_path / "run", resume=True, progress=False)
    record = json.loads((tmp_path / "run" / "config.json").read_text())
    assert record["precision"]["precision"] == "bf16"
    assert record["precision"]["reason"] == "the resumed run's own"
