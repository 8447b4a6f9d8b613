"""The query engine: longest match, next-token distribution (the ∞-gram), attribution, and the
online matcher that gives new text the same features the corpus has in training.

All searches run over the shards' ``.prefix`` files (positions sorted by reversed context). The
suffix of a context that is ``l`` tokens long occupies one rank range per shard; the next token
narrows it (see teralm.kernels.query). Results do not depend on how the corpus was sharded.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
from teralm.index import format as fmt
from teralm.index.reader import Index
from teralm.kernels import query as kq
from teralm.kernels.match import _is_doc_start, doc_start_bits

MAX_SUPPORT = 1 << 16
SNIPPET = 60


@dataclass
class MatchResult:
    """Per context: ``length`` of the longest suffix that occurs followed by at least one more
    token of its document, ``count`` of all its occurrences, and ``ranges``: for each context a
    list of ``(shard, lo, hi)`` rank ranges of those occurrences in the shards' ``.prefix``."""

    length: np.ndarray
    count: np.ndarray
    ranges: list[list[tuple[int, int, int]]]


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

    def _reversed(self, contexts) -> tuple[np.ndarray, np.ndarray]:
        """Validated contexts, each reversed and cut where it can no longer match."""
        vocab = self.index.vocab_size
        parts = []
        for c in contexts:
            c = np.asarray(c, dtype=np.int64).ravel()
            bad = c[(c < 0) | (c >= vocab)]
            if len(bad):
                raise ValueError(f"token {int(bad[0])} is outside the vocabulary 0..{vocab - 1}")
            r = c[::-1]
            cut = np.flatnonzero(r == self.separator)  # a value no corpus token takes
            parts.append(r[: cut[0]] if len(cut) else r)
        starts = np.cumsum([0] + [len(p) for p in parts]).astype(np.int64)
        flat = np.concatenate(parts) if parts else np.empty(0, np.int64)
        return flat, starts

    def _shard_ranges(self, contexts) -> tuple[list[np.ndarray], list[np.ndarray]]:
        flat, starts = self._reversed(contexts)
        longest = int(np.diff(starts).max(initial=0))
        all_ranges, all_reached = [], []
        for s in self.shards:
            ranges = np.zeros((len(starts) - 1, longest + 1, 2), dtype=np.int64)
            reached = kq.match_ranges(
                s.tokens,
                s.tail,
                s.prefix,
                s.start,
                s.lowest,
                self.doc_bits,
                self.separator,
                flat,
                starts,
                ranges,
            )
            all_ranges.append(ranges)
            all_reached.append(reached)
        return all_ranges, all_reached

    def _followers(self, k: int, ranks: np.ndarray) -> np.ndarray:
        s = self.shards[k]
        return kq.followers(
            s.tokens,
            s.nxt,
            s.prefix,
            s.start,
            self.doc_bits,
            self.index.num_tokens,
            np.asarray(ranks, dtype=np.int64),
        )

    def _first_follower(self, k: int, lo: int, hi: int) -> tuple[int, int] | None:
        """(rank, token) of the first entry in ``[lo, hi)`` with a follower; chunks grow 4x."""
        step = 16
        while lo < hi:
            nexts = self._followers(k, np.arange(lo, min(hi, lo + step)))
            hit = np.flatnonzero(nexts >= 0)
            if len(hit):
                return lo + int(hit[0]), int(nexts[hit[0]])
            lo, step = lo + step, step * 4
        return None

    def longest_match(self, contexts) -> MatchResult:
        """Longest suffix of each context that occurs followed by one more token of its document."""
        all_ranges, all_reached = self._shard_ranges(contexts)
        lengths, counts, where = [], [], []
        for c in range(len(all_reached[0]) if all_reached else 0):
            level = max(int(r[c]) for r in all_reached)
            while level > 0:
                found = [
                    (k, int(rg[c, level, 0]), int(rg[c, level, 1]))
                    for k, (rg, r) in enumerate(zip(all_ranges, all_reached))
                    if r[c] >= level
                ]
                if any(self._first_follower(k, lo, hi) for k, lo, hi in found):
                    break
                level -= 1
            if level == 0:
                found = [(k, 0, len(s.prefix)) for k, s in enumerate(self.shards)]
            lengths.append(level)
            counts.append(sum(hi - lo for _, lo, hi in found))
            where.append(found)
        return MatchResult(
            np.array(lengths, dtype=np.int64), np.array(counts, dtype=np.int64), where
        )

    def next_token_distribution(
        self, contexts, top_k: int | None = None, max_support: int = MAX_SUPPORT
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Tokens that follow each context's longest match, with counts, most frequent first.

        Exact when the match has at most ``max_support`` occurrences. Above that, the counts are
        estimated from ``max_support`` occurrences spread evenly over the sorted ranges (the same
        every time), scaled to the total; tokens below the sample's resolution may be missing.
        """
        result = []
        for found in self.longest_match(contexts).ranges:
            total = sum(hi - lo for _, lo, hi in found)
            stride = max(1, -(-total // max_support))
            seen, offset = [], 0
            for k, lo, hi in found:  # every stride-th occurrence, counted across the ranges
                seen.append(self._followers(k, np.arange(lo + (-offset) % stride, hi, stride)))
                offset += hi - lo
            tokens = np.concatenate(seen) if seen else np.empty(0, np.int64)
            tokens, counts = np.unique(tokens[tokens >= 0], return_counts=True)
            counts = counts * stride
            order = np.lexsort((tokens, -counts))[:top_k]
            result.append((tokens[order], counts[order]))
        return result

    def documents(self, context, k: int = 5) -> list[dict]:
        """Up to ``k`` documents containing the context's longest match: attribution."""
        ix = self.index
        match = self.longest_match([context])
        length = int(match.length[0])
        hits, seen = [], set()
        for shard, lo, hi in match.ranges[0]:
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
        context = self.text[-self.max_len :]
        all_ranges, all_reached = e._shard_ranges([context])
        self.length = max(int(r[0]) for r in all_reached)
        self.witness = -1
        if self.length == 0:
            return 0, e.index.no_token
        for k, (rg, r) in enumerate(zip(all_ranges, all_reached)):
            if r[0] < self.length:
                continue
            hit = e._first_follower(k, int(rg[0, self.length, 0]), int(rg[0, self.length, 1]))
            if hit is not None:
                self.witness = e.shards[k].start + int(e.shards[k].prefix[hit[0]])
                return self.length, hit[1]
        return self.length, e.index.no_token
