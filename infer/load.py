"""Loading a run (its latest checkpoint), a checkpoint folder or an fp8 export for inference."""

from __future__ import annotations

from pathlib import Path

import torch

from teralm.errors import ConfigError
from teralm.index import Index
from teralm.infer.fp8 import load_fp8
from teralm.infer.precision import PrecisionChoice, choose_precision
from teralm.model import ModelConfig, Transformer, checkpoint

TOKENIZER_FIELDS = ("tokenizer", "tokenizer_sha256", "vocab_size")


def load_model(
    path: Path, device: torch.device, precision: str = "auto", generating: bool = False
) -> tuple[Transformer, dict, PrecisionChoice]:
    """The model in eval mode on ``device``, its saved state (config, index identity) and the
    precision it runs in (``auto``: the fastest exact one for the machine and for scoring or
    ``generating``, whatever it was trained in). An fp8 export keeps its matrices in e4m3 (see
    teralm.infer.fp8)."""
    tensors, state = checkpoint.load_model_weights(path)
    saved = state["config"]["model"]
    choice = choose_precision(precision, device, generating, width=saved["d_model"])
    config = ModelConfig.from_dict({**saved, "precision": choice.precision})
    model = Transformer(config)
    if checkpoint.is_fp8_export(path):
        load_fp8(model, tensors)
    else:
        model.load_state_dict(tensors)
    return model.to(device).eval(), state, choice


def check_tokenizer(state: dict, ix: Index) -> None:
    """ConfigError unless the model was trained with ``ix``'s tokenizer."""
    trained_on, here = state.get("index") or {}, ix.identity()
    for field in TOKENIZER_FIELDS:
        if trained_on.get(field) != here[field]:
            raise ConfigError(
                f"the model was trained with another tokenizer than this index's ({field}: "
                f"{trained_on.get(field)!r} vs {here[field]!r})"
            )
