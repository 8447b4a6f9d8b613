"""Sampling from a model, with the index's online features for the growing text."""

from __future__ import annotations

import numpy as np
import torch
from teralm.index import Index
from teralm.index.query import OnlineMatcher
from teralm.model import Transformer
from teralm.model.transformer import mixture_logp
from teralm.train.loop import autocast


def infgram_probs(ix: Index, contexts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The ∞-gram's next-token distribution after each context (its last ``max_match`` tokens,
    as the training features see it) over followers [B, vocab], and how many followers it
    counted [B] (0 when nothing follows any suffix; the distribution is then uniform)."""
    dists = ix.next_token_distribution([c[-ix.max_match :] for c in contexts])
    probs = np.full((len(contexts), ix.vocab_size), 1.0 / ix.vocab_size, dtype=np.float32)
    totals = np.zeros(len(contexts), dtype=np.int64)
    for row, (tokens, counts) in enumerate(dists):
        totals[row] = counts.sum()
        if totals[row]:
            probs[row] = 0.0
            probs[row, tokens] = counts / totals[row]
    return torch.from_numpy(probs), torch.from_numpy(totals)


def next_token_logp(
    model: Transformer, logits: torch.Tensor, gate, infgram: tuple | None = None
) -> torch.Tensor:
    """Log-probabilities of the next token [B, vocab]: the model's (``logits`` [B, vocab]),
    mixed with the ∞-gram's (``infgram_probs``' answer) through ``gate`` [B] when the model
    has a mixture gate (as in training)."""
    logp = torch.log_softmax(logits.float().cpu(), dim=-1)
    if gate is None:
        return logp
    probs, totals = infgram
    gate = model.gate_logit(gate.float(), totals.to(gate.device)).cpu()
    return mixture_logp(logp, gate, probs, totals > 0)


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
            logits, gate = model(
                as_tensor(recent),
                as_tensor([f[1] for f in feats]),
                as_tensor([f[0] for f in feats]),
                with_gate=True,
            )
        mixing = gate is not None and use_index
        infgram = infgram_probs(ix, [tokens]) if mixing else None
        logits = next_token_logp(model, logits[0, -1:], gate[0, -1:] if mixing else None, infgram)[
            0
        ]
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
