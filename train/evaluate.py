"""``teralm eval``: held-out bits per byte (byte indexes) or perplexity (BPE) of a run's model,
of the ∞-gram alone, and of the two interpolated.

Nothing sees the text it scores. The model's index input is the stored causal features (each
looks only at earlier positions). The ∞-gram at position ``t`` counts only occurrences that end
before ``t - 1``, so their followers lie before ``t`` (teralm.kernels.query.causal_counts), starting
from the stored longest earlier match.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from teralm.index import Index
from teralm.infer.precision import autocast
from teralm.model import Transformer
from teralm.model.transformer import index_lm_loss
from teralm.train.data import causal_infgram, fragment, held_out

INFGRAM_EPSILON = 0.01  # the ∞-gram alone mixes in this much of the uniform distribution
LAMBDAS = np.round(np.arange(0.05, 1.0, 0.05), 2)


@dataclass
class Scores:
    """Per scored token: log-probability under the model, and the causal ∞-gram counts."""

    model_logp: np.ndarray
    total: np.ndarray
    hits: np.ndarray


def held_out_windows(ix: Index, holdout_every: int, seq_len: int, max_tokens: int):
    """``(doc_start, start, length)`` windows over the held-out documents, in id order, until
    ``max_tokens`` targets are covered (each window predicts tokens ``start+1 .. start+length``
    of the document that begins at ``doc_start``)."""
    covered = 0
    for doc in filter(lambda d: held_out(d, holdout_every), range(ix.num_documents)):
        start, stop = ix.document_range(doc)
        for a in range(start, stop - 1, seq_len):
            length = min(seq_len, stop - 1 - a, max_tokens - covered)
            if length <= 0:
                return
            yield start, a, length
            covered += length


@torch.no_grad()
def score(
    ix: Index,
    model: Transformer,
    holdout_every: int,
    max_tokens: int,
    device: torch.device,
    progress: bool = True,
) -> Scores:
    """Model log-probabilities (mixed with the causal ∞-gram when the model has an ∞-gram
    mixture, as in training) and the ∞-gram counts of the held-out targets."""
    cfg = model.cfg
    logps, totals, hits = [], [], []
    windows = list(held_out_windows(ix, holdout_every, cfg.max_seq_len, max_tokens))
    for doc_start, a, length in tqdm(windows, desc="eval", unit="window", disable=not progress):
        window = fragment(ix, a, length)
        total, hit = causal_infgram(ix, a + 1, length, doc_start, window[2])
        tokens, next_token, match_len, targets, counted, hits_t = (
            torch.from_numpy(x)[None].to(device) for x in (*window, total, hit)
        )
        with autocast(device, cfg.precision):
            logits, gate = model(tokens, next_token, match_len, with_gate=True)
        if gate is not None:
            gate = model.gate_logit(gate, counted)
        nll, _ = index_lm_loss(
            logits[0],
            None if gate is None else gate[0],
            targets[0],
            counted[0],
            hits_t[0],
            reduce=False,
        )
        logps.append(-nll.cpu().numpy().astype(np.float64))
        totals.append(total)
        hits.append(hit)
    if not windows:
        raise ValueError("no held-out text to score: the index has no held-out documents")
    return Scores(np.concatenate(logps), np.concatenate(totals), np.concatenate(hits))


def summarize(scores: Scores, vocab_size: int, byte_level: bool) -> dict:
    """bpb (bytes) or perplexity (BPE) for the model, the ∞-gram alone and the interpolation at
    the best fixed weight λ on a grid (chosen on the scored text: the interpolation's best case)."""
    p_model = np.exp(scores.model_logp)
    seen = scores.total > 0
    p_inf = np.where(seen, scores.hits / np.maximum(scores.total, 1), 0.0)
    p_alone = np.where(
        seen, (1 - INFGRAM_EPSILON) * p_inf + INFGRAM_EPSILON / vocab_size, 1 / vocab_size
    )

    def metric(p: np.ndarray) -> float:
        nats = -np.log(np.maximum(p, 1e-300)).mean()
        return float(nats / math.log(2)) if byte_level else float(math.exp(nats))

    mixes = {
        float(lam): metric(np.where(seen, lam * p_model + (1 - lam) * p_inf, p_model))
        for lam in LAMBDAS
    }
    best = min(mixes, key=mixes.get)
    return {
        "metric": "bpb" if byte_level else "ppl",
        "model": metric(p_model),
        "infgram": metric(p_alone),
        "interpolated": mixes[best],
        "lambda": best,
        "tokens": int(len(p_model)),
        "infgram_coverage": float(seen.mean()),
    }
