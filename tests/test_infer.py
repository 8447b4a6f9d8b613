"""teralm.infer: `teralm sample` and the server agree, and an fp8 export is served from its
e4m3 bytes with the numbers of its dequantised weights."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch
from serving import greedy, request, serve_in_thread
from test_cli import run_cli
from test_features import doc_ids_of
from test_train import brute_followers, brute_window_followers
from torch import nn

from teralm.index.query import OnlineMatcher
from teralm.infer import followers as followers_module
from teralm.infer.engine import Engine, Sequence
from teralm.infer.followers import Span, online_followers
from teralm.infer.fp8 import Fp8Embedding, Fp8Linear
from teralm.infer.load import load_model
from teralm.infer.mixture import infgram_probs, next_token_logp
from teralm.infer.prefix_cache import PrefixCache
from teralm.infer.sampling import Sampling, sample_token, sample_tokens
from teralm.infer.sampling import _probabilities as sampler_distribution
from teralm.model import ModelConfig, Transformer, checkpoint
from teralm.model.kv_cache import KVCache
from teralm.model.transformer import Linear

PROMPT = "abcab"


def test_sample_and_server_give_the_same_greedy_completion(tiny_run):
    ix, run = tiny_run["ix"], tiny_run["run"]
    sampled = run_cli(
        "sample", run, "--index", ix.directory, "--prompt", PROMPT, "--tokens", 24,
        "--temperature", 0,
    )  # fmt: skip
    assert sampled.returncode == 0, sampled.stderr
    with_index = sampled.stdout.split("--- with the index ---\n")[1].split("\n--- without")[0]
    with serve_in_thread(tiny_run["model"], ix) as server:
        body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0}
        code, answer = request(server["port"], "POST", "/v1/completions", body)
    assert code == 200, answer
    assert with_index == PROMPT + answer["choices"][0]["text"] + "\n"
    assert answer["choices"][0]["text"] == greedy(tiny_run["model"], ix, PROMPT, 24)


@torch.no_grad()
def index_reference(model, ix, prompt: str, n: int) -> list[dict]:
    """What the index did for each greedy token, by the plainest route (as ``greedy``): the
    features of the context before it, the ∞-gram's probability of it and its count, and the
    gate's weight for the ∞-gram."""
    matcher = OnlineMatcher(ix)
    tokens = [int(t) for t in ix.encode(prompt)]
    features = matcher.extend(tokens)
    records = []
    for _ in range(n):
        row = lambda xs: torch.tensor([xs])  # noqa: E731
        logits, gate = model(
            row(tokens), row([f[1] for f in features]), row([f[0] for f in features]),
            with_gate=True,
        )  # fmt: skip
        probs, totals = infgram_probs(ix, [tokens])
        token = int(
            next_token_logp(model, logits[0, -1:], gate[0, -1:], (probs, totals))[0].argmax()
        )
        length, follower = features[-1]
        weight = torch.sigmoid(-model.gate_logit(gate[0, -1:].float(), totals))[0]
        records.append({
            "token": token,
            "match_length": length,
            "proposed": None if follower == ix.no_token else follower,
            "infgram_probability": float(probs[0, token]) if totals[0] else None,
            "infgram_count": int(totals[0]),
            "gate": float(weight) if totals[0] else None,
        })  # fmt: skip
        tokens.append(token)
        features.append(matcher.push(token))
    return records


def test_index_tokens_tell_what_the_index_did_for_each_token(tiny_run):
    """``"index": "tokens"``: one record per generated token, whole or streamed, equal to the
    reference; no records without it."""
    from test_faults_server import events, open_stream

    model, ix = tiny_run["model"], tiny_run["ix"]
    want = index_reference(model, ix, PROMPT, 12)
    assert model.mixture_gate is not None and any(r["proposed"] is not None for r in want)
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "index": "tokens"}
    with serve_in_thread(model, ix) as server:
        code, whole = request(server["port"], "POST", "/v1/completions", body)
        streamed = events(open_stream(server["port"], body).stream)
        _, plain = request(server["port"], "POST", "/v1/completions", {**body, "index": False})
    assert code == 200, whole
    got = whole["choices"][0]["index_tokens"]
    assert [r["token"] for r in got] == [r["token"] for r in want]
    for g, w in zip(got, want):
        assert g["text"] == ix.decode([w["token"]])
        assert (g["match_length"], g["infgram_count"]) == (w["match_length"], w["infgram_count"])
        assert (g["proposed"] or {}).get("token") == w["proposed"]
        for key in ("infgram_probability", "gate"):
            assert (g[key] is None) == (w[key] is None) and g[key] == pytest.approx(
                w[key], abs=1e-5
            )
    chunks = [c for e in streamed[:-1] for c in e["choices"] if c.get("index_tokens")]
    assert [r for c in chunks for r in c["index_tokens"]] == got
    assert "index_tokens" not in plain["choices"][0]


def test_sample_ends_at_a_stop_string(tiny_run):
    """``teralm sample --stop`` prints the greedy completion up to the first stop string (with
    the whole index read into memory)."""
    ix = tiny_run["ix"]
    completion = greedy(tiny_run["model"], ix, PROMPT, 24)
    stop = completion[10:12]
    sampled = run_cli(
        "sample", tiny_run["run"], "--index", ix.directory, "--prompt", PROMPT, "--max-tokens",
        24, "--temperature", 0, "--stop", "zzz", "--stop", stop, "--index-memory", "1G",
    )  # fmt: skip
    assert sampled.returncode == 0, sampled.stderr
    with_index = sampled.stdout.split("--- with the index ---\n")[1].split("\n--- without")[0]
    assert with_index == PROMPT + completion[: completion.find(stop)] + "\n(stop)\n"


def dequantised(export) -> Transformer:
    """The plain fp32 model of an fp8 export: every matrix as ``q / scale``."""
    tensors, state = checkpoint.load_model_weights(export)
    plain = {
        name: value.float() / tensors[f"{name}.scale"] if f"{name}.scale" in tensors else value
        for name, value in tensors.items()
        if not name.endswith(".scale")
    }
    model = Transformer(ModelConfig.from_dict({**state["config"]["model"], "precision": "fp32"}))
    model.load_state_dict(plain)
    return model.eval()


def test_fp8_export_is_served_from_one_byte_per_parameter(tiny_run, tmp_path):
    ix, export = tiny_run["ix"], tmp_path / "fp8"
    assert run_cli("export-fp8", tiny_run["run"], "--out", export).returncode == 0
    model, _, _ = load_model(export, torch.device("cpu"), "fp32")
    reference = dequantised(export)

    matrices = [m for m in reference.modules() if isinstance(m, (Linear, nn.Linear, nn.Embedding))]
    twins = [m for m in model.modules() if isinstance(m, (Fp8Linear, Fp8Embedding))]
    assert len(twins) == len(matrices)
    assert all(t.q.dtype == torch.float8_e4m3fn for t in twins)
    assert not [n for n, p in model.named_parameters() if p.ndim == 2]  # no full matrix kept
    stored = sum(t.q.numel() * t.q.element_size() for t in twins)
    assert stored == sum(m.weight.numel() for m in matrices)  # one byte per parameter

    tokens = torch.tensor([[int(t) for t in ix.encode("abcabcaab")]])
    features = torch.randint(0, 3, tokens.shape), torch.randint(0, 5, tokens.shape)
    with torch.no_grad():
        got, want = model(tokens, *features, True), reference(tokens, *features, True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)

    with serve_in_thread(model, ix) as server:
        body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0}
        code, answer = request(server["port"], "POST", "/v1/completions", body)
    assert code == 200, answer
    assert answer["choices"][0]["text"] == greedy(reference, ix, PROMPT, 16)


@torch.no_grad()
def test_echo_scores_every_token_of_a_prompt_longer_than_the_context(tiny_run):
    """Past ``max_seq_len``, prompt tokens are scored in windows that restart from the previous
    one's second half (as generation goes on): each equals a plain forward of its window."""
    model, ix = tiny_run["model"], tiny_run["ix"]
    window = model.cfg.max_seq_len
    text = ix.decode(ix.tokens(0, ix.num_tokens))[: 3 * window]
    prompt = [int(t) for t in ix.encode(text)]
    events = []
    engine = Engine(model, ix, max_batch=2)
    try:
        engine.submit([Sequence(prompt, Sampling(max_tokens=0, echo=True), events.append)])
        deadline = time.time() + 120
        while not (events and events[-1].finish) and time.time() < deadline:
            time.sleep(0.05)
    finally:
        engine.close()
    scored = [e for e in events if e.prompt]
    assert [e.token for e in scored] == prompt and scored[0].logprob is None

    features = OnlineMatcher(ix).extend(prompt)
    start, want = 0, {}
    while True:  # the windowing rule, with full forwards
        stop = min(len(prompt), start + window)
        columns = (prompt, [f[1] for f in features], [f[0] for f in features])
        logits, gate = model(*(torch.tensor([c[start:stop]]) for c in columns), True)
        for p in range(start + window // 2 if start else 1, stop):
            context = prompt[:p]
            infgram = infgram_probs(ix, [context])
            r = p - 1 - start
            logp = next_token_logp(model, logits[0, r : r + 1], gate[0, r : r + 1], infgram)
            want[p] = float(logp[0, prompt[p]])
        if stop == len(prompt):
            break
        start = stop - window // 2
    got = {p: e.logprob for p, e in enumerate(scored) if p}
    assert got.keys() == want.keys()
    for p in want:
        assert abs(got[p] - want[p]) < 1e-4, p


def generate_events(engine: Engine, prompts: list[list[int]], sampling: Sampling) -> list[list]:
    """Every prompt's token events from one submission (the prompts share the batch)."""
    events: list[list] = [[] for _ in prompts]
    finished = threading.Semaphore(0)

    def collector(out: list) -> Callable:
        def on_event(event) -> None:
            out.append(event)
            if event.finish:
                finished.release()

        return on_event

    engine.submit([Sequence(p, sampling, collector(e)) for p, e in zip(prompts, events)])
    for _ in prompts:
        assert finished.acquire(timeout=120)
    return events


@pytest.fixture(scope="module")
def model_without_mixture(tiny_run, tmp_path_factory) -> Transformer:
    """A tiny model trained briefly with the index's features but no ∞-gram mixture: it
    follows the index's drafts only as far as it has learnt to."""
    from teralm.model import ModelConfig
    from teralm.train.config import RunConfig, TrainConfig
    from teralm.train.loop import train

    shape = ModelConfig(n_layer=2, n_head=2, d_model=32, max_seq_len=48, index_mixture=False)
    steps = TrainConfig(batch_size=4, seq_len=32, max_steps=30, warmup_steps=3)
    folder = tmp_path_factory.mktemp("no-mixture")
    train(tiny_run["ix"], RunConfig(shape, steps), folder, progress=False)
    return load_model(folder, torch.device("cpu"), generating=True)[0]


@torch.no_grad()
@pytest.mark.parametrize("mixture", [True, False], ids=["mixture", "no-mixture"])
def test_drafts_from_the_index_change_no_greedy_token_nor_logprob(
    tiny_run, model_without_mixture, mixture
):
    """Speculation keeps a draft only where greedy decoding picks it: the tokens, their
    log-probabilities and the finish are those of one token per step, and of the plain
    full-forward reference. The model with the ∞-gram mixture keeps drafts; the one without
    rejects some."""
    ix = tiny_run["ix"]
    model = tiny_run["model"] if mixture else model_without_mixture
    text = ix.decode(ix.tokens(*ix.document_range(3)))  # corpus text: long matches to draft from
    starts = [(0, 20), (40, 9), (100, 16), (150, 1)]
    prompts = [[int(t) for t in ix.encode(text[a : a + n])] for a, n in starts]
    sampling = Sampling(max_tokens=24, temperature=0, logprobs=2)
    runs = {}
    for speculate in (0, 8):
        engine = Engine(model, ix, max_batch=4, speculate=speculate)
        try:
            runs[speculate] = generate_events(engine, prompts, sampling), engine.stats
        finally:
            engine.close()
    (plain, plain_stats), (drafted, stats) = runs[0], runs[8]
    assert plain_stats.drafted == 0
    assert stats.accepted > 0 if mixture else stats.drafted > stats.accepted
    for a, b in zip(plain, drafted):
        assert [e.token for e in a] == [e.token for e in b] and len(a) == 24
        assert [e.finish for e in a] == [e.finish for e in b]
        for x, y in zip(a, b):
            assert abs(x.logprob - y.logprob) < 1e-4 and x.top.keys() == y.top.keys()
    want = greedy(model, ix, text[:20], 24)
    assert ix.decode([e.token for e in drafted[0]]) == want


def test_online_followers_count_every_occurrence_in_the_index(tiny_run, monkeypatch):
    """The counted answers of generated text: the index's followers, at its cap and its
    backoff, count every occurrence in the index (the text is not in it; counted whole here,
    where serving samples past ``TRAIN_EXACT_LIMIT``, as training does), the short window's
    read the text itself, against scans; rows of a sequence without the index get none from
    it."""
    monkeypatch.setattr(followers_module, "TRAIN_EXACT_LIMIT", 1 << 20)
    ix = tiny_run["ix"]
    cfg = dataclasses.replace(
        tiny_run["model"].cfg,
        index_followers=3,
        follower_cap=6,
        follower_backoff=2,
        window_order=2,
        window_tokens=12,
    )
    x, doc_ids = ix.tokens(0, ix.num_tokens), doc_ids_of(ix)
    rng = np.random.default_rng(8)
    texts = [
        [int(t) for t in ix.encode("".join(rng.choice(list("abcdef"), n)))] for n in (9, 30, 4)
    ]
    spans = [Span(texts[0], 0, 9), Span(texts[1], 17, 30), Span(texts[2], 1, 3, False)]
    got = online_followers(ix, cfg, spans)
    r = 0
    for text, first, stop, use_index in spans:
        for j in range(first, stop):
            answers = []
            for cap in cfg.follower_caps:
                context = text[max(0, j + 1 - cap) : j + 1] if use_index else []
                answers.append(brute_followers(x, doc_ids, context, ix.num_tokens))
            answers.append(brute_window_followers(text, j + 1, max(0, j + 1 - 12), 2))
            for source, (size, total, top) in enumerate(answers):
                row = (int(got.length[r, source]), int(got.total[r, source]))
                assert row == (size, total), (text, j, source)
                want = top[:3] + [(cfg.vocab_size, 0)] * (3 - len(top[:3]))
                assert got.tokens[r, source].tolist() == [token for token, _ in want]
                shares = [count / max(total, 1) for _, count in want]
                np.testing.assert_allclose(got.shares[r, source].numpy(), shares, rtol=1e-6)
            r += 1
    lengths = got.length
    assert r == len(lengths) and (lengths[:9, 0] > 2).any() and (lengths[-2:, :2] == 0).all()
    assert (lengths[lengths[:, 0] > 1, 1] == 2).all() and (lengths[:, 2] == 2).any()


@pytest.fixture(scope="module")
def model_with_followers(tiny_run, tmp_path_factory) -> Transformer:
    """A tiny model trained briefly with the index's followers as input, their embeddings
    then drawn large, so that a wrong follower changes what it generates."""
    from teralm.train.config import RunConfig, TrainConfig
    from teralm.train.loop import train

    shape = ModelConfig(
        n_layer=2, n_head=2, d_model=32, max_seq_len=48, index_followers=3, follower_cap=6,
        window_order=2, window_tokens=16,
    )  # fmt: skip
    steps = TrainConfig(batch_size=4, seq_len=32, max_steps=20, warmup_steps=3)
    folder = tmp_path_factory.mktemp("followers")
    train(tiny_run["ix"], RunConfig(shape, steps), folder, progress=False)
    model = load_model(folder, torch.device("cpu"), generating=True)[0]
    index_input = model.index_input
    torch.manual_seed(0)
    with torch.no_grad():
        for table in (table for source in index_input.sources for table in source):
            table.weight.normal_(0, 1.0)
    return model


@torch.no_grad()
def test_a_model_with_followers_generates_what_full_forwards_give(tiny_run, model_with_followers):
    """The engine computes the followers of the prompt and of each new token and draft as the
    plain route does (a full forward of the text with ``online_followers``): the same greedy
    tokens, batched and drafted or not."""
    ix, model = tiny_run["ix"], model_with_followers
    text = ix.decode(ix.tokens(*ix.document_range(3)))
    prompts = [text[a : a + n] for a, n in ((0, 20), (40, 9), (150, 1))]
    sampling = Sampling(max_tokens=20, temperature=0, logprobs=1)
    runs = []
    for speculate in (0, 8):
        engine = Engine(model, ix, max_batch=4, speculate=speculate)
        try:
            encoded = [[int(t) for t in ix.encode(p)] for p in prompts]
            runs.append(generate_events(engine, encoded, sampling))
        finally:
            engine.close()
        for prompt, got in zip(prompts, runs[-1]):
            assert ix.decode([e.token for e in got]) == greedy(model, ix, prompt, 20)
    assert engine.stats.accepted > 0
    for plain, drafted in zip(*runs):
        assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(plain, drafted))


@torch.no_grad()
def test_a_request_gets_places_at_once_beside_one_that_fills_the_batch(tiny_run):
    """A request of 8 long sequences fills a batch of 4; a request of 1 short sequence that
    comes after gets a place at the next step (the long request gives one up) and finishes in
    about its own number of steps; the preempted sequences go on where they stopped, so every
    sequence gives the tokens it gives alone (greedy)."""
    ix, model = tiny_run["ix"], tiny_run["model"]
    prompts = [
        [int(t) for t in ix.encode(p)] for p in ("ab", "ca", "bd", "da", "cc", "ba", "ad", "dc")
    ]
    long, short = Sampling(max_tokens=120, temperature=0), Sampling(max_tokens=6, temperature=0)
    engine = Engine(model, ix, max_batch=4, speculate=0, prefix_cache=0)
    try:
        alone = generate_events(engine, [prompts[0]], short)[0]
        events = [[] for _ in prompts]
        engine.submit([Sequence(p, long, out.append) for p, out in zip(prompts, events)])
        deadline = time.monotonic() + 60
        while sum(map(len, events)) < 20 and time.monotonic() < deadline:
            time.sleep(0.001)
        before = sum(map(len, events))
        beside = generate_events(engine, [prompts[0]], short)[0]
        steps = (sum(map(len, events)) - before) / 3  # the long request's steps meanwhile
        while not all(e and e[-1].finish for e in events) and time.monotonic() < deadline + 120:
            time.sleep(0.01)
    finally:
        engine.close()
    assert before < 8 * 120 and steps <= 6 + 4, steps
    assert [e.token for e in beside] == [e.token for e in alone]
    for prompt, got in zip(prompts, events):
        want = greedy(model, ix, ix.decode(prompt), 120)
        assert ix.decode([e.token for e in got]) == want and got[-1].finish == "length"


def reference_distribution(logp: torch.Tensor, s: Sampling) -> torch.Tensor:
    """Temperature, then the ``top_k`` most likely, then the fewest most likely tokens whose
    mass reaches ``top_p``, one token at a time in fp64."""
    p = torch.softmax(logp.double() / s.temperature, -1)
    order = sorted(range(len(p)), key=lambda t: -float(p[t]))
    kept, mass = [], 0.0
    for t in order[: s.top_k or len(p)]:
        if kept and mass >= s.top_p:
            break
        kept.append(t)
        mass += float(p[t] / p[order[: s.top_k or len(p)]].sum())
    out = torch.zeros_like(p)
    out[kept] = p[kept]
    return out / out.sum()


def test_the_sampler_draws_from_temperature_top_k_and_top_p():
    """The distribution equals a plain reference for each setting; rows sampled together
    give the tokens each gives alone; the draws follow the distribution; greedy is argmax."""
    torch.manual_seed(0)
    logp = torch.log_softmax(torch.randn(6, 12) * 2, dim=-1)
    settings = [
        Sampling(temperature=0.7),
        Sampling(temperature=1.2, top_k=3),
        Sampling(temperature=1.0, top_p=0.6),
        Sampling(temperature=0.9, top_k=5, top_p=0.8),
        Sampling(temperature=0),
        Sampling(temperature=1.5, top_p=0.999),
    ]
    for row, s in zip(logp, settings[:4] + settings[5:]):
        got = sampler_distribution(row, s).double()
        assert torch.allclose(got, reference_distribution(row, s), atol=1e-6), s
    seeds = lambda: [torch.Generator().manual_seed(i) for i in range(6)]  # noqa: E731
    together = sample_tokens(logp, settings, seeds())
    alone = [sample_token(row, s, g) for row, s, g in zip(logp, settings, seeds())]
    assert together == alone and together[4] == int(logp[4].argmax())
    generator, n = torch.Generator().manual_seed(2), 5000
    for row, s in zip(logp[:4], settings[:4]):
        draws = torch.tensor([sample_token(row, s, generator) for _ in range(n)])
        got = torch.bincount(draws, minlength=12) / n
        assert (got - sampler_distribution(row, s)).abs().max() < 0.03, s


def test_logit_bias_is_added_before_sampling():
    """A bias moves the distribution as adding it to the log-probabilities does (a reference
    through the sampler without bias), -100 bans a token, +100 forces it, greedy included; rows
    without a bias sampled beside one are unchanged."""
    torch.manual_seed(4)
    logp = torch.log_softmax(torch.randn(12) * 2, dim=-1)
    bias = {3: 2.5, 7: -1.0, int(logp.argmax()): -100.0}
    shifted = logp.clone()
    for t, b in bias.items():
        shifted[t] += b
    for s in (Sampling(temperature=0.8, top_k=6), Sampling(temperature=1.0, top_p=0.9)):
        biased = Sampling(**{**s.__dict__, "logit_bias": bias})
        generator, n = torch.Generator().manual_seed(6), 5000
        draws = torch.tensor([sample_token(logp, biased, generator) for _ in range(n)])
        got = torch.bincount(draws, minlength=12) / n
        assert (got - sampler_distribution(shifted, s)).abs().max() < 0.03, s
        assert got[int(logp.argmax())] == 0
    best, second = torch.topk(logp, 2).indices.tolist()
    greedy_ban = Sampling(temperature=0, logit_bias={best: -100.0})
    assert sample_token(logp, greedy_ban, torch.Generator()) == second
    forced = Sampling(temperature=1.0, logit_bias={5: 100.0})
    rows = sample_tokens(
        logp.repeat(2, 1), [forced, Sampling(temperature=0)], [torch.Generator()] * 2
    )
    assert rows == [5, int(logp.argmax())]


@torch.no_grad()
def test_a_seeded_sequence_gives_the_same_tokens_whatever_runs_beside_it(tiny_run):
    """Sampled with a seed, a prompt from the corpus (long matches: drafts) gives the same tokens
    alone without drafts, alone with drafts, and with drafts beside three other sequences
    (fewer drafts each: the batch's rows are shared; theirs have the same seed)."""
    ix, model = tiny_run["ix"], tiny_run["model"]
    text = ix.decode(ix.tokens(*ix.document_range(3)))
    prompts = [[int(t) for t in ix.encode(text[a : a + 12])] for a in (0, 30, 60, 90)]
    seeded = Sampling(max_tokens=32, temperature=0.9, seed=1234)
    runs = []
    for speculate, beside in ((0, 0), (8, 0), (8, 3)):
        engine = Engine(model, ix, max_batch=4, speculate=speculate)
        try:
            events = generate_events(engine, prompts[: 1 + beside], seeded)
            runs.append(([e.token for e in events[0]], engine.stats.drafted))
        finally:
            engine.close()
    assert runs[0][1] == 0 and runs[1][1] > 0 and runs[2][1] > 0
    assert runs[0][0] == runs[1][0] == runs[2][0] and len(runs[0][0]) == 32


@torch.no_grad()
def test_prompts_that_begin_alike_reuse_the_cached_keys_and_values(tiny_run):
    """With the prefix cache, a prompt that begins as an earlier one runs only the rest through
    the model (an exact repeat: its last token; else from the longest shared block boundary),
    and its greedy tokens, log-probabilities and top alternatives are those without the cache.
    A prompt without the index shares nothing with the same tokens with it."""
    ix = tiny_run["ix"]
    text = ix.decode(ix.tokens(*ix.document_range(3)))
    base = [int(t) for t in ix.encode(text[:40])]
    other = [int(t) for t in ix.encode("edcbaedcba")]
    prompts = [base, base, base[:35] + other[:5], base[:20]]
    reused = [0, 39, 32, 16]
    sampling = Sampling(max_tokens=12, temperature=0, logprobs=2)
    runs = {}
    for cache_bytes in (0, 1 << 20):
        engine = Engine(tiny_run["model"], ix, max_batch=2, prefix_cache=cache_bytes)
        try:
            events, counted = [], []
            for prompt in prompts:
                for t in (*engine.cache.keys, *engine.cache.values):
                    t.zero_()  # (the engine is idle) no slot holds an earlier prompt's entries
                events += generate_events(engine, [prompt], sampling)
                counted.append(engine.stats.cached_prompt_tokens - sum(counted))
            before = engine.stats.cached_prompt_tokens
            assert engine.generate([base], sampling, use_index=False)
            assert engine.stats.cached_prompt_tokens == before
            runs[cache_bytes] = events, counted
        finally:
            engine.close()
    (plain, none), (cached, counted) = runs[0], runs[1 << 20]
    assert none == [0, 0, 0, 0] and counted == reused
    for a, b in zip(plain, cached):
        assert [e.token for e in a] == [e.token for e in b]
        for x, y in zip(a, b):
            assert abs(x.logprob - y.logprob) < 1e-4 and x.top.keys() == y.top.keys()


def test_prompts_admitted_together_are_prefilled_together(tiny_run, monkeypatch):
    """Prompts waiting together run through the model in one call (split where their new
    tokens pass ``MAX_ROWS``), each after its cached prefix; their events are those of each
    prompt on its own, without a prefix cache."""
    ix = tiny_run["ix"]
    texts = [ix.decode(ix.tokens(*ix.document_range(d))) for d in range(1, 30)]
    text = next(t for t in texts if len(t) >= 40)
    base = [int(t) for t in ix.encode(text[:30])]
    prompts = [
        base,
        base[:25] + [int(t) for t in ix.encode("abcde")],
        [int(t) for t in ix.encode(text[10:30])],
        [int(t) for t in ix.encode(text[20:24])],
        [int(t) for t in ix.encode(text[5:40])],
    ]
    sampling = Sampling(max_tokens=6, temperature=0, logprobs=2)
    alone = []
    engine = Engine(tiny_run["model"], ix, max_batch=1, prefix_cache=0)
    try:
        for prompt in prompts:
            alone += generate_events(engine, [prompt], sampling)
    finally:
        engine.close()
    monkeypatch.setattr("teralm.infer.engine.MAX_ROWS", 48)
    engine = Engine(tiny_run["model"], ix, max_batch=len(prompts), prefix_cache=1 << 20)
    calls = []
    decode = engine.decoder.decode

    def counting(tokens, next_token, match_len, counts, *rest):
        calls.append(list(counts))
        return decode(tokens, next_token, match_len, counts, *rest)

    monkeypatch.setattr(engine.decoder, "decode", counting)
    try:
        generate_events(engine, [base], sampling)  # cached: the next two reuse its blocks
        calls.clear()
        together = generate_events(engine, prompts, sampling)
    finally:
        engine.close()
    prefills = [c for c in calls if max(c) > 1]
    # new tokens: 1 (a repeat), 30 - 16 (after the shared block), 20, 4 and 35 (a new prompt)
    assert prefills[:2] == [[1, 14, 20, 4], [35]]
    for a, b in zip(alone, together):
        assert [e.token for e in a] == [e.token for e in b] and len(a) == 6
        for x, y in zip(a, b):
            assert abs(x.logprob - y.logprob) < 1e-4 and x.top.keys() == y.top.keys()


def test_prefix_cache_drops_the_least_recent_and_checks_tokens(monkeypatch):
    """Past its byte budget the cache drops the entry used longest ago; what it loads is what
    it stored; a prompt whose hashes collide with a cached one's but whose tokens differ gets
    nothing."""
    cfg = ModelConfig(n_layer=2, n_head=2, d_model=8, max_seq_len=64, vocab_size=16)
    cache = KVCache(cfg, 2, torch.device("cpu"), torch.float32)
    entry_bytes = 2 * 2 * 2 * 40 * 4 * 4  # layers x (keys, values) x heads x tokens x dim x 4 B
    prefixes = PrefixCache(2 * entry_bytes)
    prompts = [[i] * 40 for i in range(3)]
    stored = {}
    for i, prompt in enumerate(prompts[:2]):
        for k in (*cache.keys, *cache.values):
            k[0].normal_()
        stored[i] = [k[0, :, :39].clone() for k in cache.keys]
        prefixes.store(prompt, True, cache, 0)
    assert prefixes.load(prompts[0], True, cache, 1) == 39  # now the most recent
    assert all(torch.equal(k[1, :, :39], want) for k, want in zip(cache.keys, stored[0]))
    prefixes.store(prompts[2], True, cache, 0)  # over budget: prompt 1 goes
    assert len(prefixes) == 2 and prefixes.bytes == 2 * entry_bytes
    assert prefixes.load(prompts[1], True, cache, 1) == 0 and int(cache.lengths[1]) == 0
    assert prefixes.load(prompts[0], True, cache, 1) == 39
    assert prefixes.load(prompts[0], False, cache, 1) == 0

    monkeypatch.setattr(
        "teralm.infer.prefix_cache._prefix_hashes", lambda tokens, use_index: {len(tokens): 7}
    )
    prefixes = PrefixCache(2 * entry_bytes)
    prefixes.store(prompts[0], True, cache, 0)
    assert prefixes.load(prompts[1], True, cache, 1) == 0
    assert prefixes.load(prompts[0], True, cache, 1) == 39
