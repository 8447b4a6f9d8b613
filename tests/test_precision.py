"""Precision choice: ``auto`` follows what the CPU can do, and a run records what it chose."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import build_docs, random_documents

from teralm.infer import choose_precision
from teralm.model import ModelConfig, Transformer
from teralm.train.config import PRESETS, RunConfig, TrainConfig
from teralm.train.loop import train

CPU = torch.device("cpu")


def cpu_probe(monkeypatch, avx512_bf16: bool, amx: bool, capability: str = "AVX512") -> None:
    """Make torch report these CPU features."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)


@pytest.mark.parametrize(
    "avx512_bf16, amx, chosen",
    [(False, False, "fp32"), (True, False, "bf16"), (False, True, "bf16")],
)
def test_auto_follows_native_bf16(monkeypatch, avx512_bf16, amx, chosen):
    cpu_probe(monkeypatch, avx512_bf16, amx)
    choice = choose_precision("auto", CPU)
    assert choice.precision == chosen and choice.warning is None
    assert "AVX512" in choice.reason


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
