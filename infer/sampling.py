"""One sampler for every way of generating: temperature, top-k, top-p and a seeded generator."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

GREEDY_BELOW = 1e-6  # temperatures under this pick the most likely token


@dataclass
class Sampling:
    """How one sequence is generated (``logprobs``/``echo``: what its events report)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    logprobs: int | None = None
    echo: bool = False
    seed: int | None = None

    def generator(self) -> torch.Generator:
        """A CPU generator seeded with ``seed`` (or the clock when there is none)."""
        seed = self.seed if self.seed is not None else time.time_ns() % 2**62
        return torch.Generator().manual_seed(seed)


def sample_token(logp: torch.Tensor, s: Sampling, generator: torch.Generator) -> int:
    """Draw the next token from log-probabilities [vocab] with ``s``'s temperature, top-k and
    top-p. Safe for any temperature >= 0 and top_p > 0: tiny temperatures are greedy, and top-p
    always keeps the most likely token."""
    if s.temperature < GREEDY_BELOW:
        return int(logp.argmax())
    return int(torch.multinomial(_probabilities(logp, s), 1, generator=generator))


def check_draft(logp: torch.Tensor, draft: int, s: Sampling, generator: torch.Generator) -> int:
    """The next token where ``draft`` was proposed for it: ``draft`` with the probability
    ``sample_token`` gives it, else a draw from ``sample_token``'s distribution without it.
    Speculative sampling with a one-hot proposal (Leviathan et al., 2023): the token comes out
    distributed exactly as ``sample_token``'s; greedy, it is the most likely token."""
    if s.temperature < GREEDY_BELOW:
        return int(logp.argmax())
    probs = _probabilities(logp, s)
    if float(torch.rand(1, generator=generator)) < float(probs[draft]):
        return draft
    probs[draft] = 0.0
    return int(torch.multinomial(probs, 1, generator=generator))


def _probabilities(logp: torch.Tensor, s: Sampling) -> torch.Tensor:
    """The distribution ``s`` samples from (temperature, then top-k, then top-p)."""
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
    return torch.softmax(scaled, -1)
