"""The counted answers of text being generated, as a model with ``index_followers`` reads them.

Training and evaluation count the followers of a position's context among the occurrences that
end before it (``teralm.train.data.counted_answers``); text that is being generated is not in
the index, so all of the index lies before it and every occurrence counts. The short window
reads the generated text itself (prompt included), as training reads a document.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from teralm.index import Index
from teralm.index.query import TRAIN_EXACT_LIMIT, model_input
from teralm.kernels.window import window_followers
from teralm.model import ModelConfig
from teralm.model.transformer import FollowerInput


class Span(NamedTuple):
    """Rows ``first .. stop-1`` of ``text``: row ``j`` reads ``text[: j + 1]`` (no answer from
    the index without ``use_index``)."""

    text: list[int]
    first: int
    stop: int
    use_index: bool = True


def online_followers(ix: Index, cfg: ModelConfig, spans: list[Span]) -> FollowerInput:
    """The rows' counted answers [N, S, ...] (``FollowerInput``, rows in the order of
    ``spans``): the ``cfg.index_followers`` most frequent followers in the index of the longest
    suffix of at most ``cfg.follower_cap`` tokens of each row's text, and of at most
    ``cfg.follower_backoff`` with that (one batched query); with ``cfg.window_order``, the
    short window's over the text's last ``cfg.window_tokens`` tokens; as training reads them
    (``teralm.train.data.counted_answers``)."""
    k, vocab = cfg.index_followers, cfg.vocab_size
    text, targets, starts = _rows(spans, cfg.follower_cap)
    using = np.concatenate([np.full(stop - first, use) for _, first, stop, use in spans])
    begins = np.where(using, np.maximum(targets - cfg.follower_cap, starts), targets)
    limits = np.full(len(targets), ix.num_tokens + 1, dtype=np.int64)  # all of the index
    caps = cfg.follower_caps
    found = ix.query.causal_followers(text, begins, targets, limits, caps, k, TRAIN_EXACT_LIMIT)
    sources = [found.at_cap(level, vocab) for level in range(len(caps))]
    if cfg.window_order:
        text, targets, starts = _rows(spans, cfg.window_tokens)
        lows = np.maximum(targets - cfg.window_tokens, starts)
        counted = window_followers(text, targets, lows, cfg.window_order, k, vocab)
        sources.append(model_input(*counted, vocab))
    columns = (np.stack(column, axis=1) for column in zip(*sources))
    return FollowerInput(*map(torch.from_numpy, columns))


def _rows(spans: list[Span], reach: int) -> tuple[np.ndarray, ...]:
    """The spans' texts, each from ``reach`` tokens before its first row's, one after another:
    ``(text, targets, starts)``, per row the position in ``text`` that it predicts (its
    context ends just before) and where its span's text starts."""
    pieces, targets, starts, offset = [], [], [], 0
    for text, first, stop, _ in spans:
        lo = max(0, first + 1 - reach)
        pieces.append(np.asarray(text[lo:stop], dtype=np.int64))
        targets.append(offset + np.arange(first + 1, stop + 1, dtype=np.int64) - lo)
        starts.append(np.full(stop - first, offset, dtype=np.int64))
        offset += stop - lo
    return np.concatenate(pieces), np.concatenate(targets), np.concatenate(starts)
