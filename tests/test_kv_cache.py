"""The preallocated KV cache against full forwards: sequences of different lengths, admitted and
finished at different steps, moved between slots as the engine does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from teralm.model import ModelConfig, Transformer
from teralm.model.kv_cache import KVCache

CONFIG = ModelConfig(
    vocab_size=50, n_layer=3, n_head=2, d_model=32, max_seq_len=40, attention="tscale", window=6,
    local_fraction=0.5, max_match=15,
)  # fmt: skip


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(CONFIG).eval()
    with torch.no_grad():  # no zero-initialised projections: every path must matter
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


class Text:
    """A sequence's tokens and index features (random)."""

    def __init__(self, rng: np.random.Generator, length: int):
        self.rng = rng
        self.tokens, self.next_token, self.match_len = [], [], []
        self.grow(length)

    def grow(self, n: int) -> None:
        self.tokens += self.rng.integers(0, CONFIG.vocab_size, n).tolist()
        self.next_token += self.rng.integers(0, CONFIG.vocab_size + 1, n).tolist()
        self.match_len += self.rng.integers(0, CONFIG.max_match + 1, n).tolist()

    def rows(self, start: int, stop: int | None = None) -> tuple[torch.Tensor, ...]:
        return tuple(
            torch.tensor([xs[start:stop]]) for xs in (self.tokens, self.next_token, self.match_len)
        )


def full_forward(model: Transformer, text: Text) -> tuple[torch.Tensor, torch.Tensor]:
    logits, gate = model(*text.rows(0), with_gate=True)
    return logits[0], gate[0]


@torch.no_grad()
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_cache_matches_full_forward(model, seed):
    rng = np.random.default_rng(seed)
    cache = KVCache(CONFIG, slots=4, device=torch.device("cpu"), dtype=torch.float32)
    running: list[Text] = []  # running[i] lives in slot i
    admitted = finished = 0
    for _ in range(30):
        if len(running) < cache.slots and rng.random() < 0.5:  # admit: prefill the prompt
            text = Text(rng, int(rng.integers(1, 12)))
            slot = len(running)
            cache.lengths[slot] = 0
            logits, gate = model.decode(*text.rows(0), cache, first=slot)
            want_logits, want_gate = full_forward(model, text)
            torch.testing.assert_close(logits[0], want_logits, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(gate[0], want_gate, atol=1e-4, rtol=1e-4)
            running.append(text)
            admitted += 1
        done = [t for t in running if len(t.tokens) >= CONFIG.max_seq_len or rng.random() < 0.1]
        for text in done:  # finish: the last running sequence takes the freed slot
            i = running.index(text)
            last = running.pop()
            if i < len(running):
                cache.move(len(running), i)
                running[i] = last
            finished += 1
        if not running:
            continue
        for text in running:  # one decode step for every running sequence, in one batch
            text.grow(1)
        batch = [torch.cat([t.rows(-1)[k] for t in running]) for k in range(3)]
        logits, gate = model.decode(*batch, cache)
        for b, text in enumerate(running):
            want_logits, want_gate = full_forward(model, text)
            torch.testing.assert_close(logits[b, -1], want_logits[-1], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(gate[b, -1], want_gate[-1], atol=1e-4, rtol=1e-4)
            assert int(cache.lengths[b]) == len(text.tokens)
    assert admitted >= 4 and finished >= 2  # the schedule exercised admission and moves


def test_cache_refuses_positions_beyond_max_seq_len(model):
    cache = KVCache(CONFIG, slots=1, device=torch.device("cpu"), dtype=torch.float32)
    text = Text(np.random.default_rng(0), CONFIG.max_seq_len + 1)
    with pytest.raises(ValueError, match="max_seq_len"):
        model.decode(*text.rows(0), cache)
