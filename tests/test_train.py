"""Training: data never touches held-out text, the causal ∞-gram, checkpoints and resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import fields

import numpy as np
import pytest
import torch
from conftest import build_docs, random_documents
from test_features import doc_ids_of

from teralm.index.knn import KnnDatastore
from teralm.infer.load import load_model
from teralm.kernels.fragment import fragment_features
from teralm.kernels.match import doc_start_bits
from teralm.kernels.window import window_followers
from teralm.model import ModelConfig
from teralm.model.checkpoint import weights_sha256
from teralm.train.config import DataSettings
from teralm.train.data import (
    TRAIN_EXACT_LIMIT,
    FragmentSampler,
    causal_followers,
    counted_answers,
    fragment,
    prefetched,
    short_window,
    training_spans,
)
from teralm.train.evaluate import causal_infgram, document_windows, window_answers

TINY = """
[model]
n_layer = 2
n_head = 2
d_model = 32
max_seq_len = 32
[train]
batch_size = 4
seq_len = 32
max_steps = 40
checkpoint_every = 8
log_every = 1
warmup_steps = 4
holdout_every = 5
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(11)
    docs = random_documents(rng, 40, alphabet="abcd", max_len=200)
    return build_docs(tmp_path_factory.mktemp("corpus"), docs, shard_tokens=500)


def test_fragments_avoid_held_out_documents(corpus):
    ix = corpus
    doc_ids = doc_ids_of(ix)
    sampler = FragmentSampler(
        ix, DataSettings(seq_len=16, batch_size=8, seed=3, holdout_every=5, index_dropout=0.0)
    )
    spans = training_spans(ix, 5)
    allowed = np.zeros(ix.num_tokens, dtype=bool)
    for a, b in spans:
        allowed[a:b] = True
    assert (allowed == (doc_ids % 5 != 0)).all()
    x = ix.tokens(0, ix.num_tokens)
    for step in range(30):
        batch = sampler.batch(step)
        for row, target in zip(batch.tokens.numpy(), batch.targets.numpy()):
            hits = [
                s
                for s in range(ix.num_tokens - 16)
                if (x[s : s + 16] == row).all() and (x[s + 1 : s + 17] == target).all()
            ]
            assert any(allowed[s : s + 17].all() for s in hits)
    again = FragmentSampler(
        ix, DataSettings(seq_len=16, batch_size=8, seed=3, holdout_every=5, index_dropout=0.0)
    )
    assert (again.batch(7).tokens == sampler.batch(7).tokens).all()


def test_index_dropout_hides_features_of_whole_fragments(corpus):
    ix = corpus
    shape = dict(seq_len=16, batch_size=8, seed=3, holdout_every=5)
    plain = FragmentSampler(ix, DataSettings(**shape, index_dropout=0.0), infgram=True)
    hiding = DataSettings(**shape, index_dropout=0.5, dropout_features="none")
    dropping = FragmentSampler(ix, hiding, infgram=True)
    dropped_rows = kept_rows = 0
    for step in range(10):
        a, b = plain.batch(step), dropping.batch(step)
        assert (a.tokens == b.tokens).all() and (a.targets == b.targets).all()
        for i in range(8):
            if (b.match_len[i] == 0).all() and (b.next_token[i] == ix.no_token).all():
                assert (b.infgram_total[i] == 0).all() and (b.infgram_hits[i] == 0).all()
                dropped_rows += int((a.match_len[i] > 0).any())
            else:
                for name in ("next_token", "match_len", "infgram_total", "infgram_hits"):
                    assert (getattr(a, name)[i] == getattr(b, name)[i]).all()
                kept_rows += 1
    assert dropped_rows > 10 and kept_rows > 10
    assert (
        dropping.batch(4).match_len == FragmentSampler(ix, hiding, infgram=True).batch(4).match_len
    ).all()


def test_index_dropout_shows_fragments_against_themselves(corpus):
    """With ``dropout_features = "self"``, a dropped fragment's features and ∞-gram are those of
    the fragment alone (document starts inside it included); the others keep the index's."""
    ix = corpus
    shape = dict(seq_len=16, batch_size=8, seed=3, holdout_every=5)
    plain = FragmentSampler(ix, DataSettings(**shape, index_dropout=0.0), infgram=True)
    dropping = FragmentSampler(ix, DataSettings(**shape, index_dropout=0.5), infgram=True)
    x = ix.tokens(0, ix.num_tokens)
    bits = doc_start_bits(np.asarray(ix.offsets), ix.num_tokens)
    dropped = kept = 0
    for step in range(10):
        a, b = plain.batch(step), dropping.batch(step)
        for i, row in enumerate(b.tokens.numpy()):
            text = np.append(row, b.targets[i, -1].item())
            start = next(s for s in range(len(x)) if (x[s : s + 17] == text).all())
            alone = fragment_features(text.astype(np.int64), bits, start, ix.max_match, ix.no_token)
            columns = ("next_token", "match_len", "infgram_total", "infgram_hits")
            if all((getattr(a, name)[i] == getattr(b, name)[i]).all() for name in columns):
                kept += 1
            else:
                for name, want in zip(columns, alone):
                    np.testing.assert_array_equal(getattr(b, name)[i].numpy(), want)
                dropped += 1
    assert dropped > 10 and kept > 10


def brute_causal(x, doc_ids, t, length):
    """Longest suffix (<= length) of the context before t with an occurrence ending at p,
    p + 1 < t, followed inside its document: (m, total, hits)."""
    for m in range(length, 0, -1):
        suffix = list(x[t - m : t])
        total = hits = 0
        for p in range(m - 1, t - 1):
            if doc_ids[p - m + 1] != doc_ids[p] or doc_ids[p + 1] != doc_ids[p]:
                continue
            if list(x[p - m + 1 : p + 1]) == suffix:
                total += 1
                hits += int(x[p + 1] == x[t])
        if total:
            return m, total, hits
    return 0, 0, 0


def test_causal_infgram_equals_brute_force(corpus):
    ix = corpus
    x, doc_ids = ix.tokens(0, ix.num_tokens), doc_ids_of(ix)
    lengths = ix.features(0, ix.num_tokens).match_len
    for doc in range(0, ix.num_documents, 5):
        start, stop = ix.document_range(doc)
        if stop - start < 3:
            continue
        total, hits = causal_infgram(ix, start + 1, stop - start - 1, start)
        for i, t in enumerate(range(start + 1, stop)):
            _, want_total, want_hits = brute_causal(x, doc_ids, t, int(lengths[t - 1]))
            assert (total[i], hits[i]) == (want_total, want_hits), (doc, t)


def test_causal_followers_of_batches_equal_brute_force(corpus):
    """A document's targets' top followers at each length cap, from their stored matches and
    seeing only earlier text, against a scan of the corpus."""
    ix = corpus
    x, doc_ids = ix.tokens(0, ix.num_tokens), doc_ids_of(ix)
    lengths = ix.features(0, ix.num_tokens).match_len
    caps, k = (32, 6, 2), 3
    for doc in range(0, ix.num_documents, 7):
        start, stop = ix.document_range(doc)
        if stop - start < 3:
            continue
        got = causal_followers(ix, start + 1, stop - start - 1, start, caps, k)
        for i, t in enumerate(range(start + 1, stop)):
            for level, cap in enumerate(caps):
                size, total, top = brute_causal_followers(x, doc_ids, t, int(lengths[t - 1]), cap)
                assert (got.lengths[i, level], got.totals[i, level]) == (size, total), (t, cap)
                want = [tc for tc in top[:k]] + [(-1, 0)] * (k - len(top[:k]))
                assert (
                    list(zip(got.tokens[i, level].tolist(), got.counts[i, level].tolist())) == want
                )


def test_batches_carry_the_counted_answers_of_their_fragments(corpus):
    """With index_followers, a kept fragment's followers are ``counted_answers`` of its targets
    (from the stored matches), at the cap and the backoff; a dropped one's have none from the
    index, and its short window reads the fragment alone; without, the batch has none."""
    ix = corpus
    data = DataSettings(seq_len=16, batch_size=8, seed=3, holdout_every=5, index_dropout=0.5)
    cfg = ModelConfig(
        index_followers=3, follower_cap=6, follower_backoff=2, window_order=2, window_tokens=30
    )
    plain = FragmentSampler(ix, data, infgram=True)
    richer = FragmentSampler(ix, data, infgram=True, model=cfg)
    assert plain.batch(2).followers() is None
    batch, same = richer.batch(2), plain.batch(2)
    assert torch.equal(batch.tokens, same.tokens) and torch.equal(batch.match_len, same.match_len)
    starts, drops = richer.draw(2)
    columns = ("follower_tokens", "follower_shares", "follower_length", "follower_total")
    for row, (start, drop) in enumerate(zip(starts, drops)):
        lengths = ix.features(start, start + 16).match_len.astype(np.int64)
        doc_start = start if drop else 0
        rows = (ix, cfg, start + 1, 16, doc_start, lengths, TRAIN_EXACT_LIMIT, not drop)
        for name, want in zip(columns, counted_answers(*rows)):
            np.testing.assert_array_equal(getattr(batch, name)[row].numpy(), want)
        if drop:
            assert (batch.follower_length[row, :, :2] == 0).all()
            assert (batch.follower_tokens[row, :, :2] == ix.vocab_size).all()
            assert batch.follower_length[row, 0, 2] == 0  # nothing before the fragment
    lengths = batch.follower_length
    assert drops.any() and not drops.all() and (lengths[:, :, 2] > 0).any()
    assert (lengths[:, :, 1] <= 2).all() and (lengths[:, :, 1] == 2).any()
    assert batch.followers().tokens.shape == (8, 16, 3, 3)


def test_short_window_answers_equal_brute_force(corpus):
    """Each target's short-window followers come from its own document's earlier text within
    the window (several documents in one call), against a scan."""
    ix, order, window = corpus, 3, 40
    cfg = ModelConfig(index_followers=2, window_order=order, window_tokens=window)
    x, doc_ids = ix.tokens(0, ix.num_tokens).astype(np.int64), doc_ids_of(ix)
    first, count = 1, min(ix.num_tokens - 1, 1500)
    tokens, shares, length, total = short_window(ix, cfg, first, count, 0)
    for i, t in enumerate(range(first, first + count)):
        lo = max(int(ix.offsets[doc_ids[t]]), t - window)
        size, occurrences, top = brute_window_followers(x, t, lo, order)
        assert (length[i], total[i]) == (size, occurrences), t
        want = top[:2] + [(ix.vocab_size, 0)] * (2 - len(top[:2]))
        assert tokens[i].tolist() == [token for token, _ in want]
        np.testing.assert_allclose(shares[i], [c / max(occurrences, 1) for _, c in want])
    assert (length == order).any() and (length == 1).any() and (length == 0).any()


def test_short_window_sees_nothing_at_or_after_its_target():
    rng = np.random.default_rng(4)
    text = rng.integers(0, 3, 300)
    targets = np.arange(1, 301)
    lows = np.maximum(targets - 50, 0)
    whole = window_followers(text, targets, lows, 3, 2, 3)
    for t in (1, 40, 120, 299):
        changed = text.copy()
        changed[t:] = rng.integers(0, 3, len(text) - t)
        again = window_followers(changed, targets, lows, 3, 2, 3)
        for a, b in zip(whole, again):
            np.testing.assert_array_equal(a[:t], b[:t])


def brute_window_followers(x, t, lo, order):
    """The longest suffix (at most ``order`` tokens) of ``x[lo:t]`` seen in ``x[lo:t]`` ending
    at p, p + 1 < t: (size, total, followers by count)."""
    for m in range(min(order, t - lo), 0, -1):
        counts: dict[int, int] = {}
        for p in range(lo + m - 1, t - 1):
            if list(x[p - m + 1 : p + 1]) == list(x[t - m : t]):
                counts[int(x[p + 1])] = counts.get(int(x[p + 1]), 0) + 1
        if counts:
            return m, sum(counts.values()), sorted(counts.items(), key=lambda tc: (-tc[1], tc[0]))
    return 0, 0, []


def test_a_run_with_followers_trains_scores_samples_and_builds_knn(corpus, tmp_path):
    """The command line takes a run whose model reads the index's followers all the way: its
    kNN datastore holds each training position's hidden state with the followers eval gives."""
    config = tmp_path / "followers.toml"
    config.write_text(
        TINY.replace("max_steps = 40", "max_steps = 6").replace(
            "[train]", "index_followers = 3\nfollower_cap = 6\n[train]"
        )
    )
    run = tmp_path / "run"
    trained = run_cli("train", "--index", corpus.directory, "--out", run, "--config", config)
    assert trained.returncode == 0, trained.stderr
    saved = json.loads((run / "config.json").read_text())["config"]["model"]
    assert (saved["index_followers"], saved["follower_cap"]) == (3, 6)
    scored = run_cli("eval", run, "--index", corpus.directory, "--json", "--quiet")
    assert scored.returncode == 0, scored.stderr
    assert 0 < json.loads(scored.stdout)["model"] < 8
    sampled = run_cli("sample", run, "--index", corpus.directory, "--tokens", 8)
    assert sampled.returncode == 0, sampled.stderr
    assert "--- with the index ---" in sampled.stdout
    knn = tmp_path / "knn"
    built = run_cli(
        "build-knn", run, "--index", corpus.directory, "--out", knn, "--precision", "fp32"
    )
    assert built.returncode == 0, built.stderr
    cpu = torch.device("cpu")
    model = load_model(run, cpu, "fp32")[0]
    store = KnnDatastore.open(knn, corpus, weights_sha256(run))
    doc_start, a, length = next(document_windows(corpus, [1], model.cfg.max_seq_len))
    window = fragment(corpus, a, length)
    followers = window_answers(corpus, model, doc_start, a, length, window[2], cpu)
    with torch.no_grad():
        inputs = (torch.from_numpy(x)[None] for x in window[:3])
        hidden = model.hidden(*inputs, followers)[0].numpy()
    np.testing.assert_allclose(store.search(hidden).distances[:, 0], 0, atol=1e-6)


def brute_causal_followers(x, doc_ids, t, length, cap):
    """The longest suffix (at most ``min(length, cap)`` tokens) of the context before t seen
    ending at p, p + 1 < t, followed inside its document: (size, total, followers by count)."""
    return brute_followers(x, doc_ids, x[t - min(length, cap) : t], t)


def brute_followers(x, doc_ids, context, before):
    """The longest suffix of ``context`` seen in ``x`` ending at p, p + 1 < ``before``, followed
    inside its document: (size, total, followers by count)."""
    for m in range(len(context), 0, -1):
        suffix = list(context[len(context) - m :])
        counts: dict[int, int] = {}
        for p in range(m - 1, before - 1):
            if doc_ids[p - m + 1] != doc_ids[p] or doc_ids[p + 1] != doc_ids[p]:
                continue
            if list(x[p - m + 1 : p + 1]) == suffix:
                counts[int(x[p + 1])] = counts.get(int(x[p + 1]), 0) + 1
        if counts:
            top = sorted(counts.items(), key=lambda tc: (-tc[1], tc[0]))
            return m, sum(counts.values()), top
    return 0, 0, []


def run_cli(*args, **kwargs):
    return subprocess.run(
        [sys.executable, "-m", "teralm.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        **kwargs,
    )


def losses(run) -> dict[int, float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def test_killed_run_resumes_to_the_same_losses(corpus, tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    whole = tmp_path / "whole"
    done = run_cli(
        "train", "--index", corpus.directory, "--out", whole, "--config", config, "--quiet"
    )
    assert done.returncode == 0, done.stderr
    assert (whole / "loss.png").read_bytes()[:4] == b"\x89PNG"

    cut = tmp_path / "cut"
    args = ["train", "--index", corpus.directory, "--out", cut, "--config", config, "--quiet"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "teralm.cli", *map(str, args)], start_new_session=True
    )
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        latest = cut / "latest.json"
        if latest.exists() and json.loads(latest.read_text())["step"] >= 16:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    resumed = run_cli("train", "--index", corpus.directory, "--out", cut, "--resume", "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    assert losses(cut) == losses(whole)

    again = run_cli("train", "--index", corpus.directory, "--out", cut, "--config", config)
    assert again.returncode == 1 and "--resume" in again.stderr


def test_bad_checkpoints_get_clear_errors(corpus, tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text(TINY.replace("max_steps = 40", "max_steps = 8"))
    run = tmp_path / "run"
    done = run_cli(
        "train", "--index", corpus.directory, "--out", run, "--config", config, "--quiet"
    )
    assert done.returncode == 0, done.stderr

    other = tmp_path / "other.toml"
    other.write_text(TINY.replace("d_model = 32", "d_model = 64"))
    result = run_cli(
        "train", "--index", corpus.directory, "--out", run, "--config", other, "--resume"
    )
    assert result.returncode == 1 and "d_model: 32 -> 64" in result.stderr
    assert "Traceback" not in result.stderr

    latest = json.loads((run / "latest.json").read_text())["checkpoint"]
    weights = run / latest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    result = run_cli("eval", run, "--index", corpus.directory)
    assert result.returncode == 1 and "truncated or damaged" in result.stderr
    assert "start the run afresh (it has no earlier checkpoint)" in result.stderr
    assert "Traceback" not in result.stderr


def test_saved_configs_keep_the_settings_they_trained_with():
    from teralm.train.config import RunConfig, load_config

    saved = load_config("tiny", None).to_dict()
    for name in ("own_loss_weight", "dropout_features"):
        del saved["train"][name]  # a run saved before the setting existed
    old, new = RunConfig.from_saved(saved).train, RunConfig.from_dict(saved).train
    assert (old.own_loss_weight, old.dropout_features) == (0.0, "none")
    assert (new.own_loss_weight, new.dropout_features) == (0.5, "self")
    with pytest.raises(ValueError, match="own_loss_weight"):
        RunConfig.from_dict({"train": {"own_loss_weight": -1.0}})
    with pytest.raises(ValueError, match="dropout_features must be one of self, none"):
        RunConfig.from_dict({"train": {"dropout_features": "all"}})
    with pytest.raises(ValueError, match="follower_backoff must be 0 .none. or a cap below"):
        RunConfig.from_dict({"model": {"index_followers": 2, "follower_backoff": 8}})


def test_eval_json_and_fp8_export(corpus, tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text(TINY.replace("max_steps = 40", "max_steps = 10"))
    run = tmp_path / "run"
    assert (
        run_cli("train", "--index", corpus.directory, "--out", run, "--config", config).returncode
        == 0
    )
    out = run_cli("eval", run, "--index", corpus.directory, "--json", "--quiet")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert set(result) >= {"metric", "model", "infgram", "interpolated", "tokens"}
    assert result["metric"] == "bpb" and result["tokens"] > 0
    assert result["lambda_from"] == "validation"  # λ chosen on other text than the scored
    assert result["interpolated_oracle"] <= min(result["model"], result["interpolated"]) + 1e-9
    assert result["held_out"]
    docs = random_documents(np.random.default_rng(11), 40, alphabet="abcd", max_len=200)
    docs[0], docs[1] = docs[1], docs[0]  # training document 1 at held-out id 0, same size
    other = build_docs(tmp_path / "other", docs, shard_tokens=500).directory
    refused = run_cli("eval", run, "--index", other, "--json", "--quiet")
    assert refused.returncode == 1 and "not the index the run was trained on" in refused.stderr
    assert "tokens_sha256" in refused.stderr and "Traceback" not in refused.stderr
    allowed = run_cli("eval", run, "--index", other, "--allow-other-index", "--quiet")
    assert allowed.returncode == 0 and allowed.stdout.startswith("NOT held-out"), allowed.stderr
    exported = run_cli("export-fp8", run, "--out", tmp_path / "fp8")
    assert exported.returncode == 0, exported.stderr
    fp8 = json.loads(
        run_cli("eval", tmp_path / "fp8", "--index", corpus.directory, "--json", "--quiet").stdout
    )
    assert fp8["tokens"] == result["tokens"]
    assert abs(fp8["model"] - result["model"]) < 0.05 * result["model"]


def test_eval_breaks_bits_per_byte_down_by_stored_match_length_and_infgram_count():
    """``summarize``'s ``by_match`` and ``by_count``: each group's share of the tokens and its
    bpb for the model, the model alone and the best interpolation, against per-token losses
    averaged by hand."""
    from teralm.train.evaluate import Scores, summarize

    rng = np.random.default_rng(0)
    n = 900
    served, own = (np.log(rng.uniform(0.01, 1, n)) for _ in range(2))
    total = rng.choice([0, 1, 3, 4, 15, 16, 255, 256, 10_000], n)
    hits = np.minimum(total, rng.integers(0, 20, n))
    match = rng.choice([0, 2, 3, 4, 15, 16, 90], n)
    result = summarize(Scores(served, own, total, hits, match), 256, byte_level=True)
    lam = result["lambda"]
    bits = lambda p: -np.log(p).mean() / np.log(2)  # noqa: E731
    breakdowns = {
        "by_match": (match, [("0-3", 0, 3), ("4-15", 4, 15), ("16+", 16, np.inf)]),
        "by_count": (
            total,
            [("0-0", 0, 0), ("1-3", 1, 3), ("4-15", 4, 15), ("16-255", 16, 255), ("256+", 256, np.inf)],
        ),
    }  # fmt: skip
    for name, (values, groups) in breakdowns.items():
        assert [g["range"] for g in result[name]] == [label for label, _, _ in groups]
        for group, (_, low, high) in zip(result[name], groups):
            at = (values >= low) & (values <= high)
            mixed = np.where(
                total[at] > 0,
                lam * np.exp(served[at]) + (1 - lam) * hits[at] / np.maximum(total[at], 1),
                np.exp(served[at]),
            )
            assert group["share"] == pytest.approx(at.mean())
            assert group["model"] == pytest.approx(bits(np.exp(served[at])))
            assert group["model_alone"] == pytest.approx(bits(np.exp(own[at])))
            assert group["interpolated"] == pytest.approx(bits(mixed))


@pytest.mark.parametrize("background", [True, False])
def test_prefetched_batches_are_the_samplers_in_order(corpus, background):
    """Where a batch is made (a background thread, or the foreground with the ∞-gram counts
    in worker threads) changes when it is made, not what it holds; closing early stops
    cleanly."""
    shape = dict(seq_len=16, batch_size=3, seed=5, holdout_every=5)
    plain = FragmentSampler(corpus, DataSettings(**shape, index_dropout=0.0), infgram=True)
    dropping = DataSettings(**shape, index_dropout=0.3)
    threaded = FragmentSampler(corpus, dropping, infgram=True, workers=3)
    alone = FragmentSampler(corpus, dropping, infgram=True)
    keys = [(step, micro) for step in range(4) for micro in range(2)]
    for sampler, reference in ((plain, plain), (threaded, alone)):
        for key, batch in zip(keys, prefetched(sampler, keys, background), strict=True):
            want = reference.batch(*key)
            for field in fields(batch):
                assert torch.equal(getattr(batch, field.name), getattr(want, field.name))
    assert threaded.batch(1).infgram_total.any()
    early = prefetched(plain, keys, background)
    next(early)
    early.close()


FAULTS_PER_STEP = """
import resource, torch
from teralm.model import ModelConfig, Transformer
from teralm.train.loop import keep_freed_memory
print(keep_freed_memory())
torch.manual_seed(0)
shape = dict(n_layer=2, n_head=4, d_model=256, max_seq_len=256, vocab_size=256)
model = Transformer(ModelConfig(**shape, precision="fp32", index_input=False))
tokens = torch.randint(0, 256, (16, 256))
for _ in range(9):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_training_keeps_freed_memory_for_reuse():
    """After ``keep_freed_memory`` (in a fresh process) the steps of a small model reuse the
    memory of the ones before: a few page faults per step, where glibc's default maps large
    blocks afresh and faults 4,000-25,000 times a step here."""
    out = subprocess.run([sys.executable, "-c", FAULTS_PER_STEP], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    applied, *faults = out.stdout.split()
    if applied == "False":
        pytest.skip("not glibc's malloc")
    assert sum(map(int, faults[5:])) < 15_000, faults  # default here: mostly 40,000+
