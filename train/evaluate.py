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

from teralm.errors import ConfigError
from teralm.index import Index
from teralm.index.knn import KnnDatastore
from teralm.infer.mixture import knn_weights
from teralm.infer.precision import autocast
from teralm.model import Transformer
from teralm.model.transformer import FollowerInput, index_lm_loss
from teralm.train.data import (
    causal_infgram,
    counted_answers,
    fragment,
    held_out,
)

INFGRAM_EPSILON = 0.01  # the ∞-gram alone mixes in this much of the uniform distribution
LAMBDAS = np.round(np.arange(0.05, 1.0, 0.05), 2)
MATCH_GROUPS = ((0, 3), (4, 15), (16, None))  # stored match lengths, for the breakdown
COUNT_GROUPS = ((0, 0), (1, 3), (4, 15), (16, 255), (256, None))  # ∞-gram counts, likewise


@dataclass
class Scores:
    """Per scored token: log-probability under the model as served (mixed with the ∞-gram
    through its gate, when it has one) and under its own head alone, the causal ∞-gram
    counts, and the stored match length of its context. With a kNN datastore also the
    neighbours' squared distances [n, k] and which of them were followed by the token
    (``knn_hits``)."""

    model_logp: np.ndarray
    own_logp: np.ndarray
    total: np.ndarray
    hits: np.ndarray
    match_len: np.ndarray
    knn_distances: np.ndarray | None = None
    knn_hits: np.ndarray | None = None


def held_out_documents(ix: Index, holdout_every: int, part: str = "all") -> list[int]:
    """The held-out documents in id order: ``all``, or alternate ones as ``validation`` (the
    2nd, 4th, ...: where the kNN mixture's weights are chosen) and ``test`` (the others)."""
    docs = [d for d in range(ix.num_documents) if held_out(d, holdout_every)]
    return {"all": docs, "validation": docs[1::2], "test": docs[0::2]}[part]


def document_windows(ix: Index, docs, seq_len: int, max_tokens: int | None = None):
    """``(doc_start, start, length)`` windows over the documents, in order, until
    ``max_tokens`` targets are covered (each window predicts tokens ``start+1 ..
    start+length`` of the document that begins at ``doc_start``)."""
    covered = 0
    for doc in docs:
        start, stop = ix.document_range(doc)
        for a in range(start, stop - 1, seq_len):
            length = min(seq_len, stop - 1 - a)
            if max_tokens is not None:
                length = min(length, max_tokens - covered)
                if length <= 0:
                    return
            yield start, a, length
            covered += length


def window_answers(
    ix: Index, model: Transformer, doc_start: int, a: int, length: int, match_len, device
) -> FollowerInput | None:
    """The counted answers of a window's targets (``counted_answers``), for a model with
    index_followers."""
    if not model.cfg.index_followers:  # a config with followers has the index input (ModelConfig)
        return None
    arrays = counted_answers(ix, model.cfg, a + 1, length, doc_start, match_len)
    return FollowerInput(*(torch.from_numpy(x)[None].to(device) for x in arrays))


@torch.no_grad()
def score(
    ix: Index,
    model: Transformer,
    windows: list[tuple[int, int, int]],
    device: torch.device,
    progress: bool = True,
    knn: KnnDatastore | None = None,
) -> Scores:
    """Model log-probabilities (as served and alone) and the ∞-gram counts of the windows'
    targets (``document_windows``); with ``knn``, also the neighbours of each position's
    hidden state."""
    if not windows:
        raise ConfigError("no held-out text to score: the index has no held-out documents")
    cfg = model.cfg
    names = ("served", "own", "total", "hits", "match_len")
    columns: dict[str, list[np.ndarray]] = {name: [] for name in names}
    neighbours: list[tuple[np.ndarray, np.ndarray]] = []
    for doc_start, a, length in tqdm(windows, desc="eval", unit="window", disable=not progress):
        window = fragment(ix, a, length)
        total, hit = causal_infgram(ix, a + 1, length, doc_start, window[2])
        tokens, next_token, match_len, targets, counted, hits_t = (
            torch.from_numpy(x)[None].to(device) for x in (*window, total, hit)
        )
        followers = window_answers(ix, model, doc_start, a, length, window[2], device)
        with autocast(device, cfg.precision):
            hidden = model.hidden(tokens, next_token, match_len, followers)
            logits, gate = model.head(hidden)
        if gate is not None:
            gate = model.gate_logit(gate, counted)
        served, own = index_lm_loss(
            logits[0], None if gate is None else gate[0], targets[0], counted[0], hits_t[0],
            reduce=False,
        )  # fmt: skip
        columns["served"].append(-served.cpu().numpy().astype(np.float64))
        columns["own"].append(-own.cpu().numpy().astype(np.float64))
        columns["total"].append(total)
        columns["hits"].append(hit)
        columns["match_len"].append(window[2])
        if knn is not None:
            found = knn.search(hidden[0].float().cpu().numpy())
            neighbours.append((found.distances, found.tokens == window[3][:, None]))
    joined = {name: np.concatenate(parts) for name, parts in columns.items()}
    scores = Scores(*(joined[name] for name in names))
    if knn is not None:
        scores.knn_distances = np.concatenate([d for d, _ in neighbours])
        scores.knn_hits = np.concatenate([h for _, h in neighbours])
    return scores


def interpolations(scores: Scores) -> dict[float, np.ndarray]:
    """Each λ of ``LAMBDAS``: the probability of every scored token under ``λ · model + (1 - λ)
    · ∞-gram`` (the model alone where the ∞-gram has seen nothing)."""
    p_model = np.exp(scores.model_logp)
    seen = scores.total > 0
    p_inf = scores.hits / np.maximum(scores.total, 1)
    return {
        float(lam): np.where(seen, lam * p_model + (1 - lam) * p_inf, p_model) for lam in LAMBDAS
    }


def _nats(p: np.ndarray) -> float:
    """Mean negative log of the probabilities ``p`` (floored, so a zero costs 690 nats)."""
    return float(-np.log(np.maximum(p, 1e-300)).mean())


def _lowest_loss(mixes: dict[float, np.ndarray]) -> float:
    return min(mixes, key=lambda lam: _nats(mixes[lam]))


def best_lambda(scores: Scores) -> float:
    """The λ of ``LAMBDAS`` whose interpolation scores these tokens best."""
    return _lowest_loss(interpolations(scores))


def summarize(
    scores: Scores,
    vocab_size: int,
    byte_level: bool,
    knn: dict | None = None,
    lam: float | None = None,
) -> dict:
    """bpb (bytes) or perplexity (BPE) for the model as served and alone, the ∞-gram alone, and
    the interpolation at weight ``lam`` (chosen on other text, e.g. by ``best_lambda`` on a
    validation split) and at the oracle λ of these scores (the interpolation's best case; also
    the ``interpolated`` one when no ``lam`` is given); the same, but the ∞-gram, by the stored
    match length of the context (``by_match``: groups of ``MATCH_GROUPS``, with their share of
    the tokens) and by how many occurrences the ∞-gram counted (``by_count``: ``COUNT_GROUPS``). With ``knn`` (a datastore's calibration, chosen on other text) and the scores'
    neighbours, also each model mixed with the kNN distribution."""
    p_model = np.exp(scores.model_logp)
    seen = scores.total > 0
    p_inf = np.where(seen, scores.hits / np.maximum(scores.total, 1), 0.0)
    p_alone = np.where(
        seen, (1 - INFGRAM_EPSILON) * p_inf + INFGRAM_EPSILON / vocab_size, 1 / vocab_size
    )

    def metric(p: np.ndarray) -> float:
        nats = _nats(p)
        return nats / math.log(2) if byte_level else math.exp(nats)

    mixes = interpolations(scores)
    oracle = _lowest_loss(mixes)
    best = oracle if lam is None else float(lam)
    if best not in mixes:
        raise ConfigError(f"λ {best} is not one of the grid's ({', '.join(map(str, LAMBDAS))})")
    result = {
        "metric": "bpb" if byte_level else "ppl",
        "model": metric(p_model),
        "model_alone": metric(np.exp(scores.own_logp)),
        "infgram": metric(p_alone),
        "interpolated": metric(mixes[best]),
        "lambda": best,
        "interpolated_oracle": metric(mixes[oracle]),
        "lambda_oracle": oracle,
        "tokens": int(len(p_model)),
        "infgram_coverage": float(seen.mean()),
    }
    for name, values, groups in (
        ("by_match", scores.match_len, MATCH_GROUPS),
        ("by_count", scores.total, COUNT_GROUPS),
    ):
        result[name] = _by_band(
            values, groups, metric, p_model, np.exp(scores.own_logp), mixes[best]
        )
    if knn is not None and scores.knn_distances is not None:
        for base, logp in (("model", scores.model_logp), ("model_alone", scores.own_logp)):
            p = knn_mixture(logp, scores.knn_distances, scores.knn_hits, **knn[base])
            result[f"{base}_knn"] = metric(p)
    return result


def _by_band(values, groups, metric, p_model, p_own, p_mixed) -> list[dict]:
    """``metric`` of the model as served, alone and interpolated over the tokens whose
    ``values`` lie in each ``(low, high)`` of ``groups`` (high None: no bound), with their share."""
    bands = []
    for low, high in groups:
        at = (values >= low) & (values <= (np.inf if high is None else high))
        if at.any():
            bands.append(
                {
                    "range": f"{low}+" if high is None else f"{low}-{high}",
                    "share": float(at.mean()),
                    "model": metric(p_model[at]),
                    "model_alone": metric(p_own[at]),
                    "interpolated": metric(p_mixed[at]),
                }
            )
    return bands


def knn_mixture(
    logp: np.ndarray, distances: np.ndarray, hits: np.ndarray, temperature: float, lam: float
) -> np.ndarray:
    """``lam * p_knn + (1 - lam) * p`` of each scored token (``p = exp(logp)``; tokens without
    neighbours keep ``p``)."""
    p_knn = (knn_weights(distances, temperature) * hits).sum(axis=1)
    p = np.exp(logp)
    return np.where(np.isfinite(distances).any(axis=1), lam * p_knn + (1 - lam) * p, p)


def calibrate_knn(scores: Scores) -> dict:
    """The kNN temperature and weight that give each model (as served, and alone) its lowest
    loss on these scores, from a grid: temperatures from 1/8 to 8 times the median distance to
    the nearest key, in steps of √2, and ``LAMBDAS``."""
    distances, hits = scores.knn_distances, scores.knn_hits
    nearest = distances[:, 0][np.isfinite(distances[:, 0])]
    if not len(nearest):
        raise ConfigError("no scored position has a neighbour in the datastore")
    scale = max(float(np.median(nearest)), 1e-6)
    found = np.isfinite(distances).any(axis=1)
    best: dict[str, tuple[float, dict]] = {}
    for temperature in scale * 2.0 ** (np.arange(-6, 7) / 2):
        p_knn = (knn_weights(distances, temperature) * hits).sum(axis=1)
        for base, logp in (("model", scores.model_logp), ("model_alone", scores.own_logp)):
            p = np.exp(logp)
            for lam in LAMBDAS:
                mixed = np.where(found, lam * p_knn + (1 - lam) * p, p)
                nats = _nats(mixed)
                if base not in best or nats < best[base][0]:
                    best[base] = (nats, {"temperature": float(temperature), "lam": float(lam)})
    return {base: choice for base, (_, choice) in best.items()}
