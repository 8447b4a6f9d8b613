"""The index's followers of text being generated, as a model with ``index_followers`` reads them.

Training and evaluation count the followers of a position's context among the occurrences that
end before it (``teralm.train.data.causal_followers``); text that is being generated is not in
the index, so all of the index lies before it and every occurrence counts.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from teralm.index import Index
from teralm.model import ModelConfig
from teralm.model.transformer import FollowerInput


class Span(NamedTuple):
    """Rows ``first .. stop-1`` of ``text``: row ``j`` reads ``text[: j + 1]`` (the followers
    of nothing without ``use_index``)."""

    text: list[int]
    first: int
    stop: int
    use_index: bool = True


def online_followers(ix: Index, cfg: ModelConfig, spans: list[Span]) -> FollowerInput:
    """The rows' followers [N, ...] (``FollowerInput``, rows in the order of ``spans``): the
    ``cfg.index_followers`` most frequent followers in the index of the longest suffix of at
    most ``cfg.follower_cap`` tokens of each row's text, from one batched query."""
    cap = cfg.follower_cap
    pieces, begins, ends, offset = [], [], [], 0
    for text, first, stop, use_index in spans:
        lo = max(0, first + 1 - cap)
        pieces.append(np.asarray(text[lo:stop], dtype=np.int64))
        end = offset + np.arange(first, stop, dtype=np.int64) + 1 - lo
        begins.append(np.maximum(end - cap, offset) if use_index else end)
        ends.append(end)
        offset += len(pieces[-1])
    ends_all = np.concatenate(ends)
    limits = np.full(len(ends_all), ix.num_tokens + 1, dtype=np.int64)  # all of the index
    found = ix.query.causal_followers(
        np.concatenate(pieces),
        np.concatenate(begins),
        ends_all,
        limits,
        (cap,),
        cfg.index_followers,
    )
    return FollowerInput(*map(torch.from_numpy, found.first_cap(cfg.vocab_size)))
