"""The ∞-gram mixture step: the model's next-token distribution mixed with the index's, through the
model's learned gate (as in training)."""

from __future__ import annotations

import numpy as np
import torch

from teralm.index import Index
from teralm.model import Transformer
from teralm.model.transformer import mixture_logp


def infgram_probs(ix: Index, contexts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The ∞-gram's next-token distribution after each context (its last ``max_match`` tokens,
    as the training features see it) over followers [B, vocab], and how many followers it
    counted [B] (0 when nothing follows any suffix; the distribution is then uniform). One
    batched query for all contexts."""
    dists = ix.next_token_distribution([c[-ix.max_match :] for c in contexts])
    rows = np.repeat(np.arange(len(contexts)), [len(tokens) for tokens, _ in dists])
    tokens = np.concatenate([tokens for tokens, _ in dists]).astype(np.int64)
    counts = np.concatenate([counts for _, counts in dists]).astype(np.int64)
    totals = np.zeros(len(contexts), dtype=np.int64)
    np.add.at(totals, rows, counts)
    probs = np.full((len(contexts), ix.vocab_size), 1.0 / ix.vocab_size, dtype=np.float32)
    probs[totals > 0] = 0.0
    probs[rows, tokens] = counts / totals[rows]
    return torch.from_numpy(probs), torch.from_numpy(totals)


def next_token_logp(
    model: Transformer, logits: torch.Tensor, gate: torch.Tensor | None, infgram: tuple | None
) -> torch.Tensor:
    """Log-probabilities of the next token [B, vocab] on the CPU: the model's (``logits``
    [B, vocab]), mixed with the ∞-gram's (``infgram_probs``' answer) through ``gate`` [B] when
    the model has a mixture gate. Rows whose ∞-gram counted nothing keep the model's own."""
    logp = torch.log_softmax(logits.float().cpu(), dim=-1)
    if gate is None or infgram is None:
        return logp
    probs, totals = infgram
    gate = model.gate_logit(gate.float(), totals.to(gate.device)).cpu()
    return mixture_logp(logp, gate, probs, totals > 0)
