"""The generation engine: one model and one index shared by every sequence.

A worker thread owns the model and a KV cache preallocated for ``max_batch`` sequences; running
sequence ``i`` lives in cache slot ``i`` (a finished one's slot goes to the last running
sequence). Each loop the engine admits waiting sequences (requests take turns, and when the
batch is full, a request holding more than its fair share gives places to waiting requests that
hold less: the preempted sequence keeps a copy of its cache entries and goes on where it stopped
when it is admitted again; prompts that fit the window go through the model together, in one
call per ``MAX_ROWS`` new tokens), samples
the next tokens of every running sequence, looks the newest up in the index (the online
matcher, so the model sees the features it was trained with), then runs one batched
forward of the new tokens with one batched ∞-gram query. A sequence whose context reached
``max_seq_len`` restarts its cache from the second half of its context.

Speculation: where the index's longest match is long, the tokens that follow it in the corpus
are likely next. The engine drafts up to ``speculate`` of them and runs them in the same forward
as the newest token, then samples each drafted position as it would without drafts and keeps
the draft where the sampled token equals it (with a one-hot proposal, speculative sampling's
test keeps a draft with the probability the sampler gives it, and this is that test). The
output is the same tokens as without drafts, seeded or greedy, whatever else runs in the batch,
and one forward can yield several tokens. A rejected draft's cache entries are dropped.

Prompts that begin as a recent one reuse its cached keys and values (teralm.infer.prefix_cache)
and run only the rest through the model. Callers talk to the engine through
``Sequence`` objects: events come back through a callback, ``cancel()`` stops one. Work on one
sequence that fails ends that sequence alone, with an error event; a failed batched step ends
the sequences in it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from teralm.errors import InputError
from teralm.index import Index
from teralm.index.knn import KnnDatastore
from teralm.index.query import OnlineMatcher, push_all
from teralm.infer.decoder import MAX_ROWS, Decoded, Decoder
from teralm.infer.followers import Span, online_followers
from teralm.infer.mixture import infgram_probs, knn_mixed_logp, next_token_logp
from teralm.infer.precision import autocast
from teralm.infer.prefix_cache import PrefixCache
from teralm.infer.sampling import Sampling, sample_token, sample_tokens
from teralm.model import Transformer
from teralm.model.kv_cache import KVCache

log = logging.getLogger("teralm.engine")


@dataclass
class TokenEvent:
    """One token: its id, log-probability, the top alternatives, and whether it is a prompt
    token (echo). ``finish`` is set on the sequence's last event ("length", or "error" with the
    ``error``'s message). ``index``: what the index did for a generated token, when its
    sequence asked (``Sampling.index_view``)."""

    token: int | None
    logprob: float | None = None
    top: dict[int, float] | None = None
    prompt: bool = False
    finish: str | None = None
    error: str | None = None
    index: TokenIndex | None = None


@dataclass(frozen=True)
class TokenIndex:
    """What the index did for one generated token: the longest match of the context before it
    (the length the model read) and the token that followed that match in the corpus, which
    the index proposed (None: nothing followed it); the ∞-gram's probability of the token and
    how many continuations it counted (None and 0 when it counted none); the weight the model's
    mixture gate gave the ∞-gram (None without a gate or an ∞-gram count); and the kNN
    neighbours as (corpus position, squared distance), nearest first."""

    match_length: int
    proposed: int | None
    infgram_prob: float | None
    infgram_count: int
    gate: float | None
    neighbours: list[tuple[int, float]]


@dataclass
class RowView:
    """What the index gave one row of the model's output (see TokenIndex), before the token
    that follows it is sampled."""

    features: tuple[int, int]
    infgram: torch.Tensor | None = None  # [vocab]
    infgram_count: int = 0
    gate: float | None = None
    neighbours: list[tuple[int, float]] = field(default_factory=list)


class Draft(NamedTuple):
    """A token the index proposes, its (match length, next token) features and the matcher's
    state once it is taken."""

    token: int
    features: tuple[int, int]
    matcher: OnlineMatcher


@dataclass
class Sequence:
    """A prompt to continue. Without ``use_index`` the model sees "no match" everywhere and no
    ∞-gram is mixed in (the ablation)."""

    prompt: list[int]
    sampling: Sampling
    on_event: Callable[[TokenEvent], None]
    use_index: bool = True
    tokens: list[int] = field(default_factory=list)
    features: list[tuple[int, int]] = field(default_factory=list)
    generated: int = 0
    cancelled: bool = False
    done: bool = False
    logp: torch.Tensor | None = None  # [1 + drafts, vocab]: after the newest token and each draft
    views: list[RowView] | None = None  # for each row of logp, when the sampling asks
    drafts: list[Draft] = field(default_factory=list)
    matcher: OnlineMatcher | None = None
    generator: torch.Generator | None = None
    request: int = -1  # which request it belongs to (the waiting room numbers them)
    saved: tuple | None = None  # its cache entries while it waits after preemption

    def cancel(self) -> None:
        """Stop generating (client gone, stop string found, timeout); no more events."""
        self.cancelled = True


class WaitingRoom:
    """Sequences waiting for a place in the batch, grouped by request. ``get`` takes the next
    sequence of the waiting request that holds the fewest places (the earliest among equals),
    so requests take turns, and one with many sequences cannot hold back the others."""

    def __init__(self):
        self._requests: dict[int, deque[Sequence]] = {}  # in order of arrival
        self._changed = threading.Condition()
        self._size = 0
        self._next_request = 0

    def __len__(self) -> int:
        return self._size

    def put(self, seqs: list[Sequence]) -> None:
        """Queue one request's sequences."""
        if not seqs:
            return
        with self._changed:
            for seq in seqs:
                seq.request = self._next_request
            self._requests[self._next_request] = deque(seqs)
            self._next_request += 1
            self._size += len(seqs)
            self._changed.notify()

    def put_back(self, seq: Sequence) -> None:
        """Queue a sequence taken out of the batch first among its request's."""
        with self._changed:
            self._requests.setdefault(seq.request, deque()).appendleft(seq)
            self._size += 1

    def counts(self) -> dict[int, int]:
        """How many sequences each waiting request has queued."""
        with self._changed:
            return {r: len(q) for r, q in self._requests.items()}

    def get(self, timeout: float, held: Counter[int]) -> Sequence | None:
        """The next sequence of the request with the fewest places ``held``; None if none
        came within ``timeout`` seconds."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._requests, timeout):
                return None
            request = min(self._requests, key=lambda r: held[r])
            queue = self._requests[request]
            seq = queue.popleft()
            if not queue:
                del self._requests[request]
            self._size -= 1
            return seq


@dataclass
class EngineStats:
    tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of prompt_tokens, those whose keys and values were reused
    drafted: int = 0
    accepted: int = 0
    model_s: float = 0.0
    lookup_s: float = 0.0


DRAFT_MIN_MATCH = 8  # draft only what follows a match at least this long
DRAFT_TOKENS = 8  # the most drafts per sequence and step
DRAFT_ROWS = 16  # drafts fill a step up to this many rows (a large batch gains nothing)
PREFIX_CACHE_BYTES = 256 << 20


class Engine:
    """``speculate``: the most drafted tokens per sequence and step (0: none; default: as many
    as ``DRAFT_TOKENS`` with the fused CPU decoder, where a few more rows cost little, else
    none). ``prefix_cache``: bytes of recent prompts' keys and values kept for reuse (0: none).
    ``knn``: a datastore of the model's hidden states, mixed in as calibrated for the model as
    served, for sequences that use the index. ``threads``: the fused decoder's (default: one
    per core)."""

    def __init__(
        self,
        model: Transformer,
        index: Index,
        max_batch: int = 16,
        speculate: int | None = None,
        prefix_cache: int = PREFIX_CACHE_BYTES,
        knn: KnnDatastore | None = None,
        threads: int | None = None,
    ):
        self.model = model.eval()
        self.index = index
        self.knn = knn
        self.device = next(model.buffers()).device
        self.precision = model.cfg.precision
        dtype = torch.float32 if self.precision == "fp32" else torch.bfloat16
        self.cache = KVCache(model.cfg, max_batch, self.device, dtype)
        self.decoder = Decoder(model, self.cache, threads=threads)
        self.speculate = (
            (DRAFT_TOKENS if self.decoder.fused else 0) if speculate is None else speculate
        )
        self.prefixes = PrefixCache(prefix_cache) if prefix_cache else None
        self.max_batch = max_batch
        self.waiting = WaitingRoom()
        self.active: list[Sequence] = []  # active[i] is cached in slot i
        self.stats = EngineStats()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="teralm-engine", daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    def submit(self, seqs: list[Sequence]) -> None:
        """Queue one request's sequences; requests take turns for places in the batch."""
        self.waiting.put(seqs)

    def generate(self, prompts: list[list[int]], sampling: Sampling, use_index: bool = True):
        """Continue every prompt (blocking): the generated tokens of each; InputError if one
        failed."""
        outputs: list[list[int]] = [[] for _ in prompts]
        errors: list[str] = []
        finished = threading.Semaphore(0)

        def collector(out: list[int]) -> Callable[[TokenEvent], None]:
            def on_event(event: TokenEvent) -> None:
                if event.token is not None and not event.prompt:
                    out.append(event.token)
                if event.error:
                    errors.append(event.error)
                if event.finish:
                    finished.release()

            return on_event

        self.submit(
            [Sequence(list(p), sampling, collector(o), use_index) for p, o in zip(prompts, outputs)]
        )
        for _ in prompts:
            finished.acquire()
        if errors:
            raise InputError(errors[0])
        return outputs

    @torch.inference_mode()
    def neighbours(self, context: list[int]) -> list[dict]:
        """The kNN datastore's neighbours of the model's state after ``context`` (its last
        window), as the documents they come from; [] without a datastore. Safe to call from
        any thread: it runs the model without the cache."""
        if self.knn is None or not context:
            return []
        context = context[-self.model.cfg.max_seq_len :]
        lengths, nexts = zip(*OnlineMatcher(self.index).extend(context))
        columns = (torch.tensor([xs], device=self.device) for xs in (context, nexts, lengths))
        with autocast(self.device, self.precision):
            hidden = self.model.hidden(*columns)[0, -1:].float().cpu().numpy()
        return self.knn.sources(self.knn.search(hidden))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.decoder.close()

    # -- the worker thread -------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stop.is_set():
            self._admit()
            self._sample_all()
            self._retire()
            self._look_up(self.active)
            if self.active:
                self._decode()

    def _admit(self) -> None:
        """Take waiting sequences into free slots (``_preempt`` frees some first when a waiting
        request holds less than its share). Prompts that fit the window (and are not echoed)
        run through the model together, new tokens of up to ``MAX_ROWS`` of them a call
        (``_prefill_group``); the others one by one (``_prefill``); a preempted sequence gets
        its cache entries back and goes on where it stopped."""
        held = self._preempt()
        group: list[tuple[Sequence, int, int]] = []  # (sequence, slot, tokens found cached)
        group_rows = 0  # new tokens of the group's prompts
        while len(self.active) < self.max_batch:
            if self.active and not self.waiting:  # nothing to admit: no lock, no wait
                break
            seq = self.waiting.get(0.05 if not self.active else 0, held)
            if seq is None:
                break
            if seq.cancelled:
                continue
            slot = len(self.active)
            held[seq.request] += 1
            if seq.saved is not None:
                self._prefill_group(group)
                group, group_rows = [], 0
                self.cache.restore(slot, seq.saved)
                seq.saved = None
            elif seq.sampling.echo or len(seq.prompt) > self.model.cfg.max_seq_len:
                self._prefill_group(group)
                group, group_rows = [], 0
                self._try(seq, self._prefill, slot)
            else:
                reused = self._try(seq, self._reuse_prefix, slot)
                if reused is not None:
                    rows = len(seq.prompt) - reused
                    if group and group_rows + rows > MAX_ROWS:
                        self._prefill_group(group)
                        group, group_rows = [], 0
                    group.append((seq, slot, reused))
                    group_rows += rows
            if not seq.done:  # done already: it failed, or has max_tokens 0
                self.active.append(seq)
        self._prefill_group(group)

    def _preempt(self) -> Counter[int]:
        """Fair shares of a full batch: while a waiting request holds fewer than ``max_batch``
        / (requests running or waiting) places, the request holding the most gives up its
        newest sequence (its cache entries are kept with it, and it waits first among its
        request's). So a new request gets places at the next step, whatever another asked for.
        The places each request holds, after it."""
        held = Counter(s.request for s in self.active)
        if len(self.active) < self.max_batch or not self.waiting:
            return held
        waiting = self.waiting.counts()
        share = max(1, self.max_batch // len(held.keys() | waiting.keys()))
        wanted = sum(min(n, share - held[r]) for r, n in waiting.items() if held[r] < share)
        for _ in range(wanted):
            request, most = held.most_common(1)[0]
            if most <= share:
                break
            slot = max(i for i, s in enumerate(self.active) if s.request == request)
            seq = self.active[slot]
            seq.saved = self.cache.save(slot)
            self._release(slot)
            held[request] -= 1
            self.waiting.put_back(seq)
        return held

    def _retire(self) -> None:
        """Drop finished sequences."""
        i = 0
        while i < len(self.active):
            if not (self.active[i].done or self.active[i].cancelled):
                i += 1
                continue
            self._release(i)

    def _release(self, slot: int) -> None:
        """Take the sequence in ``slot`` out of the batch; the last running one takes the slot."""
        last = self.active.pop()
        if slot < len(self.active):
            self.cache.move(len(self.active), slot)
            self.active[slot] = last

    def _try(self, seq: Sequence, work: Callable, *args):
        """``work(seq, *args)``'s answer; if it raises, that sequence ends with an error event
        (and None comes back) and the others go on."""
        try:
            return work(seq, *args)
        except Exception as e:
            self._fail(seq, e)
            return None

    def _fail(self, seq: Sequence, error: Exception) -> None:
        log.error("generation failed", exc_info=error)
        seq.done = True
        seq.on_event(TokenEvent(None, finish="error", error=str(error) or type(error).__name__))

    def _look_up(self, seqs: list[Sequence]) -> None:
        """The index features of every sequence's newest token, from one batched search."""
        using = [s for s in seqs if s.use_index]
        for seq in seqs:
            if not seq.use_index:
                seq.features.append((0, self.index.no_token))
        if not using:
            return
        began = time.perf_counter()
        try:
            found = push_all([s.matcher for s in using], [s.tokens[-1] for s in using])
        except Exception as e:
            for seq in using:
                self._fail(seq, e)
            self._retire()
            return
        for seq, features in zip(using, found):
            seq.features.append(features)
        self.stats.lookup_s += time.perf_counter() - began

    def _start(self, seq: Sequence) -> None:
        """A new sequence's tokens, sampler and matcher, and its prompt's index features."""
        seq.matcher = OnlineMatcher(self.index)
        seq.generator = seq.sampling.generator()
        seq.tokens = list(seq.prompt)
        if seq.use_index:
            began = time.perf_counter()
            seq.features = seq.matcher.extend(seq.prompt)
            self.stats.lookup_s += time.perf_counter() - began
        else:
            seq.features = [(0, self.index.no_token)] * len(seq.prompt)
        self.stats.prompt_tokens += len(seq.prompt)

    def _ready(self, seq: Sequence, logp: torch.Tensor, views: list | None) -> None:
        """A prompt is cached: ``logp`` [1, vocab] is what follows it (``views``: its row's)."""
        seq.logp, seq.views = logp, views
        if seq.sampling.max_tokens == 0:
            seq.done = True
            seq.on_event(TokenEvent(None, finish="length"))

    def _prefill(self, seq: Sequence, slot: int) -> None:
        """Cache a prompt that is echoed or longer than the window in ``slot`` on its own."""
        self._start(seq)
        window, n = self.model.cfg.max_seq_len, len(seq.tokens)
        if seq.sampling.echo:  # the first token has nothing before it to be scored on
            seq.on_event(TokenEvent(seq.tokens[0], None, None, prompt=True))
        start = 0 if seq.sampling.echo else max(0, n - window)
        while True:  # past one window, as generation goes on: from the previous one's half
            stop = min(n, start + window)
            out = self._forward(seq, slot, start, stop)
            if seq.sampling.echo:
                self._echo(seq, start + window // 2 if start else 1, start, out)
            if stop == n:
                break
            start = stop - window // 2
        infgram = self._infgram([seq], [seq.tokens])
        last = slice(-1, None)
        self._ready(seq, *self._next_logp([seq], out, infgram, last, [seq.features[-1]]))

    def _reuse_prefix(self, seq: Sequence, slot: int) -> int:
        """Start a prompt that fits the window in ``slot`` with the keys and values of its
        longest cached prefix: how many tokens that is (0 without a prefix cache)."""
        self._start(seq)
        if self.prefixes is None:
            self.cache.lengths[slot] = 0
            return 0
        reused = self.prefixes.load(seq.tokens, seq.use_index, self.cache, slot)
        self.stats.cached_prompt_tokens += reused
        return reused

    def _prefill_group(self, group: list[tuple[Sequence, int, int]]) -> None:
        """The rest of the prompts in ``group`` (sequences in consecutive slots, with how many
        of their tokens ``_reuse_prefix`` found cached) in one call of the model and one
        ∞-gram query. A failure ends the sequences of the group."""
        if not group:
            return
        seqs, first = [seq for seq, _, _ in group], group[0][1]
        counts = [len(seq.tokens) - reused for seq, _, reused in group]
        tokens = [t for seq, _, reused in group for t in seq.tokens[reused:]]
        features = [f for seq, _, reused in group for f in seq.features[reused:]]
        spans = [Span(s.tokens, reused, len(s.tokens), s.use_index) for s, _, reused in group]
        try:
            last = torch.tensor(counts).cumsum(0) - 1
            contexts = [seq.tokens for seq in seqs]
            rows = (tokens, features, counts, spans)
            logp, views = self._run_and_mix(seqs, contexts, *rows, first, last)
        except Exception as e:
            for seq in seqs:
                self._fail(seq, e)
            return
        for i, (slot, seq) in enumerate(enumerate(seqs, first)):
            if self.prefixes is not None:
                self.prefixes.store(seq.tokens, seq.use_index, self.cache, slot)
            self._ready(seq, logp[i : i + 1], views and views[i : i + 1])

    def _forward(self, seq: Sequence, slot: int, start: int, stop: int) -> Decoded:
        """Cache ``tokens[start:stop]`` afresh in ``slot``: the decoder's output on them."""
        self.cache.lengths[slot] = 0
        features = seq.features[start:stop]
        spans = [Span(seq.tokens, start, stop, seq.use_index)]
        return self._run_model(seq.tokens[start:stop], features, [stop - start], spans, slot)

    def _run_model(self, tokens, features, counts, spans, first=0, alongside=None) -> Decoded:
        """The decoder on new tokens with their (match length, next token) features and, for a
        model that reads them, the index's followers of their ``spans`` (with their hidden
        states when a kNN datastore is mixed in), doing ``alongside`` meanwhile."""
        followers = self._followers(spans)
        began = time.perf_counter()
        with autocast(self.device, self.precision):
            lengths, nexts = zip(*features)
            keep_hidden = self.knn is not None
            rows = (tokens, nexts, lengths, counts, first)
            out = self.decoder.decode(*rows, keep_hidden, alongside, followers)
        self.stats.model_s += time.perf_counter() - began
        return out

    def _followers(self, spans: list[Span]):
        """The index's followers of the rows of ``spans`` (``online_followers``), timed as
        lookup; None for a model that does not read them."""
        if not self.model.cfg.index_followers:
            return None
        began = time.perf_counter()
        followers = online_followers(self.index, self.model.cfg, spans)
        self.stats.lookup_s += time.perf_counter() - began
        return followers

    def _run_and_mix(
        self, owners, contexts, tokens, features, counts, spans, first=0, rows=slice(None)
    ):
        """``_next_logp`` after ``rows`` of the decoder's output on new tokens (``_run_model``),
        with the ∞-gram query after ``contexts`` made while the decoder's other threads run."""
        infgram = []

        def query() -> None:
            infgram.append(self._infgram(owners, contexts))

        out = self._run_model(tokens, features, counts, spans, first, query)
        picked = features if isinstance(rows, slice) else [features[int(i)] for i in rows]
        return self._next_logp(owners, out, infgram[0], rows, picked)

    def _next_logp(self, owners: list[Sequence], out: Decoded, infgram, rows, features=None):
        """Log-probabilities of the next token after ``rows`` of the decoder's output [R, vocab]
        (row ``r`` belongs to ``owners[r]``): the model's, mixed with the ∞-gram's (``infgram``:
        ``_infgram``'s answer for the rows) and the kNN datastore's (one search) for sequences
        that use the index. With the rows' input ``features``, also each row's ``RowView``
        when an owner asks for them (else None)."""
        gate = None if out.gate is None else out.gate[rows]
        logp = next_token_logp(self.model, out.logits[rows], gate, infgram)
        using = [r for r, seq in enumerate(owners) if seq.use_index]
        found = None
        if self.knn is not None and using:
            began = time.perf_counter()
            found = self.knn.search(out.hidden[rows][using].numpy())
            mix = self.knn.calibration["model"]
            logp[using] = knn_mixed_logp(
                logp[using], found.tokens, found.distances, mix["temperature"], mix["lam"]
            )
            self.stats.lookup_s += time.perf_counter() - began
        if features is None or not any(seq.sampling.index_view for seq in owners):
            return logp, None
        return logp, self._row_views(features, gate, infgram, using, found)

    def _row_views(self, features, gate, infgram, using, found) -> list[RowView]:
        """``RowView`` of each row (``_next_logp``'s parts): the features the model read, the
        ∞-gram, the gate's weight for it, the kNN neighbours (rows ``using``)."""
        views = [RowView((int(length), int(follower))) for length, follower in features]
        if infgram is not None:
            probs, totals = infgram
            weights = None
            if gate is not None:  # the ∞-gram's weight: sigmoid(-logit), as mixture_logp mixes
                weights = torch.sigmoid(-self.model.gate_logit(gate.float(), totals)).tolist()
            for r, view in enumerate(views):
                if totals[r] > 0:
                    view.infgram, view.infgram_count = probs[r], int(totals[r])
                    view.gate = None if weights is None else weights[r]
        if found is not None:
            for i, r in enumerate(using):
                near = [(int(p), float(d)) for p, d in zip(found.positions[i], found.distances[i])]
                views[r].neighbours = [(p, d) for p, d in near if p >= 0]
        return views

    def _infgram(self, seqs: list[Sequence], contexts: list[list[int]]):
        """The ∞-gram's answer after each context (row ``b`` of ``seqs[b]``) for the mixture
        (``infgram_probs``; nothing counted for sequences that do not use the index), from one
        query timed as lookup; None when the model mixes none in or no sequence uses it."""
        if self.model.mixture_gate is None or not any(s.use_index for s in seqs):
            return None
        began = time.perf_counter()
        probs, totals = infgram_probs(self.index, contexts)
        totals[torch.tensor([not s.use_index for s in seqs])] = 0
        self.stats.lookup_s += time.perf_counter() - began
        return probs, totals

    def _echo(self, seq: Sequence, first: int, start: int, out: Decoded) -> None:
        """Events for prompt tokens ``first ..`` of a window cached from ``start`` (row ``r`` of
        ``out`` predicts token ``start + r + 1``): each token's log-probability given those
        before it."""
        stop = start + out.logits.shape[0]
        if first >= stop:
            return
        rows = slice(first - 1 - start, stop - 1 - start)
        tails = [seq.tokens[max(0, p - self.index.max_match) : p] for p in range(first, stop)]
        owners = [seq] * len(tails)
        logp, _ = self._next_logp(owners, out, self._infgram(owners, tails), rows)
        for token, row in zip(seq.tokens[first:stop], logp):
            seq.on_event(TokenEvent(token, float(row[token]), self._top(seq, row), True))

    def _top(self, seq: Sequence, logp: torch.Tensor) -> dict[int, float] | None:
        n = seq.sampling.logprobs
        if not n:
            return None
        values, ids = torch.topk(logp, min(n, logp.shape[0]))
        return {int(i): float(v) for i, v in zip(ids, values)}

    def _sample_all(self) -> None:
        """Every running sequence's next tokens: those without drafts sampled together (one
        at a time if that fails, so that a sequence whose settings fail fails alone)."""
        plain = [s for s in self.active if not (s.done or s.cancelled or s.drafts)]
        tokens = []
        try:
            if plain:
                samplings, generators = [s.sampling for s in plain], [s.generator for s in plain]
                tokens = sample_tokens(torch.cat([s.logp for s in plain]), samplings, generators)
        except Exception:
            plain = []
        for seq, token in zip(plain, tokens):
            self._try(seq, self._emit, token, seq.logp[0], seq.views and seq.views[0])
        sampled = {id(s) for s in plain}
        for slot, seq in enumerate(self.active):
            if id(seq) not in sampled:
                self._try(seq, self._sample, slot)

    def _sample(self, seq: Sequence, slot: int) -> None:
        """The next token, or several when drafts are kept: the position after the newest token
        and after each kept draft is sampled in turn, until the sampled token differs from the
        draft (it replaces it) or all drafts are kept (one more token is sampled after them).
        The cache keeps the entries of kept drafts only."""
        if seq.done or seq.cancelled:
            return
        kept = 0
        for row, logp in enumerate(seq.logp):
            draft = seq.drafts[row] if row < len(seq.drafts) else None
            token = sample_token(logp, seq.sampling, seq.generator)
            self._emit(seq, token, logp, seq.views and seq.views[row])
            if draft is None or token != draft.token or seq.done or seq.cancelled:
                break
            kept += 1
            seq.matcher = draft.matcher
            seq.features.append(draft.features)
        self.cache.lengths[slot] -= len(seq.drafts) - kept
        self.stats.drafted += len(seq.drafts)
        self.stats.accepted += kept
        seq.drafts = []

    def _emit(self, seq: Sequence, token: int, logp: torch.Tensor, view: RowView | None) -> None:
        seq.tokens.append(token)
        seq.generated += 1
        self.stats.tokens += 1
        finish = "length" if seq.generated >= seq.sampling.max_tokens else None
        index = None if view is None else self._token_index(view, token)
        top = self._top(seq, logp)
        event = TokenEvent(token, float(logp[token]), top, finish=finish, index=index)
        seq.done = finish is not None
        seq.on_event(event)

    def _token_index(self, view: RowView, token: int) -> TokenIndex:
        """What the index did for ``token``, sampled after the row ``view`` describes."""
        length, follower = view.features
        return TokenIndex(
            match_length=length,
            proposed=None if follower == self.index.no_token else follower,
            infgram_prob=None if view.infgram is None else float(view.infgram[token]),
            infgram_count=view.infgram_count,
            gate=view.gate,
            neighbours=view.neighbours,
        )

    def _decode(self) -> None:
        """One batched step: every running sequence's newest token against its cache. A cache
        that is full first restarts from the second half of its sequence's context."""
        window = self.model.cfg.max_seq_len
        for slot, seq in enumerate(self.active):
            if int(self.cache.lengths[slot]) == window:
                stop = len(seq.tokens) - 1
                self._try(seq, self._forward, slot, stop - window // 2, stop)
        self._retire()  # those whose restart failed
        if not self.active:
            return
        try:
            self._step(self.active)
        except Exception as e:  # the batched forward is the server's fault: it ends the batch
            for seq in self.active:
                self._fail(seq, e)

    def _step(self, seqs: list[Sequence]) -> None:
        """One forward of every sequence's newest token and its drafts."""
        spare = max(0, DRAFT_ROWS - len(seqs))
        for slot, seq in enumerate(seqs):
            room = min(
                self.speculate,
                spare,
                seq.sampling.max_tokens - seq.generated - 1,
                self.model.cfg.max_seq_len - int(self.cache.lengths[slot]) - 1,
            )
            if seq.use_index and room > 0:
                self._draft(seq, room)
                spare -= len(seq.drafts)
        counts = [1 + len(s.drafts) for s in seqs]
        tokens = [t for s in seqs for t in (s.tokens[-1], *(d.token for d in s.drafts))]
        features = [f for s in seqs for f in (s.features[-1], *(d.features for d in s.drafts))]
        owners = [s for s, n in zip(seqs, counts) for _ in range(n)]
        tail = self.index.max_match
        contexts = [
            s.tokens[-tail:] + [d.token for d in s.drafts[:i]]
            for s, n in zip(seqs, counts)
            for i in range(n)
        ]
        spans = []
        for s, n in zip(seqs, counts):  # each row reads its sequence's text up to its token
            text = s.tokens[-self.model.cfg.follower_reach :] + [d.token for d in s.drafts]
            spans.append(Span(text, len(text) - n, len(text), s.use_index))
        logp, views = self._run_and_mix(owners, contexts, tokens, features, counts, spans)
        start = 0
        for seq, n in zip(seqs, counts):
            seq.logp, seq.views = logp[start : start + n], views and views[start : start + n]
            start += n

    def _draft(self, seq: Sequence, room: int) -> None:
        """Up to ``room`` tokens that follow the newest one in the corpus, while the index's
        match stays at least ``DRAFT_MIN_MATCH`` long; with the features and the matcher state
        after each."""
        matcher, (length, follower) = seq.matcher, seq.features[-1]
        while (
            len(seq.drafts) < room and length >= DRAFT_MIN_MATCH and follower != self.index.no_token
        ):
            matcher = matcher.copy()
            features = matcher.push(follower)
            seq.drafts.append(Draft(follower, features, matcher))
            length, follower = features
