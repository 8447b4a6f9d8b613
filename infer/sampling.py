"""One sampler for every way of generating: logit bias, temperature, top-k, top-p and a seeded
generator. Every sampled token takes exactly one number from its sequence's generator, so a seeded
sequence gives the same tokens whatever else is batched beside it and whatever is drafted."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

GREEDY_BELOW = 1e-6  # temperatures under this pick the most likely token


@dataclass
class Sampling:
    """How one sequence is generated (``logprobs``/``echo``: what its events report).
    ``logit_bias``: token id -> a value added to its log-probability before sampling (as OpenAI's
    API defines it; -100 bans a token in effect, 100 all but forces it)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    logprobs: int | None = None
    echo: bool = False
    seed: int | None = None
    logit_bias: dict[int, float] | None = None
    index_view: bool = False  # each generated token's event tells what the index did for it

    def generator(self) -> torch.Generator:
        """A CPU generator seeded with ``seed`` (or the clock when there is none)."""
        seed = self.seed if self.seed is not None else time.time_ns() % 2**62
        return torch.Generator().manual_seed(seed)


def sample_token(logp: torch.Tensor, s: Sampling, generator: torch.Generator) -> int:
    """Draw the next token from log-probabilities [vocab] with ``s``'s temperature, top-k and
    top-p. Safe for any temperature >= 0 and top_p > 0: tiny temperatures are greedy, and top-p
    always keeps the most likely token."""
    return sample_tokens(logp[None], [s], [generator])[0]


def sample_tokens(
    logp: torch.Tensor, samplings: list[Sampling], generators: list[torch.Generator]
) -> list[int]:
    """``sample_token`` for every row of ``logp`` [N, vocab] at once (row ``i`` with
    ``samplings[i]`` and ``generators[i]``): the same tokens as one row at a time."""
    logp = _biased(logp, samplings)
    tokens = logp.argmax(-1).tolist()
    drawn = [i for i, s in enumerate(samplings) if s.temperature >= GREEDY_BELOW]
    if drawn:
        probs = _probabilities_rows(logp[drawn], [samplings[i] for i in drawn])
        for i, token in zip(drawn, _draw(probs, [generators[i] for i in drawn])):
            tokens[i] = token
    return tokens


def _biased(logp: torch.Tensor, samplings: list[Sampling]) -> torch.Tensor:
    """``logp`` [N, vocab] with each row's ``logit_bias`` added (the same tensor when none has one)."""
    rows = [(i, s.logit_bias) for i, s in enumerate(samplings) if s.logit_bias]
    if not rows:
        return logp
    logp = logp.clone()
    for i, bias in rows:
        logp[i, list(bias)] += torch.tensor(list(bias.values()), dtype=logp.dtype)
    return logp


def _draw(probs: torch.Tensor, generators: list[torch.Generator]) -> list[int]:
    """One token per row of ``probs`` [N, vocab] (unnormalised, non-negative), each from its
    generator's next uniform number by inverting the row's cumulative distribution."""
    u = torch.cat([torch.rand(1, generator=g) for g in generators])
    cdf = probs.cumsum(-1)
    # right=True: the first token whose cumulative mass passes the draw has positive mass
    picks = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
    return picks[:, 0].clamp(max=probs.shape[1] - 1).tolist()


def _probabilities(logp: torch.Tensor, s: Sampling) -> torch.Tensor:
    """The distribution ``s`` samples from (temperature, then top-k, then top-p)."""
    return _probabilities_rows(logp[None], [s])[0]


def _probabilities_rows(logp: torch.Tensor, samplings: list[Sampling]) -> torch.Tensor:
    """The distribution each row's sampling draws from, for rows [N, vocab] of ``logp``."""
    vocab = logp.shape[1]
    temperature = torch.tensor([s.temperature for s in samplings], dtype=logp.dtype)
    scaled = (logp - logp.max(-1, keepdim=True).values) / temperature[:, None]  # best: 0
    top_k = [min(s.top_k or vocab, vocab) for s in samplings]
    if min(top_k) < vocab:
        kth = torch.topk(scaled, max(top_k)).values  # [N, max k], descending
        cutoff = kth.gather(1, torch.tensor(top_k)[:, None] - 1)
        scaled = scaled.masked_fill(scaled < cutoff, float("-inf"))
    top_p = torch.tensor([s.top_p for s in samplings], dtype=logp.dtype)
    if bool((top_p < 1.0).any()):
        ordered, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        limit = torch.where(top_p < 1.0, top_p, torch.inf)[:, None]  # rows without top-p: none
        drop = probs.cumsum(-1) - probs >= limit  # the mass of the tokens before each one
        drop[:, 0] = False
        scaled = scaled.scatter(1, order, ordered.masked_fill(drop, float("-inf")))
    return torch.softmax(scaled, -1)
