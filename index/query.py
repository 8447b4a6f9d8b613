"""The query engine: longest match, next-token distribution (the ∞-gram), attribution, and the
online matcher that gives new text the same features the corpus has in training.

All searches run over the shards' ``.prefix`` files (positions sorted by reversed context). The
occurrences of a context's suffix form one rank range per shard, found by one binary search for
the context's insertion point and a gallop outwards (see teralm.kernels.query). A batch is one
compiled call. Results do not depend on how the corpus was sharded.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
from teralm.index import format as fmt
from teralm.index.reader import Index
from teralm.kernels import query as kq
from teralm.kernels.match import _is_doc_start, doc_start_bits

MAX_SUPPORT = 4096
SNIPPET = 60


@dataclass
class MatchResult:
    """Per context: ``length`` of the longest suffix that occurs followed by at least one more
    token of its document, ``count`` of all its occurrences, and ``ranges[c, shard]``: the
    ``(lo, hi)`` rank range of those occurrences in each shard's ``.prefix``."""

    length: np.ndarray
    count: np.ndarray
    ranges: np.ndarray


@dataclass
class _Shard:
    start: int
    tokens: np.ndarray
    tail: np.ndarray
    nxt: np.ndarray
    prefix: np.ndarray
    lowest: int


class QueryEngine:
    """Read-only queries over an open Index; safe to use from many processes."""

    def __init__(self, index: Index):
        self.index = index
        self.separator = index.manifest["separator"]
        overlap = index.manifest["context_overlap"]
        stream = index.stream
        self.shards = []
        for k, size in enumerate(stream.sizes):
            start = k * stream.shard_tokens
            lowest = max(0, start - overlap)
            after = stream[start + size : start + size + 1]
            self.shards.append(
                _Shard(
                    start,
                    stream.shard(k),
                    stream[lowest:start],
                    after if len(after) else np.zeros(1, stream.dtype),
                    np.memmap(
                        fmt.shard_file(index.directory, k, "prefix"),
                        dtype=fmt.PREFIX_DTYPE,
                        mode="r",
                    )
                    if size
                    else np.empty(0, fmt.PREFIX_DTYPE),
                    lowest,
                )
            )

    @cached_property
    def doc_bits(self) -> np.ndarray:
        return doc_start_bits(self.index.offsets, self.index.num_tokens)

    @cached_property
    def _shard_arrays(self) -> tuple:
        """The shards' arrays as tuples (cheap to pass to numba, unlike lists), built once."""
        return (
            tuple(
                (
                    np.asarray(s.tokens),
                    np.ascontiguousarray(s.tail),
                    np.asarray(s.prefix),
                    s.start,
                    s.lowest,
                )
                for s in self.shards
            ),
            tuple(np.ascontiguousarray(s.nxt) for s in self.shards),
            np.fromfile(self.index.directory / fmt.BUCKETS, dtype=fmt.BUCKET_DTYPE).reshape(
                len(self.shards), fmt.NUM_BUCKETS + 1
            ),
            8 * fmt.sort_dtype(self.index.stream.dtype, self.separator).itemsize,
        )

    def _lookup(self, contexts, need_follower: bool, max_support: int, top_k: int | None):
        """Run the lookup kernel on a batch (a list of token sequences or a 2-D array)."""
        if len(contexts) == 1:  # the common single query, without list handling
            flat = np.asarray(contexts[0], dtype=np.int64).ravel()
            starts = np.array([0, flat.size], dtype=np.int64)
        elif isinstance(contexts, np.ndarray) and contexts.ndim == 2:
            flat = contexts.astype(np.int64).ravel()
            starts = np.arange(0, flat.size + 1, max(contexts.shape[1], 1), dtype=np.int64)
            starts = starts[: len(contexts) + 1]
        else:
            parts = [np.asarray(c, dtype=np.int64).ravel() for c in contexts]
            starts = np.zeros(len(parts) + 1, dtype=np.int64)
            np.cumsum([len(p) for p in parts], out=starts[1:])
            flat = np.concatenate(parts) if parts else np.empty(0, np.int64)
        *match, witness, offsets, tokens, counts, bad = kq.lookup(
            *self._shard_arrays,
            self.doc_bits,
            self.separator,
            self.index.num_tokens,
            self.index.vocab_size,
            flat,
            starts,
            need_follower,
            max_support,
            top_k or 0,
        )
        if bad >= 0:
            vocab = self.index.vocab_size
            raise ValueError(f"token {int(flat[bad])} is outside the vocabulary 0..{vocab - 1}")
        return MatchResult(*match), witness, (offsets, tokens, counts)

    def longest_match(self, contexts) -> MatchResult:
        """Longest suffix of each context that occurs followed by one more token of its document."""
        return self._lookup(contexts, True, 0, None)[0]

    def next_token_distribution(
        self, contexts, top_k: int | None = None, max_support: int = MAX_SUPPORT
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Tokens that follow each context's longest match, with counts, most frequent first.

        Exact when the match has at most ``max_support`` occurrences, and for one-byte matches
        of a byte-level index (read off the bucket table). Otherwise, above that, the counts are
        estimated from every ``stride``-th occurrence in sorted order (``stride`` = occurrences /
        ``max_support`` rounded up; the same every time), each counting ``stride``; a token seen
        fewer than ``stride`` times may be missing.
        """
        _, _, (offsets, tokens, counts) = self._lookup(contexts, True, max_support, top_k)
        return [(tokens[a:b], counts[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]

    def documents(self, context, k: int = 5) -> list[dict]:
        """Up to ``k`` documents containing the context's longest match: attribution."""
        ix = self.index
        match = self.longest_match([context])
        length = int(match.length[0])
        hits, seen = [], set()
        for shard, (lo, hi) in enumerate(match.ranges[0]):
            for i in range(lo, min(hi, lo + 64 * k)):
                end = self.shards[shard].start + int(self.shards[shard].prefix[i])
                doc = int(np.searchsorted(ix.offsets, end, side="right")) - 1
                if doc in seen or len(hits) >= k:
                    continue
                seen.add(doc)
                start, stop = ix.document_range(doc)
                a, b = max(start, end - length + 1 - SNIPPET), min(stop, end + 1 + SNIPPET)
                hits.append(
                    {
                        "document": doc,
                        "source": ix.document_source(doc),
                        "offset": end - length + 1 - start,
                        "length": length,
                        "snippet": ix.decode(ix.tokens(a, b)),
                    }
                )
        return hits


class OnlineMatcher:
    """Causal match features of growing text (a prompt, then generated tokens) against the index.

    ``push(token)`` returns ``(match_len, next_token)`` for the text so far, as in training
    (capped at the index's ``max_match``; ``next_token`` is ``no_token`` when nothing follows).
    When the previous match's occurrence continues with the new token, the step is O(1);
    otherwise it searches afresh.
    """

    def __init__(self, engine: QueryEngine, max_len: int | None = None):
        self.engine = engine
        self.max_len = max_len or engine.index.max_match
        self.reset()

    def reset(self) -> None:
        self.text: list[int] = []
        self.length = 0
        self.witness = (
            -1
        )  # a corpus position whose context matches ``length`` tokens, with a follower

    def push(self, token: int) -> tuple[int, int]:
        ix = self.engine.index
        if not 0 <= token < ix.vocab_size:
            raise ValueError(f"token {token} is outside the vocabulary 0..{ix.vocab_size - 1}")
        self.text.append(int(token))
        s = self.witness
        if s >= 0 and int(ix.stream[s + 1 : s + 2][0]) == token:
            self.length = min(self.length + 1, self.max_len)
            follower = self._follower(s + 1)
            if follower is not None:
                self.witness = s + 1
                return self.length, follower
        return self._search()

    def extend(self, tokens) -> list[tuple[int, int]]:
        return [self.push(int(t)) for t in tokens]

    def _follower(self, p: int) -> int | None:
        ix = self.engine.index
        if p + 1 >= ix.num_tokens or _is_doc_start(self.engine.doc_bits, p + 1):
            return None
        return int(ix.stream[p + 1 : p + 2][0])

    def _search(self) -> tuple[int, int]:
        e = self.engine
        match, witness, _ = e._lookup([self.text[-self.max_len :]], False, 0, None)
        self.length, self.witness = int(match.length[0]), int(witness[0])
        if self.witness < 0:
            return self.length, e.index.no_token
        return self.length, self._follower(self.witness)
