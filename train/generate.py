"""Sampling from a model, with the index's online features for the growing text."""

from __future__ import annotations

import numpy as np
import torch
from teralm.index import Index
from teralm.index.query import OnlineMatcher
from teralm.model import Transformer
from teralm.train.loop import autocast


@torch.no_grad()
def generate(
    model: Transformer,
    ix: Index,
    prompt: np.ndarray,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 40,
    use_index: bool = True,
    seed: int = 0,
) -> np.ndarray:
    """Continue ``prompt`` by ``max_new_tokens`` tokens. With ``use_index`` every token's
    features come from the online matcher, as in training; without, the model sees "no match"
    everywhere (the ablation at inference)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    matcher = OnlineMatcher(ix)
    tokens = [int(t) for t in prompt]
    features = [matcher.push(t) if use_index else (0, ix.no_token) for t in tokens]
    window = model.cfg.max_seq_len
    for _ in range(max_new_tokens):
        recent, feats = tokens[-window:], features[-window:]
        as_tensor = lambda xs: torch.tensor([xs], dtype=torch.long, device=device)  # noqa: E731
        with autocast(device, model.cfg.precision):
            logits = model(
                as_tensor(recent),
                as_tensor([f[1] for f in feats]),
                as_tensor([f[0] for f in feats]),
            )
        logits = logits[0, -1].float().cpu()
        if temperature <= 0:
            token = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                cutoff = torch.topk(logits, min(top_k, len(logits))).values[-1]
                logits = logits.masked_fill(logits < cutoff, float("-inf"))
            token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        tokens.append(token)
        features.append(matcher.push(token) if use_index else (0, ix.no_token))
    return np.array(tokens[len(prompt) :], dtype=np.int64)
