"""The kNN datastore: faiss search against numpy brute force, the mixture against a direct
computation, resumed builds, refusals, and causality (held-out text never in the datastore)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import build_docs, folder_held, random_documents
from serving import request, serve_in_thread

pytest.importorskip("faiss")

from teralm.index.knn import KnnDatastore, import_faiss  # noqa: E402
from teralm.index.query import OnlineMatcher  # noqa: E402
from teralm.infer import load  # noqa: E402
from teralm.infer.engine import Engine, Sequence  # noqa: E402
from teralm.infer.load import load_model  # noqa: E402
from teralm.infer.mixture import knn_mixed_logp, knn_target_probs, knn_weights  # noqa: E402
from teralm.infer.sampling import Sampling  # noqa: E402
from teralm.model import ModelConfig  # noqa: E402
from teralm.model.checkpoint import weights_sha256  # noqa: E402
from teralm.train import knn as build  # noqa: E402
from teralm.train.config import RunConfig, TrainConfig  # noqa: E402
from teralm.train.data import held_out  # noqa: E402
from teralm.train.evaluate import document_windows, knn_mixture  # noqa: E402
from teralm.train.loop import train  # noqa: E402

HOLDOUT = 10
DUPLICATE, ORIGINAL = 20, 13  # a held-out document, and the earlier training one it copies


def train_tiny(base, ix, name: str, index_input: bool = True) -> dict:
    config = RunConfig(
        ModelConfig(n_layer=2, n_head=2, d_model=32, max_seq_len=48, index_input=index_input),
        TrainConfig(batch_size=4, seq_len=32, max_steps=20, warmup_steps=2, holdout_every=HOLDOUT),
    )
    train(ix, config, base / name, progress=False)
    model, _, _ = load_model(base / name, torch.device("cpu"), "fp32")
    return {"base": base, "ix": ix, "run": base / name, "model": model}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A corpus whose held-out document 20 is a copy of training document 13."""
    base = tmp_path_factory.mktemp("knn")
    docs = random_documents(np.random.default_rng(5), 30, alphabet="abcde", max_len=300)
    docs[DUPLICATE] = docs[ORIGINAL] = "xy" + docs[ORIGINAL] * 2
    return base, build_docs(base / "corpus", docs)


@pytest.fixture(scope="module")
def trained(corpus):
    """A tiny model trained on the corpus with the index, loaded in fp32."""
    return train_tiny(*corpus, "run")


def corpus_file(trained) -> Path:
    return trained["ix"].directory.parent / "corpus.jsonl"


def knn_config(trained, out, **kwargs) -> build.KnnBuildConfig:
    settings = dict(shard_tokens=1500, precision="fp32", progress=False, k=8)
    return build.KnnBuildConfig(
        trained["run"], trained["ix"].directory, out, **{**settings, **kwargs}
    )


@pytest.fixture(scope="module")
def flat(trained):
    out = trained["base"] / "flat"
    build.build_knn(knn_config(trained, out))
    return KnnDatastore.open(out, trained["ix"], weights_sha256(trained["run"]))


@torch.no_grad()
def hidden_states(model, ix, doc: int) -> tuple[np.ndarray, np.ndarray]:
    """The hidden state of every position of one document, window by window, unbatched."""
    keys, positions = [], []
    for _, a, length in document_windows(ix, [doc], model.cfg.max_seq_len):
        x = torch.from_numpy(ix.tokens(a, a + length).astype(np.int64))[None]
        f = ix.features(a, a + length)
        next_token, match_len = (torch.from_numpy(v.astype(np.int64))[None] for v in f[::-1])
        keys.append(model.hidden(x, next_token, match_len)[0].numpy())
        positions.append(np.arange(a, a + length))
    return np.concatenate(keys), np.concatenate(positions)


def test_flat_datastore_equals_brute_force(trained, flat):
    ix, model = trained["ix"], trained["model"]
    training = [d for d in range(ix.num_documents) if not held_out(d, HOLDOUT)]
    keys, positions = map(np.concatenate, zip(*(hidden_states(model, ix, d) for d in training)))
    assert flat.num_keys == len(keys)
    queries = np.concatenate([hidden_states(model, ix, d)[0] for d in (0, 10)])
    found = flat.search(queries)
    distances = ((queries[:, None, :].astype(np.float64) - keys[None]) ** 2).sum(-1)
    order = np.argsort(distances, axis=1, kind="stable")[:, : flat.k]
    want = np.take_along_axis(distances, order, 1)
    np.testing.assert_allclose(found.distances, want, rtol=1e-4, atol=1e-4)
    # each neighbour is a stored key at the distance reported (ties may come in any order)
    column = np.searchsorted(positions, found.positions)
    assert (positions[column] == found.positions).all()
    rows = np.arange(len(queries))[:, None]
    np.testing.assert_allclose(distances[rows, column], found.distances, rtol=1e-4, atol=1e-4)
    assert len(set(map(tuple, np.sort(found.positions, axis=1)))) > 1
    np.testing.assert_array_equal(found.tokens, ix.tokens(0, ix.num_tokens)[found.positions + 1])


def test_knn_mixture_equals_direct_computation():
    rng = np.random.default_rng(0)
    n, k, vocab, temperature, lam = 7, 5, 6, 0.7, 0.3
    distances = rng.random((n, k)) * 3
    distances[2, 3:] = np.inf  # fewer neighbours than k
    distances[4] = np.inf  # none
    tokens = rng.integers(0, vocab, size=(n, k))
    targets = rng.integers(0, vocab, size=n)
    logp = torch.log_softmax(torch.from_numpy(rng.normal(size=(n, vocab))), dim=-1)
    for i in range(n):
        weights = [math.exp(-d / temperature) for d in distances[i] if d < np.inf]
        p_knn = np.zeros(vocab)
        for d, t in zip(distances[i], tokens[i]):
            if d < np.inf:
                p_knn[t] += math.exp(-d / temperature) / sum(weights)
        p_model = np.exp(logp[i].numpy())
        want = lam * p_knn + (1 - lam) * p_model if weights else p_model
        assert math.isclose(knn_weights(distances, temperature)[i].sum(), 1.0 if weights else 0.0)
        assert math.isclose(knn_target_probs(tokens, distances, targets, temperature)[i], p_knn[targets[i]], abs_tol=1e-12)  # fmt: skip
        got = knn_mixed_logp(logp, tokens, distances, temperature, lam)[i]
        np.testing.assert_allclose(np.exp(got.numpy()), want, rtol=1e-9)
        hits = tokens == targets[:, None]
        mixed = knn_mixture(logp.numpy()[np.arange(n), targets], distances, hits, temperature, lam)
        assert math.isclose(mixed[i], want[targets[i]], rel_tol=1e-9)


def test_a_resumed_auto_build_keeps_its_precision(trained, monkeypatch):
    """``auto`` may time bf16 differently on another try (teralm.infer.precision): a build
    resumed with ``auto`` keeps the precision its datastore was made in."""
    out = trained["base"] / "auto"
    first = build.build_knn(knn_config(trained, out, precision="auto", factory="Flat"))
    chosen = first.manifest["precision"]
    other = "bf16" if chosen == "fp32" else "fp32"
    real = load.choose_precision
    monkeypatch.setattr(
        load,
        "choose_precision",
        lambda requested, *rest, **kw: real(
            other if requested == "auto" else requested, *rest, **kw
        ),
    )
    again = build.build_knn(knn_config(trained, out, precision="auto", factory="Flat"))
    assert again.manifest["precision"] == chosen and again.built_shards == 0


def test_default_factory_is_a_reduced_rotation_then_ivf_pq_of_at_most_32_bytes():
    faiss = import_faiss()
    assert build.default_factory(build.FLAT_KEYS, 256) == "Flat"
    for keys, dim, reduced in ((60_000_000, 256, 64), (2**20, 768, 64), (2**20, 32, 8)):
        factory = build.default_factory(keys, dim)
        index = faiss.index_factory(dim, factory)
        ivf = faiss.extract_index_ivf(index)
        assert index.d == dim and ivf.d == reduced and ivf.code_size == reduced // 2 <= 32
        assert ivf.nlist == 1 << round(math.log2(math.sqrt(keys)))


def test_the_plan_s_size_is_the_datastore_s():
    """The plan's bytes: a Flat key is its fp32 dimensions and its id; an IVF-PQ key its code
    and id, and the lists' centroids beside them (trained as the build trains them)."""
    assert build.expected_bytes("Flat", 1000, 256) == 1000 * (4 * 256 + 8)
    faiss = import_faiss()
    keys = np.random.default_rng(0).standard_normal((20_000, 64)).astype(np.float32)
    for factory in ("IVF64,PQ16", "OPQ8_32,IVF64,PQ8"):
        index = faiss.index_factory(64, factory)
        build._train(faiss, index, keys[:4000])  # the size does not depend on the sample
        index.add(keys)
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "x.faiss"
            faiss.write_index(index, str(path))
            size = path.stat().st_size
        assert 0.95 < build.expected_bytes(factory, 20_000, 64) / size < 1.05, factory


def test_training_keeps_opq_short_and_skips_polysemous_training():
    faiss = import_faiss()
    index = faiss.index_factory(64, "OPQ8_32,IVF16,PQ8")
    build._train(faiss, index, np.random.default_rng(0).standard_normal((4000, 64)).astype("f4"))
    opq = faiss.downcast_VectorTransform(index.chain.at(0))
    ivf = faiss.downcast_index(faiss.extract_index_ivf(index))
    assert opq.niter == build.OPQ_ROUNDS and not ivf.do_polysemous_training and index.is_trained


def test_killed_build_resumes_to_the_same_datastore(trained, monkeypatch):
    """With a rotation in front of the lists (as the default has), which the merge keeps."""
    whole, resumed = trained["base"] / "whole", trained["base"] / "resumed"
    factory = "OPQ4_8,IVF4,PQ4"
    build.build_knn(knn_config(trained, whole, factory=factory))
    calls, keys = [0], build.KeyWriter.keys

    def dies_in_the_third_shard(self, windows):  # a shard's windows take one call here
        calls[0] += (resumed / "trained.faiss").exists()
        if calls[0] == 3:
            raise KeyboardInterrupt
        return keys(self, windows)

    monkeypatch.setattr(build.KeyWriter, "keys", dies_in_the_third_shard)
    with pytest.raises(KeyboardInterrupt):
        build.build_knn(knn_config(trained, resumed, factory=factory))
    monkeypatch.setattr(build.KeyWriter, "keys", keys)
    assert len(json.loads((resumed / "knn.json").read_text())["shards"]) == 2
    result = build.build_knn(knn_config(trained, resumed, factory=factory))
    assert result.built_shards == len(result.manifest["shards"]) - 2
    files = sorted(p.name for p in whole.iterdir())
    assert files == sorted(p.name for p in resumed.iterdir())
    assert "merged.ivfdata" in files and not any(f.startswith("shard-") for f in files)
    for name in files:
        if name != "knn.json":
            assert (whole / name).read_bytes() == (resumed / name).read_bytes(), name
    done = [json.loads((d / "knn.json").read_text()) for d in (whole, resumed)]
    for m in done:
        m.pop("run")
    assert done[0] == done[1]
    KnnDatastore.open(resumed, trained["ix"], weights_sha256(trained["run"]))
    data = resumed / "merged.ivfdata"
    data.write_bytes(data.read_bytes()[:-1])
    with pytest.raises(ValueError, match="missing or truncated"):
        KnnDatastore.open(resumed, trained["ix"], weights_sha256(trained["run"]))


def test_mismatched_run_index_or_settings_are_refused(trained, flat, tmp_path):
    other = build_docs(tmp_path / "other", random_documents(np.random.default_rng(9), 20))
    config = knn_config(trained, tmp_path / "a")
    config.index = other.directory
    with pytest.raises(ValueError, match="trained on another index"):
        build.build_knn(config)
    with pytest.raises(ValueError, match="other model weights"):
        KnnDatastore.open(flat.directory, trained["ix"], "0" * 64)
    with pytest.raises(ValueError, match="another token index"):
        KnnDatastore.open(flat.directory, other, weights_sha256(trained["run"]))
    same_shape = build_docs(  # the corpus with every "e" an "E": only its text differs
        tmp_path / "same-shape",
        [
            json.loads(line)["text"].replace("e", "E")
            for line in corpus_file(trained).read_text().splitlines()
        ],
    )
    assert same_shape.num_tokens == trained["ix"].num_tokens
    with pytest.raises(ValueError, match="another token index"):
        KnnDatastore.open(flat.directory, same_shape, weights_sha256(trained["run"]))
    with pytest.raises(ValueError, match=r"other settings \(factory\)"):
        build.build_knn(knn_config(trained, flat.directory, factory="IVF4,Flat"))


def flip(path: Path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x5A
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "damage, words",
    [
        ("header", "does not match its sha256"),
        ("middle", "does not match its sha256"),
        ("lambda", "λ 7.5 is not in [0, 1]"),
        ("temperature", "temperature 0 is not a positive number"),
    ],
)
def test_a_damaged_datastore_is_refused_with_one_line(trained, flat, tmp_path, damage, words):
    """A flipped byte in a stored faiss file (its header or its middle) is found by its
    sha256 in knn.json; a calibration out of range is named, not met as a math error."""
    store = Path(shutil.copytree(flat.directory, tmp_path / "store"))
    shard = store / flat.manifest["shards"][0]["file"]
    if damage in ("header", "middle"):
        flip(shard, 2 if damage == "header" else shard.stat().st_size // 2)
    else:
        m = json.loads((store / "knn.json").read_text())
        if damage == "lambda":
            m["calibration"]["model"]["lam"] = 7.5
        else:
            m["calibration"]["model_alone"]["temperature"] = 0
        (store / "knn.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match="rebuild the datastore") as refused:
        KnnDatastore.open(store, trained["ix"], weights_sha256(trained["run"]))
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_held_out_text_is_not_stored_and_finds_its_training_copy(corpus):
    """No stored key lies in a held-out document. Read by a model whose keys depend on the
    text alone, the held-out copy of training document 13 finds, at every position, the same
    position of document 13 at distance ~0: never itself."""
    plain = train_tiny(*corpus, "plain", index_input=False)
    ix, faiss = plain["ix"], import_faiss()
    build.build_knn(knn_config(plain, plain["base"] / "plain-knn"))
    store = KnnDatastore.open(plain["base"] / "plain-knn", ix, weights_sha256(plain["run"]))
    ids = np.concatenate([faiss.vector_to_array(s.id_map) for s in store.indexes])
    documents = np.searchsorted(np.asarray(ix.offsets), ids, side="right") - 1
    assert not held_out(documents, HOLDOUT).any()
    keys, positions = hidden_states(plain["model"], ix, DUPLICATE)
    found = store.search(keys)
    offset = ix.document_range(ORIGINAL)[0] - ix.document_range(DUPLICATE)[0]
    assert found.distances[:, 0].max() < 1e-6
    # past a window's first tokens (whose one- or two-token contexts recur exactly elsewhere)
    seen = (positions - positions[0]) % plain["model"].cfg.max_seq_len >= 3
    assert (found.positions[seen, 0] == positions[seen] + offset).all()
    following = ix.tokens(positions[0] + 1, positions[-1] + 2)
    np.testing.assert_array_equal(found.tokens[seen, 0], following[seen])


def test_build_knn_and_eval_on_the_command_line(trained, tmp_path):
    run, index, out = trained["run"], trained["ix"].directory, tmp_path / "knn"

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "teralm.cli", *map(str, args)], capture_output=True, text=True
        )

    build = ("build-knn", run, "--index", index, "--out", out, "--shard-tokens", 2000)
    with folder_held(out) as holder:
        busy = cli(*build, "--quiet")
    assert busy.returncode == 1 and f"in use by a test's holder (pid {holder}" in busy.stderr
    assert busy.stderr.count("\n") == 1 and not (out / "knn.json").exists()
    made = cli(*build, "--factory", "IVF4,Flat", "--quiet")
    assert made.returncode == 0, made.stderr
    assert "shards merged" in made.stdout and "with kNN" in made.stdout
    # the plan, first: the keys the summary counts, the factory, the size and the time
    keys = json.loads((out / "knn.json").read_text())
    total = sum(s["keys"] for s in keys["shards"])
    first = made.stdout.splitlines()[0]
    assert first.startswith(f"build-knn: {total:,} keys of {keys['dim']} from "), first
    assert "faiss IVF4,Flat, about " in first and "µs a key)" in first, first
    again = cli(*build, "--factory", "IVF4,Flat", "--quiet")
    assert again.returncode == 0 and "every shard earlier" in again.stdout
    scored = cli("eval", run, "--index", index, "--knn", out, "--json", "--quiet")
    assert scored.returncode == 0, scored.stderr
    result = json.loads(scored.stdout)
    assert all(0 < result[k] < 9 for k in ("model", "model_knn", "model_alone_knn"))
    wrong = cli("eval", run, "--index", index, "--knn", tmp_path)
    assert wrong.returncode == 1 and "no kNN datastore here" in wrong.stderr
    for name in ("merged.faiss", "merged.ivfdata"):  # the merged files are checked too
        damaged = Path(shutil.copytree(out, tmp_path / f"damaged-{name}"))
        flip(damaged / name, (damaged / name).stat().st_size // 2)
        refused = cli("eval", run, "--index", index, "--knn", damaged, "--quiet")
        assert refused.returncode == 1 and f"{name} does not match its sha256" in refused.stderr
        assert refused.stderr.count("\n") == 1, refused.stderr


def echoed(engine: Engine, prompt: list[int]) -> list[float]:
    """The engine's log-probability of each prompt token after the first (echo)."""
    events: list = []
    engine.submit([Sequence(prompt, Sampling(max_tokens=0, echo=True), events.append)])
    deadline = time.time() + 120
    while not (events and events[-1].finish) and time.time() < deadline:
        time.sleep(0.02)
    return [e.logprob for e in events if e.prompt][1:]


@torch.no_grad()
def test_engine_mixes_the_neighbours_of_its_hidden_states(trained, flat):
    """Echoed log-probabilities with the datastore are ``log(λ p_knn + (1 - λ) p)`` of those
    without it, ``p_knn`` from a search with the model's own forward; the lookup names the
    neighbours' documents."""
    ix, model = trained["ix"], trained["model"]
    start, stop = ix.document_range(0)
    prompt = [int(t) for t in ix.tokens(start, min(stop, start + model.cfg.max_seq_len))]
    engines = [Engine(model, ix, max_batch=2, knn=store) for store in (None, flat)]
    try:
        plain, mixed = (echoed(engine, prompt) for engine in engines)
    finally:
        for engine in engines:
            engine.close()
    lengths, nexts = zip(*OnlineMatcher(ix).extend(prompt))
    columns = (torch.tensor([xs]) for xs in (prompt, nexts, lengths))
    found = flat.search(model.hidden(*columns)[0].numpy())
    mix = flat.calibration["model"]
    p_knn = knn_target_probs(found.tokens, found.distances, prompt[1:] + [0], mix["temperature"])
    want = np.log(mix["lam"] * p_knn[:-1] + (1 - mix["lam"]) * np.exp(plain))
    np.testing.assert_allclose(mixed[3:], want[3:], atol=1e-4)  # past ties of short contexts
    assert not np.allclose(mixed, plain)


def test_server_names_the_neighbours_documents(trained, flat):
    """With a datastore, /v1/lookup and a completion's index view list the neighbours of the
    model's state after the text, with the documents they come from; without one, neither
    has the field."""
    ix, model = trained["ix"], trained["model"]
    start, _ = ix.document_range(ORIGINAL)
    text = ix.decode(ix.tokens(start, start + 40))
    tokens = [int(t) for t in ix.encode(text)]
    lengths, nexts = zip(*OnlineMatcher(ix).extend(tokens))
    columns = (torch.tensor([xs]) for xs in (tokens, nexts, lengths))
    with torch.no_grad():
        found = flat.search(model.hidden(*columns)[0, -1:].numpy())
    with serve_in_thread(model, ix, knn=flat) as server:
        code, answer = request(server["port"], "POST", "/v1/lookup", {"text": text})
        assert code == 200, answer
        body = {"prompt": text, "max_tokens": 2, "index": "tokens"}
        code, completion = request(server["port"], "POST", "/v1/completions", body)
    assert code == 200, completion
    first_token = completion["choices"][0]["index_tokens"][0]  # after the prompt's last state
    assert [n["document"] for n in first_token["neighbours"]] == [
        int(np.searchsorted(ix.offsets, p, side="right")) - 1 for p in found.positions[0, :3]
    ]
    for neighbours in (answer["neighbours"], completion["index"]["neighbours"]):
        assert [n["document"] for n in neighbours] == [
            int(np.searchsorted(ix.offsets, p, side="right")) - 1 for p in found.positions[0]
        ]
        first = neighbours[0]
        doc_start, _ = ix.document_range(first["document"])
        assert first["offset"] == found.positions[0, 0] - doc_start
        assert first["text"] == ix.decode([first["token"]]) and first["source"]
    with serve_in_thread(model, ix) as server:
        _, answer = request(server["port"], "POST", "/v1/lookup", {"text": text})
    assert "neighbours" not in answer
