"""Training batches: random fragments of the index's token stream with their stored features.

Documents whose id is a multiple of ``holdout_every`` are held out: no fragment touches them. A
fragment may cross the boundary between two training documents, as in a concatenated stream. The
batch of step ``s`` depends only on ``(seed, s)``, so a resumed run sees what an uninterrupted
one would have.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from teralm.errors import ConfigError
from teralm.index import Index
from teralm.index.query import EXACT_LIMIT, TRAIN_EXACT_LIMIT, Followers, model_input
from teralm.kernels.fragment import fragment_features
from teralm.kernels.window import window_followers
from teralm.model import ModelConfig
from teralm.model.transformer import FollowerInput
from teralm.train.config import DataSettings


@dataclass
class Batch:
    """``tokens[b, t]`` with its features ``next_token``/``match_len`` predicts ``targets[b, t]``;
    ``infgram_total``/``infgram_hits``: the causal ∞-gram's counts for that target (see
    ``causal_infgram``; zeros when not asked for)."""

    tokens: torch.Tensor
    next_token: torch.Tensor
    match_len: torch.Tensor
    targets: torch.Tensor
    infgram_total: torch.Tensor
    infgram_hits: torch.Tensor
    follower_tokens: torch.Tensor  # [b, t, sources, k]; empty without index_followers
    follower_shares: torch.Tensor
    follower_length: torch.Tensor
    follower_total: torch.Tensor

    def to(self, device: torch.device) -> Batch:
        return Batch(*(t.to(device, non_blocking=True) for t in vars(self).values()))

    def followers(self) -> FollowerInput | None:
        """The index's fuller answer for a model with ``index_followers`` (None without)."""
        if self.follower_tokens.shape[-1] == 0:
            return None
        return FollowerInput(
            self.follower_tokens, self.follower_shares, self.follower_length, self.follower_total
        )


def held_out(doc, holdout_every: int):
    """The held-out rule: document ids (an int or an array) that are multiples of
    ``holdout_every``."""
    return doc % holdout_every == 0


def training_spans(ix: Index, holdout_every: int) -> np.ndarray:
    """``[start, stop)`` token ranges of consecutive training documents, as an [n, 2] array."""
    docs = np.arange(ix.num_documents)
    keep = ~held_out(docs, holdout_every)
    offsets = np.asarray(ix.offsets, dtype=np.int64)
    starts, stops = offsets[:-1][keep], offsets[1:][keep]
    if len(starts) == 0:
        return np.empty((0, 2), dtype=np.int64)
    breaks = np.flatnonzero(starts[1:] != stops[:-1]) + 1
    return np.stack(
        [starts[np.r_[0, breaks]], stops[np.r_[breaks - 1, len(stops) - 1]]], axis=1
    ).astype(np.int64)


def fragment(ix: Index, start: int, length: int) -> tuple[np.ndarray, ...]:
    """Tokens ``[start, start + length]`` split into inputs, their features, and targets."""
    tokens = ix.tokens(start, start + length + 1).astype(np.int64)
    features = ix.features(start, start + length)
    return (
        tokens[:-1],
        features.next_token.astype(np.int64),
        features.match_len.astype(np.int64),
        tokens[1:],
    )


def _causal_contexts(
    ix: Index, first: int, count: int, doc_start: int, lengths: np.ndarray | None
) -> tuple[np.ndarray, ...]:
    """The contexts of target positions ``first .. first+count-1``, each its stored longest
    earlier match (never reaching before ``doc_start``), laid over one stretch of text:
    ``(text, begins, ends, limits)``, with the first target's token at ``text[ends[0]]``."""
    if lengths is None:
        lengths = ix.features(first - 1, first + count - 1).match_len.astype(np.int64)
    reach = max(doc_start, first - 1 - int(lengths.max(initial=0)))
    text = ix.tokens(reach, first + count).astype(np.int64)
    ends = np.arange(first, first + count) - reach  # context of target t ends at t - 1
    begins = np.maximum(ends - lengths, doc_start - reach)
    return text, begins, ends, np.arange(first, first + count)


def causal_infgram(
    ix: Index,
    first: int,
    count: int,
    doc_start: int,
    lengths: np.ndarray | None = None,
    exact_limit: int = EXACT_LIMIT,
) -> tuple[np.ndarray, np.ndarray]:
    """``(total, hits)``: the ∞-gram counts of target positions ``first .. first+count-1`` seeing
    only earlier text, each starting from the stored longest earlier match of its context (which
    never reaches before ``doc_start``, the scored document's start). ``lengths``: the stored
    match lengths of positions ``first-1 .. first+count-2``, when the caller has them. Counts
    of a context with more than ``exact_limit`` occurrences are sampled (as the server's)."""
    text, begins, ends, limits = _causal_contexts(ix, first, count, doc_start, lengths)
    out = ix.query.causal_counts(text, begins, ends, limits, text[ends], exact_limit)
    return out[:, 1], out[:, 2]


def causal_followers(
    ix: Index,
    first: int,
    count: int,
    doc_start: int,
    caps: tuple[int, ...],
    k: int,
    lengths: np.ndarray | None = None,
    exact_limit: int = EXACT_LIMIT,
) -> Followers:
    """The ``k`` most frequent followers of target positions ``first .. first+count-1``'s
    contexts at each length cap in ``caps``, seeing only earlier text (as ``causal_infgram``
    sees it; ``QueryEngine.causal_followers``)."""
    text, begins, ends, limits = _causal_contexts(ix, first, count, doc_start, lengths)
    return ix.query.causal_followers(text, begins, ends, limits, caps, k, exact_limit)


def short_window(
    ix: Index, cfg: ModelConfig, first: int, count: int, doc_start: int
) -> tuple[np.ndarray, ...]:
    """The short window's answer (``teralm.kernels.window``, as a model reads it) for target
    positions ``first .. first+count-1``: each reads its own document (from ``doc_start`` on)
    within its last ``cfg.window_tokens`` tokens."""
    targets = np.arange(first, first + count, dtype=np.int64)
    docs = np.searchsorted(ix.offsets, targets, side="right") - 1
    starts = np.maximum(np.asarray(ix.offsets[docs], dtype=np.int64), doc_start)
    lows = np.maximum(starts, targets - cfg.window_tokens)
    base = int(lows.min(initial=first))
    text = ix.tokens(base, max(base, first + count - 1)).astype(np.int64)
    k, vocab = cfg.index_followers, ix.vocab_size
    found = window_followers(text, targets - base, lows - base, cfg.window_order, k, vocab)
    return model_input(*found, vocab)


def counted_answers(
    ix: Index,
    cfg: ModelConfig,
    first: int,
    count: int,
    doc_start: int,
    lengths: np.ndarray | None = None,
    exact_limit: int = EXACT_LIMIT,
    from_index: bool = True,
) -> tuple[np.ndarray, ...]:
    """``(tokens, shares, length, total)`` with a source axis (``FollowerInput``) for target
    positions ``first .. first+count-1``, from the sources ``cfg`` reads: the index's followers
    (``causal_followers`` at ``cfg.follower_caps``; none unless ``from_index``) and the short
    window's (``short_window``)."""
    k, vocab = cfg.index_followers, ix.vocab_size
    caps = cfg.follower_caps
    if from_index:
        found = causal_followers(ix, first, count, doc_start, caps, k, lengths, exact_limit)
        sources = [found.at_cap(level, vocab) for level in range(len(caps))]
    else:
        shape = (count, k)
        none = np.full(shape, vocab), np.zeros(shape, np.float32), np.zeros(count, np.int64)
        sources = [(*none, np.zeros(count, np.int64))] * len(caps)
    if cfg.window_order:
        sources.append(short_window(ix, cfg, first, count, doc_start))
    return tuple(np.stack(column, axis=1) for column in zip(*sources))


class FragmentSampler:
    """Deterministic random fragments of ``seq_len + 1`` tokens from the training spans, as
    the ``data`` settings say (teralm.train.config.DataSettings), with the ∞-gram counts of
    their targets when ``infgram``.

    A fraction ``index_dropout`` of the fragments, drawn per batch, come as text the index has
    never seen would: ``dropout_features = "self"``, with features and ∞-gram counts made
    against the fragment's own earlier text alone (``teralm.kernels.fragment``); ``"none"``,
    with none at all (as runs trained before the choice existed). Process ``rank`` of
    ``world`` (``share``) draws its own ``batch_size / world`` fragments, determined by (seed,
    step, micro-batch, rank, world); one process draws as it always has, by (seed, step, micro).
    The fragments' ∞-gram counts are made in ``workers`` threads (the kernels release the GIL);
    the batch does not depend on their number. ``model``: the model's config, for the counted
    answers it reads (``counted_answers``; none without ``index_followers``)."""

    def __init__(
        self,
        ix: Index,
        data: DataSettings,
        infgram: bool = False,
        share: tuple[int, int] = (0, 1),
        workers: int = 1,
        model: ModelConfig | None = None,
    ):
        rank, world = share
        self.model = model if model is not None and model.index_followers else None
        self.ix, self.seq_len, self.seed = ix, data.seq_len, data.seed
        self.batch_size = data.batch_size // world
        self.key = [] if world == 1 else [rank, world]
        self.infgram, self.index_dropout = infgram, data.index_dropout
        self.dropout_features = data.dropout_features
        seq_len = data.seq_len
        self_features = data.index_dropout > 0 and data.dropout_features == "self"
        self.doc_bits = ix.query.doc_bits if self_features else None
        self.pool = None
        if (infgram or self.model) and workers > 1:
            self.pool = ThreadPoolExecutor(workers, thread_name_prefix="teralm-infgram")
        spans = training_spans(ix, data.holdout_every)
        room = spans[:, 1] - spans[:, 0] - seq_len  # fragment starts per span
        self.spans = spans[room > 0]
        self.cumulative = np.cumsum(room[room > 0])
        if len(self.spans) == 0:
            raise ConfigError(
                f"no training text of {seq_len + 1} tokens in a row: the index is too small "
                "for this seq_len (or every document is held out)"
            )

    @property
    def num_tokens(self) -> int:
        """Training tokens the fragments are drawn from."""
        return int((self.spans[:, 1] - self.spans[:, 0]).sum())

    def _features(self, start: int, text: np.ndarray, drop: bool) -> tuple[np.ndarray, ...]:
        """``(next_token, match_len, total, hits)`` of the fragment ``text`` at ``start``: the
        stored features and the causal ∞-gram counts of its targets, or for a dropped fragment
        those against itself alone (or none); counts are zeros when the batch takes none."""
        n, ix = self.seq_len, self.ix
        if drop and self.dropout_features == "self":
            return fragment_features(
                text, self.doc_bits, start, ix.max_match, ix.no_token, self.infgram
            )
        if drop:
            next_token, match_len = np.full(n, ix.no_token, np.int64), np.zeros(n, np.int64)
        else:
            stored = ix.features(start, start + n)
            next_token, match_len = (
                stored.next_token.astype(np.int64),
                stored.match_len.astype(np.int64),
            )
        if not self.infgram or drop:
            return next_token, match_len, np.zeros(n, np.int64), np.zeros(n, np.int64)
        total, hits = causal_infgram(ix, start + 1, n, 0, match_len, TRAIN_EXACT_LIMIT)
        return next_token, match_len, total, hits

    def _followers(self, start: int, match_len: np.ndarray, drop: bool) -> tuple[np.ndarray, ...]:
        """``(tokens, shares, length, total)`` of the fragment's targets' counted answers
        (``counted_answers``; empty without ``index_followers``). A dropped fragment gets none
        from the index, and its short window reads the fragment alone: were it to read the
        document before the fragment, the window would know more than the index input there,
        and the model would learn to trust it where the index has nothing."""
        n = self.seq_len
        if self.model is None:
            return (
                np.zeros((n, 0, 0), np.int64),
                np.zeros((n, 0, 0), np.float32),
                *[np.zeros((n, 0), np.int64)] * 2,
            )
        doc_start = start if drop else 0
        return counted_answers(
            self.ix, self.model, start + 1, n, doc_start, match_len, TRAIN_EXACT_LIMIT, not drop
        )

    def _fragment(self, start: int, text: np.ndarray, drop: bool) -> tuple[np.ndarray, ...]:
        """``_features`` and ``_followers`` of one fragment."""
        features = self._features(start, text, drop)
        return (*features, *self._followers(start, features[1], drop))

    def draw(self, step: int, micro: int = 0) -> tuple[list[int], np.ndarray]:
        """Micro-batch ``micro`` of step ``step``: its fragments' starts, and which of them
        are shown as new text (index dropout)."""
        rng = np.random.default_rng([self.seed, step, micro, *self.key])
        picks = rng.integers(0, int(self.cumulative[-1]), size=self.batch_size)
        span = np.searchsorted(self.cumulative, picks, side="right")
        before = np.where(span > 0, self.cumulative[np.maximum(span - 1, 0)], 0)
        starts = [int(s) for s in self.spans[span, 0] + (picks - before)]
        return starts, rng.random(self.batch_size) < self.index_dropout

    def batch(self, step: int, micro: int = 0) -> Batch:
        """Micro-batch ``micro`` of step ``step``."""
        starts, dropped = self.draw(step, micro)
        texts = [self.ix.tokens(s, s + self.seq_len + 1).astype(np.int64) for s in starts]
        pool_map = self.pool.map if self.pool else map
        features = pool_map(self._fragment, starts, texts, dropped)
        parts = [
            (text[:-1], next_token, match_len, text[1:], total, hits, *followers)
            for text, (next_token, match_len, total, hits, *followers) in zip(texts, features)
        ]
        return Batch(*(torch.from_numpy(np.stack(column)) for column in zip(*parts)))


def prefetched(
    sampler: FragmentSampler, keys: list[tuple[int, int]], background: bool = True
) -> Iterator[Batch]:
    """``sampler.batch(*key)`` for each ``(step, micro)`` key in turn.

    ``background``: the next batch is made in a thread while the caller trains on the current
    one, which hides its index lookups and ∞-gram counts behind an accelerator's arithmetic.
    When the model runs on the same CPU cores, make batches in the foreground instead, with the
    sampler's workers on every core: a background thread would take a core from the model's
    parallel regions, which then wait for it (measured on 2 cores, tiny preset: 7,300-7,700
    tok/s with the background thread, 8,200-8,400 in the foreground)."""
    if not background:
        for key in keys:
            yield sampler.batch(*key)
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="teralm-batches") as pool:
        ahead: deque[Future] = deque()
        for key in keys:
            ahead.append(pool.submit(sampler.batch, *key))
            if len(ahead) == 2:
                yield ahead.popleft().result()  # closed early, it waits for the one in flight
        while ahead:
            yield ahead.popleft().result()
