"""The preallocated KV cache against full forwards: sequences of different lengths, admitted and
finished at different steps, moved between slots as the engine does, through the model's own
decode and through the fused CPU kernel (teralm.kernels.decode)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from teralm.infer.decoder import MAX_ROWS, Decoder, fused_decode_fits
from teralm.kernels.decode import length_bucket as kernel_length_bucket
from teralm.model import ModelConfig, Transformer
from teralm.model.kv_cache import KVCache
from teralm.model.transformer import FollowerInput, length_bucket

CONFIG = ModelConfig(
    vocab_size=50, n_layer=3, n_head=2, d_model=32, max_seq_len=40, attention="tscale", window=6,
    local_fraction=0.5, max_match=15,
)  # fmt: skip
PLAIN = ModelConfig(
    vocab_size=50, n_layer=2, n_head=2, d_model=32, max_seq_len=40, mlp="swiglu",
    index_input=False, max_match=15,
)  # fmt: skip
FOLLOWERS = ModelConfig(
    vocab_size=50, n_layer=2, n_head=2, d_model=32, max_seq_len=40, max_match=15,
    index_followers=3, follower_cap=4, follower_backoff=2, window_order=2,
)  # fmt: skip


def random_model(config: ModelConfig) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(config).eval()
    with torch.no_grad():  # no zero-initialised projections: every path must matter
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module")
def model() -> Transformer:
    return random_model(CONFIG)


class Text:
    """A sequence's tokens and index features, with the followers of a model that reads
    ``k`` of them from each of its ``sources`` (random)."""

    def __init__(self, rng: np.random.Generator, length: int, k: int = 0, sources: int = 0):
        self.rng, self.k, self.sources = rng, k, sources
        self.tokens, self.next_token, self.match_len = [], [], []
        self.follower_rows: list[tuple] = []  # (tokens, shares, length, total) per position
        self.grow(length)

    def grow(self, n: int) -> None:
        vocab, rng = CONFIG.vocab_size, self.rng
        self.tokens += rng.integers(0, vocab, n).tolist()
        self.next_token += rng.integers(0, vocab + 1, n).tolist()
        self.match_len += rng.integers(0, CONFIG.max_match + 1, n).tolist()
        for _ in range(n if self.k else 0):  # (tokens, shares, length, total)
            shape = (self.sources, self.k)
            row = rng.integers(0, vocab + 1, shape), rng.random(shape).astype(np.float32)
            counted = rng.integers(0, 9, self.sources), rng.integers(0, 9000, self.sources)
            self.follower_rows.append((*row, *counted))

    def lists(self, start: int, stop: int | None = None) -> tuple[list[int], ...]:
        return tuple(xs[start:stop] for xs in (self.tokens, self.next_token, self.match_len))

    def followers(self, start: int, stop: int | None = None) -> FollowerInput | None:
        """The followers of positions ``start:stop`` [N, ...] (None for a model without)."""
        if not self.k:
            return None
        columns = zip(*self.follower_rows[start:stop])
        return FollowerInput(*(torch.from_numpy(np.stack(column)) for column in columns))


def joined(parts: list[FollowerInput | None]) -> FollowerInput | None:
    """Followers of several texts' rows, one after another."""
    if parts[0] is None:
        return None
    return FollowerInput(*(torch.cat(column) for column in zip(*(vars(p).values() for p in parts))))


def batched(followers: FollowerInput | None) -> FollowerInput | None:
    return (
        None if followers is None else FollowerInput(*(t[None] for t in vars(followers).values()))
    )


def full_forward(model: Transformer, text: Text) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = (torch.tensor([xs]) for xs in text.lists(0))
    logits, gate = model(*inputs, with_gate=True, followers=batched(text.followers(0)))
    return logits[0], part(gate, 0)


def part(gate: torch.Tensor | None, *index) -> torch.Tensor | None:
    """``gate[index]``, or None for a model without a mixture gate."""
    return None if gate is None else gate[index]


@torch.no_grad()
@pytest.mark.parametrize("fused", [False, True], ids=["model", "fused"])
@pytest.mark.parametrize(
    ("config", "seed"), [(CONFIG, 1), (CONFIG, 2), (CONFIG, 3), (PLAIN, 4), (FOLLOWERS, 5)]
)
def test_cache_matches_full_forward(config, seed, fused):
    model = random_model(config)
    rng = np.random.default_rng(seed)
    cache = KVCache(config, slots=4, device=torch.device("cpu"), dtype=torch.float32)
    decoder = Decoder(model, cache, fused)
    running: list[Text] = []  # running[i] lives in slot i
    admitted = finished = ragged = 0
    for _ in range(30):
        if len(running) < cache.slots and rng.random() < 0.5:  # admit: prefill the prompt
            length = int(rng.integers(1, 30))  # from 16 tokens on: BLAS products
            text = Text(rng, length, config.index_followers, config.follower_sources)
            slot = len(running)
            cache.lengths[slot] = 0
            prompt = (*text.lists(0), [len(text.tokens)], slot)
            logits, gate, _ = decoder.decode(*prompt, followers=text.followers(0))
            want_logits, want_gate = full_forward(model, text)
            torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
            assert_gates_close(gate, want_gate)
            running.append(text)
            admitted += 1
        done = [t for t in running if len(t.tokens) >= config.max_seq_len - 3 or rng.random() < 0.1]
        for text in done:  # finish: the last running sequence takes the freed slot
            i = running.index(text)
            last = running.pop()
            if i < len(running):
                cache.move(len(running), i)
                running[i] = last
            finished += 1
        if not running:
            continue
        # one step for every running sequence, in one batch: one new token each, or a few
        # (a speculative step), as many as each sequence has
        counts = [int(rng.choice([1, 1, 3])) for _ in running]
        ragged += len(set(counts)) > 1
        for text, n in zip(running, counts):
            text.grow(n)
        rows = [sum((t.lists(-n)[k] for t, n in zip(running, counts)), []) for k in range(3)]
        followers = joined([t.followers(-n) for t, n in zip(running, counts)])
        logits, gate, hidden = decoder.decode(*rows, counts, keep_hidden=True, followers=followers)
        offset = 0
        for b, (text, n) in enumerate(zip(running, counts)):
            want_logits, want_gate = full_forward(model, text)
            inputs = (torch.tensor([xs]) for xs in text.lists(0))
            want_hidden = model.hidden(*inputs, batched(text.followers(0)))[0]
            mine = slice(offset, offset + n)
            torch.testing.assert_close(logits[mine], want_logits[-n:], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(hidden[mine], want_hidden[-n:], atol=1e-4, rtol=1e-4)
            assert_gates_close(part(gate, mine), part(want_gate, slice(-n, None)))
            assert int(cache.lengths[b]) == len(text.tokens)
            offset += n
    assert admitted >= 4 and finished >= 2 and ragged  # admission, moves and ragged steps ran


def assert_gates_close(gate: torch.Tensor | None, want: torch.Tensor | None) -> None:
    assert (gate is None) == (want is None)
    if want is not None:
        torch.testing.assert_close(gate, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fused", [False, True], ids=["model", "fused"])
def test_cache_refuses_positions_beyond_max_seq_len(model, fused):
    cache = KVCache(CONFIG, slots=1, device=torch.device("cpu"), dtype=torch.float32)
    decoder = Decoder(model, cache, fused)
    text = Text(np.random.default_rng(0), CONFIG.max_seq_len + 1)
    decoder.decode(*text.lists(0, CONFIG.max_seq_len - 2), [CONFIG.max_seq_len - 2])
    with pytest.raises(ValueError, match="max_seq_len"):
        decoder.decode(*text.lists(CONFIG.max_seq_len - 2), [3])
    assert int(cache.lengths[0]) == CONFIG.max_seq_len - 2  # nothing was written


@torch.no_grad()
def test_fused_decoder_hands_large_calls_to_the_model():
    """Past MAX_ROWS new tokens (a long prompt) the model's batched products run instead:
    both write the same cache."""
    config = ModelConfig(**{**CONFIG.to_dict(), "max_seq_len": MAX_ROWS + 8})
    model = random_model(config)
    cache = KVCache(config, slots=1, device=torch.device("cpu"), dtype=torch.float32)
    decoder = Decoder(model, cache, fused=True)
    text = Text(np.random.default_rng(5), MAX_ROWS + 4)
    decoder.decode(*text.lists(0, MAX_ROWS + 1), [MAX_ROWS + 1])  # the model's path
    logits, _, _ = decoder.decode(*text.lists(MAX_ROWS + 1), [3])  # the kernel's
    want = full_forward(model, text)[0][MAX_ROWS + 1 :]
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)


@torch.no_grad()
@pytest.mark.parametrize("rows", [40, 100, MAX_ROWS], ids=lambda n: f"{n}-rows")
def test_fused_prompts_of_every_product_order_match_the_model(rows):
    """Prompts whose products BLAS takes with the weight as the left operand (all matrices, or
    only those with more inputs than outputs) or the right one, against the full forward."""
    config = ModelConfig(**{**CONFIG.to_dict(), "max_seq_len": MAX_ROWS})
    model = random_model(config)
    cache = KVCache(config, slots=1, device=torch.device("cpu"), dtype=torch.float32)
    text = Text(np.random.default_rng(rows), rows)
    logits, _, _ = Decoder(model, cache, fused=True).decode(*text.lists(0), [rows])
    torch.testing.assert_close(logits, full_forward(model, text)[0], atol=1e-4, rtol=1e-4)


def test_kernel_length_buckets_are_the_models():
    lengths = np.arange(0, 1 << 16)
    want = length_bucket(torch.from_numpy(lengths)).numpy()
    assert [kernel_length_bucket(n) for n in lengths] == want.tolist()


def test_fused_decoder_runs_only_what_it_computes_exactly(model):
    assert fused_decode_fits(model)
    bf16 = Transformer(ModelConfig(**{**CONFIG.to_dict(), "precision": "bf16"}))
    assert not fused_decode_fits(bf16)
    cache = KVCache(CONFIG, slots=1, device=torch.device("cpu"), dtype=torch.float32)
    assert not Decoder(bf16, cache).fused
    with pytest.raises(ValueError, match="fp32"):
        Decoder(bf16, cache, fused=True)


@torch.no_grad()
@pytest.mark.parametrize("fused", [False, True], ids=["model", "fused"])
def test_split_calls_match_one_thread(model, fused):
    """A call of many rows split across threads at sequence boundaries (at whatever share the
    balancing has reached) gives one thread's logits and cache; ``alongside`` runs once."""
    rng = np.random.default_rng(6)
    texts = [Text(rng, int(rng.integers(1, 12))) for _ in range(12)]
    decoders = []
    for threads in (1, 3):
        cache = KVCache(CONFIG, slots=len(texts), device=torch.device("cpu"), dtype=torch.float32)
        decoders.append(Decoder(model, cache, fused, threads=threads))
    calls = []

    def count_call() -> None:
        calls.append(1)

    for step in range(6):
        counts = [len(t.tokens) for t in texts] if step == 0 else [int(rng.integers(1, 4)) for _ in texts]  # fmt: skip
        if step:
            for text, n in zip(texts, counts):
                text.grow(n)
        rows = [sum((t.lists(-n)[k] for t, n in zip(texts, counts)), []) for k in range(3)]
        results = [decoder.decode(*rows, counts, alongside=count_call) for decoder in decoders]
        assert len(calls) == 2 * (step + 1)
        torch.testing.assert_close(results[1].logits, results[0].logits, atol=1e-5, rtol=1e-5)
        assert_gates_close(results[1].gate, results[0].gate)
        torch.testing.assert_close(decoders[1].cache.keys[0], decoders[0].cache.keys[0])
        assert decoders[1].cache.lengths.tolist() == [len(t.tokens) for t in texts]
    if fused:  # the calls were split, and the balancing moved the calling thread's share
        positions = np.arange(sum(counts))
        assert len(decoders[1]._parts(np.asarray(counts), positions)) == 3
        assert decoders[1]._share != 1 / 3
    for decoder in decoders:
        decoder.close()
