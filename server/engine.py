"""The generation engine: one model and one index shared by every request.

A worker thread owns the model. Each loop it admits waiting sequences (one prefill each, taking
requests in turn), samples one token for every active sequence, looks each new token up in the
index (the online matcher, so the model sees the features it was trained with), then runs one
batched decode step over all active sequences with their KV caches padded to a common length.
Requests talk to it through ``Sequence`` objects: events come back through a callback, and
``cancel()`` stops one. Work on one sequence that fails ends that sequence alone, with an error
event; a failed batched step ends the sequences in it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from teralm.index import Index
from teralm.index.query import OnlineMatcher
from teralm.model import Transformer
from teralm.train.generate import infgram_probs, next_token_logp
from teralm.train.loop import autocast

log = logging.getLogger("teralm.server")
GREEDY_BELOW = 1e-6  # temperatures under this pick the most likely token


@dataclass
class Sampling:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    logprobs: int | None = None
    echo: bool = False
    seed: int | None = None


@dataclass
class TokenEvent:
    """One token: its id, log-probability, the top alternatives, and whether it is a prompt
    token (echo). ``finish`` is set on the sequence's last event ("length", or "error" with the
    ``error``'s message)."""

    token: int | None
    logprob: float | None = None
    top: dict[int, float] | None = None
    prompt: bool = False
    finish: str | None = None
    error: str | None = None


@dataclass
class Sequence:
    prompt: list[int]
    sampling: Sampling
    on_event: Callable[[TokenEvent], None]
    tokens: list[int] = field(default_factory=list)
    features: list[tuple[int, int]] = field(default_factory=list)
    generated: int = 0
    cancelled: bool = False
    done: bool = False
    cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer, [H, L, D]
    cache_start: int = 0  # the token the cache's first entry belongs to
    logits: torch.Tensor | None = None  # for the next token
    matcher: OnlineMatcher | None = None
    generator: torch.Generator | None = None

    def cancel(self) -> None:
        """Stop generating (client gone, stop string found, timeout); no more events."""
        self.cancelled = True


class WaitingRoom:
    """Sequences waiting for a place in the batch, grouped by request. ``get`` takes one sequence
    from each request in turn, so a request with many sequences cannot hold back the others."""

    def __init__(self):
        self._requests: deque[deque[Sequence]] = deque()
        self._changed = threading.Condition()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def put(self, seqs: list[Sequence]) -> None:
        """Queue one request's sequences."""
        if not seqs:
            return
        with self._changed:
            self._requests.append(deque(seqs))
            self._size += len(seqs)
            self._changed.notify()

    def get(self, timeout: float) -> Sequence | None:
        """The next request's next sequence; None if none came within ``timeout`` seconds."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._requests, timeout):
                return None
            request = self._requests.popleft()
            seq = request.popleft()
            if request:
                self._requests.append(request)
            self._size -= 1
            return seq


def sample_token(logp: torch.Tensor, s: Sampling, generator: torch.Generator) -> int:
    """Draw the next token from log-probabilities [vocab] with ``s``'s temperature, top-k and
    top-p. Safe for any temperature >= 0 and top_p > 0: tiny temperatures are greedy, and top-p
    always keeps the most likely token."""
    if s.temperature < GREEDY_BELOW:
        return int(logp.argmax())
    scaled = (logp - logp.max()) / s.temperature  # the best token at 0: nothing overflows
    if s.top_k:
        cutoff = torch.topk(scaled, min(s.top_k, scaled.shape[0])).values[-1]
        scaled = scaled.masked_fill(scaled < cutoff, float("-inf"))
    if s.top_p < 1.0:
        order = torch.argsort(scaled, descending=True)
        probs = torch.softmax(scaled[order], dim=-1)
        drop = probs.cumsum(0) - probs >= s.top_p  # the mass of the tokens before each one
        drop[0] = False
        scaled[order[drop]] = float("-inf")
    return int(torch.multinomial(torch.softmax(scaled, -1), 1, generator=generator))


@dataclass
class EngineStats:
    tokens: int = 0
    prompt_tokens: int = 0
    model_s: float = 0.0
    lookup_s: float = 0.0


class Engine:
    def __init__(self, model: Transformer, index: Index, max_batch: int = 16):
        self.model = model.eval()
        self.index = index
        self.device = next(model.parameters()).device
        self.max_batch = max_batch
        self.waiting = WaitingRoom()
        self.active: list[Sequence] = []
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

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    # -- the worker thread -------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stop.is_set():
            self._admit()
            for seq in self.active:
                self._try(self._sample, seq)
            self.active = [s for s in self.active if not (s.done or s.cancelled)]
            if self.active:
                self._decode(self.active)

    def _admit(self) -> None:
        while len(self.active) < self.max_batch:
            seq = self.waiting.get(timeout=0.05 if not self.active else 0)
            if seq is None:
                return
            if seq.cancelled:
                continue
            self._try(self._prefill, seq)
            if not seq.done:  # done already: it failed, or has max_tokens 0
                self.active.append(seq)

    def _try(self, work: Callable[[Sequence], None], seq: Sequence) -> None:
        """``work`` on one sequence; if it raises, that sequence ends with an error event and
        the others go on."""
        try:
            work(seq)
        except Exception as e:
            self._fail(seq, e)

    def _fail(self, seq: Sequence, error: Exception) -> None:
        log.error("generation failed", exc_info=error)
        seq.done = True
        seq.on_event(TokenEvent(None, finish="error", error=str(error) or type(error).__name__))

    def _features(self, seq: Sequence, token: int) -> tuple[int, int]:
        began = time.perf_counter()
        features = seq.matcher.push(token)
        self.stats.lookup_s += time.perf_counter() - began
        return features

    def _prefill(self, seq: Sequence) -> None:
        seq.matcher = OnlineMatcher(self.index)
        seq.generator = torch.Generator().manual_seed(
            seq.sampling.seed if seq.sampling.seed is not None else int(time.time_ns() % 2**62)
        )
        seq.tokens = list(seq.prompt)
        seq.features = [self._features(seq, t) for t in seq.prompt]
        self.stats.prompt_tokens += len(seq.prompt)
        window = self.model.cfg.max_seq_len
        start = max(0, len(seq.tokens) - window)
        logits, gate = self._forward_fresh(seq, start)
        if seq.sampling.echo:
            contexts = [seq.tokens[: start + i + 1] for i in range(logits.shape[0] - 1)]
            self._echo(seq, self._logp(contexts, logits[:-1], None if gate is None else gate[:-1]))
        if seq.sampling.max_tokens == 0:
            seq.done = True
            seq.on_event(TokenEvent(None, finish="length"))

    def _forward_fresh(self, seq: Sequence, start: int) -> torch.Tensor:
        """Run ``tokens[start:]`` from an empty cache; keep the cache and the last logits."""
        tokens = seq.tokens[start:]
        feats = seq.features[start:]
        as_row = lambda xs: torch.tensor([xs], dtype=torch.long, device=self.device)  # noqa: E731
        began = time.perf_counter()
        with autocast(self.device, self.model.cfg.precision):
            logits, gate, kv = self.model.decode(
                as_row(tokens),
                as_row([f[1] for f in feats]),
                as_row([f[0] for f in feats]),
                None,
                torch.zeros(1, dtype=torch.long, device=self.device),
            )
        self.stats.model_s += time.perf_counter() - began
        seq.cache = [(k[0], v[0]) for k, v in kv]
        seq.cache_start = start
        seq.logits = self._logp(
            [seq.tokens], logits[0, -1:], None if gate is None else gate[0, -1:]
        )[0]
        return logits[0].float(), None if gate is None else gate[0]

    def _logp(self, contexts: list[list[int]], logits: torch.Tensor, gate) -> torch.Tensor:
        """Next-token log-probabilities after each context, mixed with the ∞-gram's when the
        model has a mixture (the ∞-gram query is timed as index lookup)."""
        infgram = None
        if gate is not None:
            began = time.perf_counter()
            infgram = infgram_probs(self.index, contexts)
            self.stats.lookup_s += time.perf_counter() - began
        return next_token_logp(self.model, logits, gate, infgram)

    def _echo(self, seq: Sequence, logp: torch.Tensor) -> None:
        """Events for the prompt tokens: each one's log-probability given those before it
        (``logp[i]``: the distribution after the window's token ``i``)."""
        offset = len(seq.prompt) - logp.shape[0] - 1  # prompt tokens before the window
        for i, token in enumerate(seq.prompt):
            row = i - 1 - offset
            if row < 0:
                seq.on_event(TokenEvent(token, None, None, prompt=True))
                continue
            seq.on_event(
                TokenEvent(token, float(logp[row, token]), self._top(seq, logp[row]), True)
            )

    def _top(self, seq: Sequence, logp: torch.Tensor) -> dict[int, float] | None:
        n = seq.sampling.logprobs
        if not n:
            return None
        values, ids = torch.topk(logp, min(n, logp.shape[0]))
        return {int(i): float(v) for i, v in zip(ids, values)}

    def _sample(self, seq: Sequence) -> None:
        if seq.done or seq.cancelled:
            return
        s = seq.sampling
        token = sample_token(seq.logits, s, seq.generator)
        logp = F.log_softmax(seq.logits, dim=-1)
        seq.tokens.append(token)
        seq.generated += 1
        self.stats.tokens += 1
        finish = "length" if seq.generated >= s.max_tokens else None
        event = TokenEvent(token, float(logp[token]), self._top(seq, logp), finish=finish)
        seq.done = finish is not None
        seq.on_event(event)
        if not seq.done and not seq.cancelled:
            seq.features.append(self._features(seq, token))

    def _decode(self, seqs: list[Sequence]) -> None:
        """One step for every sequence: a fresh forward of its second half when its context is
        full, else the batched step."""
        window = self.model.cfg.max_seq_len
        ready = []
        for seq in seqs:
            if len(seq.tokens) - seq.cache_start > window:
                self._try(lambda s: self._forward_fresh(s, len(s.tokens) - window // 2), seq)
            else:
                ready.append(seq)
        if not ready:
            return
        try:
            self._step(ready)
        except Exception as e:  # the batched forward is the server's fault: it ends the batch
            for seq in ready:
                self._fail(seq, e)

    def _step(self, ready: list[Sequence]) -> None:
        """The last token of every sequence against its cache, in one batch."""
        lengths = [s.cache[0][0].shape[1] for s in ready]
        longest = max(lengths)
        past = []
        for layer in range(len(self.model.blocks)):
            keys, values = [], []
            for s in ready:
                k, v = s.cache[layer]
                pad = longest - k.shape[1]
                keys.append(F.pad(k, (0, 0, 0, pad)))
                values.append(F.pad(v, (0, 0, 0, pad)))
            past.append((torch.stack(keys), torch.stack(values)))
        column = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)[:, None]  # noqa: E731
        began = time.perf_counter()
        with autocast(self.device, self.model.cfg.precision):
            logits, gate, new = self.model.decode(
                column([s.tokens[-1] for s in ready]),
                column([s.features[-1][1] for s in ready]),
                column([s.features[-1][0] for s in ready]),
                past,
                torch.tensor(lengths, device=self.device),
            )
        self.stats.model_s += time.perf_counter() - began
        logp = self._logp(
            [s.tokens for s in ready], logits[:, -1], None if gate is None else gate[:, -1]
        )
        for b, s in enumerate(ready):
            s.cache = [
                (torch.cat((k, nk[b]), dim=1), torch.cat((v, nv[b]), dim=1))
                for (k, v), (nk, nv) in zip(s.cache, new)
            ]
            s.logits = logp[b]
