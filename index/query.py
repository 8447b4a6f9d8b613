"""The query engine: longest match, next-token distribution (the ∞-gram), attribution, and the
online matcher that gives new text the same features the corpus has in training.

All searches run over the global order (``order.positions``: positions sorted by reversed
context). The occurrences of a context's suffix form one rank range, found by one binary search
for the context's insertion point and a gallop outwards (see teralm.kernels.query); a suffix
longer than the order's depth has at most one range per shard. The tokens that follow them are
slices of ``order.follow``. A batch is one compiled call. Exact results do not depend on how the
corpus was sharded.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from teralm.errors import IndexDamaged, InputError, damaged
from teralm.index import format as fmt
from teralm.kernels import query as kq
from teralm.kernels.match import doc_start_bits, is_doc_start

if TYPE_CHECKING:
    from teralm.index.reader import Index

EXACT_LIMIT = 1 << 14
# Training's ∞-gram counts and followers, and generation's followers, sample contexts past this
# many occurrences: on pydocs a training batch's counts cost a fifth less, and the ∞-gram's
# probability of the target moved by 0.0008 on average; with EXACT_LIMIT a single stream of a
# model with followers decoded at 458 tokens/s on a 2-core CPU, with this one at 640.
TRAIN_EXACT_LIMIT = 1 << 10
SNIPPET = 60


@dataclass
class MatchResult:
    """Per context: ``length`` of the longest suffix that occurs followed by at least one more
    token of its document, ``count`` of all its occurrences, and ``ranges[c]``: the ``(lo, hi)``
    rank ranges of those occurrences in the global order (one, or one per shard for a suffix
    longer than the order's depth)."""

    length: np.ndarray
    count: np.ndarray
    ranges: list[np.ndarray]


@dataclass
class Probability:
    """The ∞-gram probability of one next token per context (see ``QueryEngine.probability``).

    ``length``, ``count``: the context's longest match (with a follower) and its occurrences;
    ``hits``: occurrences of that match followed by the token; ``prob = hits / count``.
    ``backoff_length``: the longest suffix (at most ``length``) that the token follows, -1 if
    it follows nothing; ``backoff_prob``: the same ratio for that suffix (``prob`` when the
    token follows the longest match; 0 when it follows nothing).
    """

    length: np.ndarray
    count: np.ndarray
    hits: np.ndarray
    prob: np.ndarray
    backoff_length: np.ndarray
    backoff_prob: np.ndarray


@dataclass
class Followers:
    """Next-token counts of contexts at several lengths (``QueryEngine.causal_followers``).

    Per context and length cap, ``lengths``: the length of the suffix counted (0: none occurs
    earlier), and ``totals``: its occurrences counted, ``(contexts, caps)``; ``tokens`` and
    ``counts``: its most frequent followers, most frequent first, ``(contexts, caps, k)``
    (-1 and 0 past the last)."""

    lengths: np.ndarray
    totals: np.ndarray
    tokens: np.ndarray
    counts: np.ndarray

    def at_cap(self, level: int, missing: int) -> tuple[np.ndarray, ...]:
        """``(tokens, shares, length, total)`` at cap number ``level``, as a model reads them
        (``model_input``)."""
        columns = (self.lengths, self.totals, self.tokens, self.counts)
        return model_input(*(column[:, level] for column in columns), missing)


def model_input(lengths, totals, tokens, counts, missing: int) -> tuple[np.ndarray, ...]:
    """Per context, the ``lengths``/``totals`` of a counted suffix and its top followers
    ``tokens`` [n, k] with their ``counts``, as a model reads them
    (``teralm.model.transformer.FollowerInput``, one source): ``(tokens, shares, length,
    total)``, ``missing`` for an absent follower and each follower's count over the total."""
    tokens = np.where(tokens < 0, missing, tokens)
    shares = (counts / np.maximum(totals, 1)[:, None]).astype(np.float32)
    return tokens, shares, lengths, totals


@dataclass
class Lookup:
    """One context's longest match (``length`` tokens, ``count`` occurrences), the tokens that
    follow it with their counts (most frequent first), and documents that hold it."""

    length: int
    count: int
    tokens: np.ndarray
    counts: np.ndarray
    documents: list[dict]


class QueryEngine:
    """Read-only queries over an open Index; safe to use from many processes.

    The index opens each shard's ``.prefix``, ``.follow`` and ``.keys`` with mmap; nothing is read whole.
    """

    def __init__(self, index: Index):
        self.index = index
        m = index.manifest
        self.separator = m["separator"]
        stream = index.stream
        follow_dtype = fmt.sort_dtype(stream.dtype, self.separator)
        self._tokens = [_read_only(stream.shard(k)) for k in range(len(stream.sizes))]
        order = m["order"]
        self.positions = _map(index, "positions", np.uint8)
        self.follow = _map(index, "follow", follow_dtype)
        self.buckets = _map(index, "buckets", fmt.BUCKET_DTYPE)
        self._check(fmt.bucket_problem(self.buckets, index.num_tokens))
        # for the kernels; self._tokens keeps the arrays behind the table alive
        self.corpus = (
            kq.shard_table(self._tokens),
            np.empty(0, stream.dtype),
            stream.shard_tokens,
            m["context_overlap"],
            self.positions,
            order["width"],
            self.follow,
            _map(index, "keys", fmt.KEY_DTYPE),
            self.buckets,
            order["depth"],
        )
        self._thread_local = threading.local()
        self.elem_bits = 8 * follow_dtype.itemsize

    @cached_property
    def doc_bits(self) -> np.ndarray:
        self._check(fmt.offsets_problem(self.index.offsets, self.index.num_tokens))
        return doc_start_bits(self.index.offsets, self.index.num_tokens)

    def _check(self, problem: str | None) -> None:
        if problem:
            raise damaged(self.index.directory, problem)

    def _run(self, kernel, *args):
        """Call a query kernel; a damaged file that it meets becomes an error naming the index."""
        try:
            return kernel(*args)
        except IndexDamaged as e:  # raised by the kernel, which knows no paths
            vars(self._thread_local).pop("scratch", None)  # it stopped halfway through a tally
            raise damaged(self.index.directory, str(e)) from None

    @cached_property
    def pairs(self) -> np.ndarray:
        """The followers of each byte with their counts, sorted (``kernels.query.pair_counts``),
        for one-byte matches of a byte-keyed index; empty for other indexes."""
        if self.elem_bits != 8:
            return np.zeros((0, 0, 2), dtype=np.int64)
        return kq.pair_counts(self.buckets)

    def _scratch(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-thread kernel scratch arrays: a zeroed tally and a list of tokens seen (of
        ``vocab`` entries each), and the context bounds ``[0, n]`` of a single query."""
        local = self._thread_local
        if not hasattr(local, "scratch"):
            vocab = self.index.vocab_size
            local.scratch = (
                np.zeros(vocab, np.int64),
                np.empty(vocab, np.int64),
                np.zeros(2, np.int64),
            )
        return local.scratch

    def _lookup(self, contexts, need_follower: bool, exact_limit: int, top_k: int | None):
        """Run the lookup kernel on a batch (a list of token sequences or a 2-D array)."""
        tally, seen, single = self._scratch()
        if len(contexts) == 1:  # the common single query, without list handling
            flat = np.asarray(contexts[0], dtype=np.int64).ravel()
            single[1] = flat.size
            starts = single
        elif isinstance(contexts, np.ndarray) and contexts.ndim == 2:
            flat = contexts.astype(np.int64).ravel()
            starts = np.arange(len(contexts) + 1, dtype=np.int64) * contexts.shape[1]
        else:
            flat, starts = _flatten(contexts)
        summary, ranges, range_offsets, offsets, rows, bad = self._run(
            kq.lookup,
            self.corpus,
            self.elem_bits,
            fmt.KEY_SAMPLE,
            self.pairs,
            self.doc_bits,
            self.separator,
            self.index.vocab_size,
            flat,
            starts,
            need_follower,
            exact_limit,
            top_k or 0,
            tally,
            seen,
        )
        if bad >= 0:
            vocab = self.index.vocab_size
            raise InputError(f"token {int(flat[bad])} is outside the vocabulary 0..{vocab - 1}")
        per_context = [ranges[a:b] for a, b in zip(range_offsets[:-1], range_offsets[1:])]
        return summary, per_context, offsets, rows

    def causal_counts(
        self, text, begins, ends, limits, targets, exact_limit: int = EXACT_LIMIT
    ) -> np.ndarray:
        """Per context ``text[begins[c]:ends[c]]`` (contexts may overlap), ``(length, total,
        hits)`` of the ∞-gram of position ``limits[c]`` seeing only earlier text (the context
        ends just before it; ``targets[c]`` is the token there); see
        ``teralm.kernels.query.causal_counts``."""
        return self._run(
            kq.causal_counts,
            self.corpus,
            self.elem_bits,
            fmt.KEY_SAMPLE,
            self.doc_bits,
            self.separator,
            np.asarray(text, dtype=np.int64),
            np.asarray(begins, dtype=np.int64),
            np.asarray(ends, dtype=np.int64),
            np.asarray(limits, dtype=np.int64),
            np.asarray(targets, dtype=np.int64),
            exact_limit,
        )

    def causal_followers(
        self, text, begins, ends, limits, caps, k: int, exact_limit: int = EXACT_LIMIT
    ) -> Followers:
        """Per context ``text[begins[c]:ends[c]]``, which ends just before position
        ``limits[c]``, and per length cap in ``caps`` (longest first): the longest suffix of at
        most that many tokens that occurs followed by a token before ``limits[c]``, and its
        ``k`` most frequent followers there; see ``teralm.kernels.query.causal_followers``. A
        limit past the corpus's end counts every occurrence (text the index does not hold)."""
        caps = np.asarray(caps, dtype=np.int64)
        if len(caps) == 0 or caps.min() < 1 or (np.diff(caps) > 0).any():
            raise InputError(
                f"caps must be one or more lengths of 1 or more, longest first: {caps}"
            )
        if k < 1:
            raise InputError(f"k must be at least 1, not {k}")
        return Followers(
            *self._run(
                kq.causal_followers,
                self.corpus,
                self.elem_bits,
                fmt.KEY_SAMPLE,
                self.doc_bits,
                self.separator,
                self.index.vocab_size,
                np.asarray(text, dtype=np.int64),
                np.asarray(begins, dtype=np.int64),
                np.asarray(ends, dtype=np.int64),
                np.asarray(limits, dtype=np.int64),
                caps,
                k,
                exact_limit,
            )
        )

    def longest_match(self, contexts) -> MatchResult:
        """Longest suffix of each context that occurs followed by one more token of its document."""
        summary, ranges, _, _ = self._lookup(contexts, True, 0, None)
        return MatchResult(summary[:, 0], summary[:, 1], ranges)

    def next_token_distribution(
        self, contexts, top_k: int | None = None, exact_limit: int = EXACT_LIMIT
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Tokens that follow each context's longest match, with counts, most frequent first.

        Exact when the match has at most ``exact_limit`` occurrences (a histogram of the
        ``.follow`` slices), and for one-byte matches of a byte-level index (byte-pair counts
        summed from the bucket tables at first use). Above that, counts are estimated from every ``stride``-th occurrence in sorted
        order (``stride`` = ceil(occurrences / ``exact_limit``), deterministic), each counting
        ``stride``: a count is off by less than ``stride`` times the number of sorted runs of
        that token, and a token seen fewer than ``stride`` times may be missing.
        """
        _, _, offsets, rows = self._lookup(contexts, True, exact_limit, top_k)
        if len(offsets) == 2:  # one context: all rows
            return [(rows[:, 0], rows[:, 1])]
        return [(rows[a:b, 0], rows[a:b, 1]) for a, b in zip(offsets[:-1], offsets[1:])]

    def probability(self, contexts, tokens) -> Probability:
        """∞-gram probability of ``tokens[c]`` following ``contexts[c]``, exact (range sizes).

        As infini-gram defines it, the estimate comes from the longest suffix ``s`` of the
        context that the corpus holds (here: with a follower, as in ``longest_match``):
        ``P(w) = count(s w) / count(s)``, where the end of a document takes the part of an
        end-of-document token. A token never seen after ``s`` backs off to the longest shorter
        suffix it follows (``backoff_length``, ``backoff_prob``); length 0 is the unigram
        ``count(w) / num_tokens``.
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        if len(tokens) != len(contexts):
            raise InputError(f"{len(contexts)} contexts but {len(tokens)} tokens")
        contexts = [np.asarray(c, dtype=np.int64).ravel() for c in contexts]
        longest, _, _, _ = self._lookup(contexts, True, 0, None)
        extended, _, _, _ = self._lookup(
            [np.append(c, t) for c, t in zip(contexts, tokens)], False, 0, None
        )
        length, count = longest[:, 0], longest[:, 1]
        backoff = extended[:, 0] - 1  # ``s_k w`` occurs for k = backoff and no longer suffix
        hits = np.where(backoff == length, extended[:, 1], 0)
        shorter, _, _, _ = self._lookup(
            [c[len(c) - k :] if k > 0 else c[:0] for c, k in zip(contexts, backoff)],
            False,
            0,
            None,
        )
        with np.errstate(invalid="ignore", divide="ignore"):
            prob = np.where(count > 0, hits / np.maximum(count, 1), 0.0)
            back = np.where(backoff >= 0, extended[:, 1] / np.maximum(shorter[:, 1], 1), 0.0)
        return Probability(length, count, hits, prob, backoff, back)

    def documents(self, context, k: int = 5) -> list[dict]:
        """Up to ``k`` documents containing the context's longest match: attribution."""
        match = self.longest_match([context])
        return self._documents(int(match.length[0]), match.ranges[0], k)

    def lookup(self, context, top_k: int | None = None, sources: int = 5) -> Lookup:
        """The longest match of one context, what follows it and up to ``sources`` documents
        holding it, from one search."""
        summary, ranges, _, rows = self._lookup([context], True, EXACT_LIMIT, top_k)
        length = int(summary[0, 0])
        documents = self._documents(length, ranges[0], sources) if length and sources else []
        return Lookup(length, int(summary[0, 1]), rows[:, 0], rows[:, 1], documents)

    def _documents(self, length: int, ranges: np.ndarray, k: int) -> list[dict]:
        """Up to ``k`` documents among the occurrences in ``ranges`` (rank ranges of the order)
        of a match of ``length`` tokens, with a snippet around it."""
        ix = self.index
        width = self.corpus[5]
        hits, seen = [], set()
        for lo, hi in ranges.tolist():
            last = min(hi, lo + 64 * k)
            for end in fmt.positions(self.positions[lo * width : last * width], width).tolist():
                if end >= ix.num_tokens:
                    self._check(kq.ORDER_OUT_OF_RANGE)
                doc = int(np.searchsorted(ix.offsets, end, side="right")) - 1
                if doc in seen or len(hits) >= k:
                    continue
                seen.add(doc)
                first, stop = ix.document_range(doc)
                a, b = max(first, end - length + 1 - SNIPPET), min(stop, end + 1 + SNIPPET)
                hits.append(
                    {
                        "document": doc,
                        "source": ix.document_source(doc),
                        "offset": end - length + 1 - first,
                        "length": length,
                        "snippet": ix.decode(ix.tokens(a, b)),
                    }
                )
        return hits


def _flatten(contexts) -> tuple[np.ndarray, np.ndarray]:
    """Token sequences as one int64 array and the bounds of each (``starts``, one more)."""
    parts = [np.asarray(c, dtype=np.int64).ravel() for c in contexts]
    starts = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in parts], out=starts[1:])
    return (np.concatenate(parts) if parts else np.empty(0, np.int64)), starts


def _map(index: Index, kind: str, dtype) -> np.ndarray:
    """Read-only mmap of a file of the order as a plain ndarray (numba takes those faster than
    np.memmap objects), read a page at a time (``fmt.map_for_lookups``), or read whole into
    memory when the index holds that kind resident."""
    path = fmt.order_file(index.directory, kind)
    if path.stat().st_size == 0:
        return _read_only(np.empty(0, dtype))
    return fmt.map_for_lookups(path, dtype, resident=kind in index.resident)


def _read_only(array: np.ndarray) -> np.ndarray:
    """A read-only plain ndarray view (all shard arrays share one type in the kernel)."""
    view = np.ascontiguousarray(array).view(np.ndarray)
    view.flags.writeable = False
    return view


class OnlineMatcher:
    """Causal match features of growing text (a prompt, then generated tokens) against the index.

    ``push(token)`` returns ``(match_len, next_token)`` for the text so far, as in training
    (capped at the index's ``max_match``; ``next_token`` is ``no_token`` when nothing follows).
    When the previous match's occurrence continues with the new token, the step is O(1);
    otherwise it searches afresh.
    """

    def __init__(self, index: Index, max_len: int | None = None):
        self.engine = index.query
        self.max_len = max_len or index.max_match
        self.reset()

    def reset(self) -> None:
        self.text: list[int] = []
        self.length = 0
        # a corpus position whose context matches ``length`` tokens, with a follower
        self.witness = -1

    def push(self, token: int) -> tuple[int, int]:
        return push_all([self], [token])[0]

    def copy(self) -> OnlineMatcher:
        """An independent matcher in this one's state (to try tokens ahead)."""
        twin = copy.copy(self)
        twin.text = list(self.text)
        return twin

    def extend(self, tokens) -> list[tuple[int, int]]:
        return [self.push(int(t)) for t in tokens]

    def _advance(self, token: int) -> tuple[int, int] | None:
        """Take ``token``; its features when the previous match continues (O(1)), else None:
        a search is needed."""
        ix = self.engine.index
        if not 0 <= token < ix.vocab_size:
            raise InputError(f"token {token} is outside the vocabulary 0..{ix.vocab_size - 1}")
        self.text.append(int(token))
        if len(self.text) > 2 * self.max_len:  # only the last max_len tokens can match
            del self.text[: -self.max_len]
        s = self.witness
        if s >= 0 and ix.stream.token_at(s + 1) == token:
            self.length = min(self.length + 1, self.max_len)
            follower = self._follower(s + 1)
            if follower is not None:
                self.witness = s + 1
                return self.length, follower
        return None

    def _found(self, length: int, witness: int) -> tuple[int, int]:
        """Features from a fresh search's longest match and one of its occurrences."""
        self.length, self.witness = length, witness
        if witness < 0:
            return length, self.engine.index.no_token
        return length, self._follower(witness)

    def _follower(self, p: int) -> int | None:
        ix = self.engine.index
        if p + 1 >= ix.num_tokens or is_doc_start(self.engine.doc_bits, p + 1):
            return None
        return ix.stream.token_at(p + 1)


def push_all(matchers: list[OnlineMatcher], tokens: list[int]) -> list[tuple[int, int]]:
    """``push`` one token to each matcher (all of one index), with one search for all those
    whose match does not simply continue."""
    features = [m._advance(int(t)) for m, t in zip(matchers, tokens)]
    searching = [i for i, f in enumerate(features) if f is None]
    if searching:
        engine = matchers[searching[0]].engine
        contexts = [matchers[i].text[-matchers[i].max_len :] for i in searching]
        summary, _, _, _ = engine._lookup(contexts, False, 0, None)
        for row, i in enumerate(searching):
            features[i] = matchers[i]._found(int(summary[row, 0]), int(summary[row, 3]))
    return features
