"""The mixture steps: the model's next-token distribution mixed with the ∞-gram's through the
model's learned gate (as in training), and with the kNN datastore's neighbours (teralm.index.knn)
at a fixed weight chosen on validation text."""

from __future__ import annotations

import math

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
    dists = ix.query.next_token_distribution([c[-ix.max_match :] for c in contexts])
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


def knn_weights(distances: np.ndarray, temperature: float) -> np.ndarray:
    """Each neighbour's share of its row's kNN distribution: a softmax of ``-distance /
    temperature`` over the row's neighbours (rows without any are all zeros; see
    teralm.index.knn.Neighbours)."""
    logits = -np.asarray(distances, dtype=np.float64) / temperature
    found = np.isfinite(logits)
    top = np.where(found.any(axis=1), np.where(found, logits, -np.inf).max(axis=1), 0.0)
    weights = np.where(found, np.exp(logits - top[:, None]), 0.0)
    total = weights.sum(axis=1, keepdims=True)
    return np.divide(weights, total, out=np.zeros_like(weights), where=total > 0)


def knn_target_probs(tokens: np.ndarray, distances: np.ndarray, targets, temperature: float):
    """The kNN distribution's probability of each row's target token [n]."""
    hit = np.asarray(tokens) == np.asarray(targets)[:, None]
    return (knn_weights(distances, temperature) * hit).sum(axis=1)


def knn_mixed_logp(
    logp: torch.Tensor, tokens: np.ndarray, distances: np.ndarray, temperature: float, lam: float
) -> torch.Tensor:
    """``log(lam * p_knn + (1 - lam) * exp(logp))`` over the vocabulary [B, vocab]; rows without
    neighbours keep ``logp``."""
    weights = knn_weights(distances, temperature)
    p_knn = np.zeros(tuple(logp.shape), dtype=np.float64)
    rows = np.broadcast_to(np.arange(len(tokens))[:, None], tokens.shape)
    found = weights > 0
    np.add.at(p_knn, (rows[found], tokens[found]), weights[found])
    p_knn = torch.from_numpy(p_knn).to(logp.dtype)
    mixed = torch.logaddexp(math.log(lam) + torch.log(p_knn), math.log1p(-lam) + logp)
    return torch.where(torch.from_numpy(found.any(axis=1))[:, None], mixed, logp)
