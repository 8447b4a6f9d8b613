"""kNN datastore benchmark: what the embedding index adds to the model and the ∞-gram on pydocs.

    pip install -e '.[knn]'
    python benchmarks/bench_knn.py [--max-tokens 100000] [--queries 2000]
    python benchmarks/bench_knn.py --factories 'IVF8192,PQ32' 'OPQ32_64,IVF8192,PQ32'
    python benchmarks/bench_knn.py --speed [--speed-bytes 3000000]

Trains the ``tiny`` preset with the index on pydocs (as bench_quality.py does; reused when it is
there), builds its kNN datastore with ``teralm build-knn`` (default factory), then reports:
  - held-out bpb (``teralm eval --knn``, on the held-out documents the calibration did not
    see) of the model alone, the model + kNN, the model + ∞-gram as served, and all three;
  - the build's wall time and bytes per token;
  - search against exact (faiss Flat) neighbours over the keys of the datastore's first shard,
    recomputed and added to its trained index again: recall@8 (of the exact 8 nearest, how many the index returns, a returned key
    as near as the 8th counting as one) and 1-recall@8 (the nearest among the 8 returned), and
    the query time per position of both (Flat over that one shard; IVF-PQ over all shards);
  - a paraphrase test: held-out text with one word in five (where a table knows one) replaced
    by a synonym, scored with the index and the datastore seeing the text as new, against the
    same text unchanged: the relative gain of the kNN and of the ∞-gram on each.
Prints tables and writes benchmarks/results/bench_knn.json. With ``--factories``, only the
search comparison, for each factory trained as the build trains it, with no datastore built
(benchmarks/results/bench_knn_factories.json). With ``--speed``, only the build's speed: on the
first ``--speed-bytes`` of pydocs, with the ``tiny`` preset trained 30 steps on them, the model's
forward pass over every key alone (as the build batches it, no faiss), then ``teralm build-knn``
on a quiet machine and beside a busy loop on one core, and recall@8 of the quiet build's first
shard (benchmarks/results/bench_knn_speed.json).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from common import CACHE, PYDOCS, corpus_index, run_measured, save, table, teralm_cli
from common import TERALM as CLI

from teralm.index import Index
from teralm.index.knn import TRAINED, KnnDatastore, import_faiss, set_nprobe
from teralm.index.query import OnlineMatcher
from teralm.infer.load import load_model
from teralm.infer.mixture import infgram_probs, knn_target_probs, next_token_logp
from teralm.infer.precision import autocast
from teralm.model.checkpoint import weights_sha256
from teralm.train.evaluate import document_windows, held_out_documents
from teralm.train.knn import (
    KeyWriter,
    KnnBuildConfig,
    shard_documents,
    training_documents,
    training_keys,
    training_size,
)

WORK = CACHE / "knn"
RUN, STORE = WORK / "run", WORK / "store"

# Words and a replacement of the same sense, for the paraphrase test (lowercase; the case of
# the first letter is kept; "_" stands for a space).
SYNONYMS = dict(
    re.findall(
        r"(\w+):(\S+)",
        """the:this a:one an:one is:remains are:remain was:stood were:stood be:become of:from
        to:towards and:plus in:within for:towards with:alongside on:upon by:via as:like
        this:that that:which it:this not:never or:otherwise can:may will:shall if:when
        use:employ used:employed using:employing returns:gives return:give value:quantity
        values:quantities function:routine functions:routines object:item objects:items
        method:procedure methods:procedures module:package modules:packages file:document
        files:documents new:fresh first:initial default:standard number:count string:text
        list:sequence example:instance following:next called:named call:invoke create:make
        created:made all:every each:every any:whatever more:additional only:solely
        also:additionally see:consult must:should should:ought when:whenever which:that
        has:holds have:hold data:information type:kind types:kinds name:label names:labels
        set:assign get:obtain change:alter changed:altered changes:alterations
        version:release class:category error:fault errors:faults argument:parameter
        arguments:parameters section:part may:might other:different same:identical but:yet
        because:since how:the_way large:big small:little result:outcome""",
    )
)
WORD = re.compile(r"[A-Za-z]+")


def paraphrase(text: str) -> tuple[str, float]:
    """``text`` with every fifth word replaced by its synonym where the table has one; and the
    fraction of words replaced."""
    words = list(WORD.finditer(text))
    out, last, swapped = [], 0, 0
    for i, m in enumerate(words):
        word = m.group()
        other = SYNONYMS.get(word.lower()) if i % 5 == 4 else None
        if other is None:
            continue
        other = other.replace("_", " ")
        other = other[0].upper() + other[1:] if word[0].isupper() else other
        out += [text[last : m.start()], other]
        last, swapped = m.end(), swapped + 1
    return "".join([*out, text[last:]]), swapped / max(1, len(words))


@torch.no_grad()
def score_new_text(model, ix: Index, store: KnnDatastore, tokens: list[int]) -> dict:
    """Nats per token of a text that the index and the datastore see as new (as a server sees
    a prompt: features from the online matcher, the ∞-gram of the whole corpus), in windows of
    the model's context from the text's start: the model alone, + ∞-gram as served, and each
    + kNN at its calibrated weight."""
    lengths, nexts = zip(*OnlineMatcher(ix).extend(tokens))
    window, nats = (
        model.cfg.max_seq_len,
        {k: [] for k in ("alone", "served", "alone+knn", "served+knn")},
    )
    for a in range(0, len(tokens) - 1, window):
        b = min(a + window, len(tokens) - 1)
        columns = (torch.tensor([xs[a:b]]) for xs in (tokens, nexts, lengths))
        with autocast(torch.device("cpu"), model.cfg.precision):
            hidden = model.hidden(*columns)
            logits, gate = model.head(hidden)
        contexts = [tokens[: p + 1] for p in range(a, b)]
        targets = np.array(tokens[a + 1 : b + 1])
        served = next_token_logp(model, logits[0], gate[0], infgram_probs(ix, contexts))
        alone = torch.log_softmax(logits[0].float(), dim=-1)
        found = store.search(hidden[0].float().numpy())
        for name, logp in (("alone", alone), ("served", served)):
            p = np.exp(logp.numpy()[np.arange(len(targets)), targets].astype(np.float64))
            mix = store.calibration["model" if name == "served" else "model_alone"]
            p_knn = knn_target_probs(found.tokens, found.distances, targets, mix["temperature"])
            nats[name].append(-np.log(p))
            nats[f"{name}+knn"].append(-np.log(mix["lam"] * p_knn + (1 - mix["lam"]) * p))
    return {k: np.concatenate(v) for k, v in nats.items()}


def paraphrase_test(model, ix: Index, store: KnnDatastore, max_tokens: int) -> list[dict]:
    """bpb of held-out test documents unchanged and paraphrased, and each system's gain."""
    texts, originals, fractions = [], [], []
    for doc in held_out_documents(ix, store.manifest["holdout_every"], "test"):
        start, stop = ix.document_range(doc)
        text = ix.decode(ix.tokens(start, min(stop, start + 4 * model.cfg.max_seq_len)))
        changed, fraction = paraphrase(text)
        originals.append(text)
        texts.append(changed)
        fractions.append(fraction)
        if sum(map(len, originals)) >= max_tokens:
            break
    rows = []
    for name, docs in (("unchanged", originals), ("paraphrased", texts)):
        scored = [score_new_text(model, ix, store, [int(t) for t in ix.encode(d)]) for d in docs]
        bpb = {
            k: float(np.concatenate([s[k] for s in scored]).mean() / math.log(2)) for k in scored[0]
        }
        rows.append(
            {
                "text": name,
                **bpb,
                "infgram_gain": 1 - bpb["served"] / bpb["alone"],
                "knn_gain": 1 - bpb["served+knn"] / bpb["served"],
                "knn_gain_alone": 1 - bpb["alone+knn"] / bpb["alone"],
                "words_replaced": float(np.mean(fractions)) if name == "paraphrased" else 0.0,
            }
        )
    return rows


def shard_zero_keys(model, ix: Index, holdout: int, shard_tokens: int, queries: int):
    """Recomputed keys and positions of the datastore's first shard, and the keys of
    ``queries`` held-out test positions to search for."""
    writer = KeyWriter(model, ix, torch.device("cpu"), 16)
    seq_len = model.cfg.max_seq_len
    docs = shard_documents(ix, holdout, 0, shard_tokens)
    keys, positions = writer.keys(list(document_windows(ix, docs, seq_len)))
    test = held_out_documents(ix, holdout, "test")
    probes = writer.keys(list(document_windows(ix, test, seq_len, queries)))[0]
    return keys, positions, probes


def exact_neighbours(keys: np.ndarray, probes: np.ndarray):
    """The 8 nearest ``keys`` of each probe by exhaustive search (faiss Flat): squared
    distances, rows, and the search's seconds per probe."""
    exact = import_faiss().IndexFlatL2(keys.shape[1])
    exact.add(keys)
    began = time.perf_counter()
    flat_d, flat_i = exact.search(probes, 8)
    return flat_d, flat_i, (time.perf_counter() - began) / len(probes)


def recall(index, keys, positions, probes, flat_d, flat_i) -> dict:
    """Recall@8 (of the exact 8 nearest, how many ``index`` returns; one as near as the 8th
    counts) and 1-recall@8 of ``index`` holding ``keys`` under ids ``positions``, against the
    exact neighbours ``flat_d``/``flat_i`` of ``probes``."""
    _, found = index.search(probes, 8)
    rows = np.searchsorted(positions, found)  # the returned ids' rows in ``keys``
    true_d = ((probes[:, None, :] - keys[np.minimum(rows, len(keys) - 1)]) ** 2).sum(-1)
    near = (found >= 0) & (true_d <= flat_d[:, 7:8] * (1 + 1e-5) + 1e-6)
    return {
        "recall_at_8": float(np.minimum(near.sum(1), 8).mean() / 8),
        "one_recall_at_8": float((found == positions[flat_i[:, :1]]).any(1).mean()),
    }


def search_quality(
    model, ix: Index, store: KnnDatastore, queries: int, folder: Path = STORE
) -> dict:
    """Recall@8 of the datastore's first shard against exact search over its recomputed keys,
    and query times per position (``folder``: the datastore's)."""
    faiss = import_faiss()
    m = store.manifest
    keys, positions, probes = shard_zero_keys(
        model, ix, m["holdout_every"], m["shard_tokens"], queries
    )
    flat_d, flat_i, flat_s = exact_neighbours(keys, probes)
    shard = faiss.read_index(str(folder / TRAINED))  # shard 0 again, from the trained index
    shard.add_with_ids(keys, positions)
    set_nprobe(shard, store.calibration["nprobe"])
    found = recall(shard, keys, positions, probes, flat_d, flat_i)
    began = time.perf_counter()
    for i in range(0, len(probes), 256):
        store.search(probes[i : i + 256])
    full_s = (time.perf_counter() - began) / len(probes)
    return {
        "shard_keys": int(len(keys)),
        "datastore_keys": store.num_keys,
        **found,
        "flat_ms_per_query_one_shard": 1e3 * flat_s,
        "flat_ms_per_query_all_keys": 1e3 * flat_s * store.num_keys / len(keys),
        "ivfpq_ms_per_query_all_shards": 1e3 * full_s,
    }


def compare_factories(model, state: dict, ix: Index, factories: list[str], queries: int) -> list:
    """Each factory trained as ``teralm build-knn`` trains it (its sample of training keys),
    then given the first shard's keys: recall@8 against Flat, code bytes, and times."""
    faiss = import_faiss()
    holdout = state["config"]["train"]["holdout_every"]
    keys, positions, probes = shard_zero_keys(model, ix, holdout, 1 << 22, queries)
    flat_d, flat_i, _ = exact_neighbours(keys, probes)
    train_docs, num_keys = training_documents(ix, holdout)
    writer = KeyWriter(model, ix, torch.device("cpu"), 16)
    windows = list(document_windows(ix, train_docs, model.cfg.max_seq_len))
    largest = max(training_size(f, num_keys) for f in factories)
    sample = training_keys(writer, windows, largest)  # each takes a prefix, as the build would
    rows = []
    for factory in factories:
        began = time.perf_counter()
        index = faiss.index_factory(keys.shape[1], factory)
        index.train(sample[: training_size(factory, num_keys)])
        trained = time.perf_counter()
        index.add_with_ids(keys, positions)
        added = time.perf_counter()
        set_nprobe(index, KnnBuildConfig.nprobe)
        found = recall(index, keys, positions, probes, flat_d, flat_i)
        searched = (time.perf_counter() - added) / len(probes)
        rows.append(
            {
                "factory": factory,
                **found,
                "code_bytes": faiss.extract_index_ivf(index).code_size,
                "train_s": trained - began,
                "add_s": added - trained,
                "ms_per_query": 1e3 * searched,
            }
        )
        print(table(rows[-1:], FACTORY_COLUMNS), flush=True)
    return rows


FACTORY_COLUMNS = [
    ("factory", "factory", "s"),
    ("recall_at_8", "recall@8", ".3f"),
    ("one_recall_at_8", "1-recall@8", ".3f"),
    ("code_bytes", "code B", "d"),
    ("train_s", "train s", ".0f"),
    ("add_s", "add s", ".0f"),
    ("ms_per_query", "ms/query", ".2f"),
]


FORWARD = """
import sys, time
from pathlib import Path
from teralm.train.knn import KeyWriter, training_documents
from teralm.index import Index
from teralm.infer.load import load_model
from teralm.infer.precision import default_device
from teralm.train.evaluate import document_windows
ix, device = Index.open(sys.argv[1]), default_device()
model, state, _ = load_model(Path(sys.argv[2]), device, "auto")
docs, keys = training_documents(ix, state["config"]["train"]["holdout_every"])
windows = list(document_windows(ix, docs, model.cfg.max_seq_len))
writer = KeyWriter(model, ix, device, 16)
began = time.perf_counter()
for i in range(0, len(windows), 256):
    writer.keys(windows[i : i + 256])
print(time.perf_counter() - began, keys)
"""


def build_speed(corpus_bytes: int, queries: int) -> dict:
    """The build against the model's forward pass over the same keys (see the docstring)."""
    work = WORK / "speed"
    work.mkdir(parents=True, exist_ok=True)
    corpus, index, run = work / "corpus.jsonl", work / "index", work / "run"
    if not corpus.exists():
        with gzip.open(PYDOCS, "rt") as lines, open(corpus, "w") as out:
            size = 0
            for line in lines:
                out.write(line)
                size += len(json.loads(line)["text"])
                if size >= corpus_bytes:
                    break
    teralm_cli("build-index", corpus, "--out", index, "--quiet")
    teralm_cli("train", "--index", index, "--out", run, "--preset", "tiny", "--max-steps", 30,
               "--quiet", "--resume")  # fmt: skip
    forward = run_measured([sys.executable, "-c", FORWARD, str(index), str(run)])
    forward_s, keys = forward["output"].split()[-2:]
    rows = [{"run": "forward pass alone", "wall_s": float(forward_s)}]
    for beside in ("quiet", "busy loop beside"):
        shutil.rmtree(work / "store", ignore_errors=True)
        hog = (
            subprocess.Popen([sys.executable, "-c", "while True: pass"])
            if "busy" in beside
            else None
        )
        try:
            built = run_measured([*CLI, "build-knn", str(run), "--index", str(index), "--out",
                                  str(work / "store"), "--quiet"])  # fmt: skip
        finally:
            if hog is not None:
                hog.kill()
        if built["returncode"]:
            raise SystemExit(f"build-knn failed:\n{built['output']}")
        rows.append({"run": f"build-knn, {beside}", "wall_s": built["wall_s"]})
        print(built["output"].splitlines()[0], flush=True)
    for row in rows:
        row["ratio"] = row["wall_s"] / rows[0]["wall_s"]
    ix = Index.open(index)
    model, _, _ = load_model(run, torch.device("cpu"))
    store = KnnDatastore.open(work / "store", ix, weights_sha256(run))
    search = search_quality(model, ix, store, queries, work / "store")
    return {"keys": int(keys), "rows": rows, "plan": built["output"].splitlines()[0], **search}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=100_000, help="held-out targets")
    parser.add_argument("--queries", type=int, default=2000, help="positions for the recall")
    parser.add_argument("--paraphrase-tokens", type=int, default=30_000)
    parser.add_argument(
        "--factories",
        nargs="+",
        metavar="FACTORY",
        help="only compare these faiss factories' recall@8 on the first shard (IVF ones, "
        "nprobe 32), without building the datastore",
    )
    parser.add_argument("--speed", action="store_true", help="only the build's speed")
    parser.add_argument("--speed-bytes", type=int, default=3_000_000)
    args = parser.parse_args()
    if args.speed:
        result = build_speed(args.speed_bytes, args.queries)
        print(f"{result['keys']:,} keys; recall@8 of shard 0 {result['recall_at_8']:.3f}")
        print(table(result["rows"], [("run", "run", "s"), ("wall_s", "wall s", ".1f"),
                                     ("ratio", "÷ forward", ".2f")]))  # fmt: skip
        print(f"wrote {save('bench_knn_speed', result)}")
        return
    _, index = corpus_index("pydocs")
    WORK.mkdir(parents=True, exist_ok=True)
    teralm_cli("train", "--index", index, "--out", RUN, "--preset", "tiny", "--quiet", "--resume")
    if args.factories:
        model, state, _ = load_model(RUN, torch.device("cpu"))
        rows = compare_factories(model, state, Index.open(index), args.factories, args.queries)
        print(table(rows, FACTORY_COLUMNS))
        print(f"wrote {save('bench_knn_factories', {'rows': rows})}")
        return
    build_log = WORK / "build.json"
    if not build_log.exists():
        measured = run_measured(
            [*CLI, "build-knn", RUN, "--index", index, "--out", STORE, "--quiet"]
        )
        if measured["returncode"]:
            raise SystemExit(f"build-knn failed:\n{measured['output']}")
        build_log.write_text(json.dumps(measured))
    build = json.loads(build_log.read_text())
    print(build["output"])
    scored = json.loads(
        teralm_cli(
            "eval",
            RUN,
            "--index",
            index,
            "--knn",
            STORE,
            "--max-tokens",
            args.max_tokens,
            "--json",
            "--quiet",
        )
    )
    ix = Index.open(index)
    model, _, _ = load_model(RUN, torch.device("cpu"))
    store = KnnDatastore.open(STORE, ix, weights_sha256(RUN))
    stored = sum(f.stat().st_size for f in STORE.iterdir())  # every file, trained.faiss too
    per_token = stored / ix.num_tokens
    rows = [
        {"system": "model alone", "bpb": scored["model_alone"]},
        {"system": "model + kNN", "bpb": scored["model_alone_knn"]},
        {"system": "model + ∞-gram as served", "bpb": scored["model"]},
        {"system": "model + kNN + ∞-gram", "bpb": scored["model_knn"]},
        {"system": "∞-gram alone", "bpb": scored["infgram"]},
    ]
    others = min(r["bpb"] for r in rows[:3])
    search = search_quality(model, ix, store, args.queries)
    paraphrased = paraphrase_test(model, ix, store, args.paraphrase_tokens)
    print(f"pydocs held-out test half: {scored['tokens']:,} bytes; tiny preset with the index")
    print(table(rows, [("system", "system", "s"), ("bpb", "bpb", ".4f")]))
    print(
        f"model + kNN + ∞-gram vs the best of the others: {scored['model_knn'] / others:.3f}x "
        "(target <= 0.95)"
    )
    print(
        f"datastore: {store.num_keys:,} keys, {store.manifest['factory']}, "
        f"{stored / store.num_keys:.1f} bytes/key, {per_token:.1f} bytes/token of the corpus "
        f"(target <= 40), build {build['wall_s']:.0f} s, "
        f"peak RSS {build['peak_rss'] / 2**30:.2f} GiB"
    )
    print(
        f"search over shard 0 ({search['shard_keys']:,} keys) against Flat: recall@8 "
        f"{search['recall_at_8']:.3f} (target >= 0.9), 1-recall@8 {search['one_recall_at_8']:.3f}; "
        f"ms/query: Flat {search['flat_ms_per_query_one_shard']:.2f} on the shard "
        f"(~{search['flat_ms_per_query_all_keys']:.0f} over all keys), IVF-PQ over all shards "
        f"{search['ivfpq_ms_per_query_all_shards']:.2f}"
    )
    print(
        table(
            paraphrased,
            [
                ("text", "text", "s"),
                ("alone", "model", ".4f"),
                ("served", "+ ∞-gram", ".4f"),
                ("alone+knn", "+ kNN", ".4f"),
                ("served+knn", "+ both", ".4f"),
                ("infgram_gain", "∞-gram gain", ".3f"),
                ("knn_gain", "kNN gain", ".3f"),
            ],
        )
    )
    payload = {
        "rows": rows,
        "eval": scored,
        "ratio": scored["model_knn"] / others,
        "bytes_per_key": stored / store.num_keys,
        "bytes_per_token": per_token,
        "build": {k: build[k] for k in ("wall_s", "peak_rss")},
        "search": search,
        "paraphrase": paraphrased,
        "calibration": store.calibration,
        "factory": store.manifest["factory"],
    }
    print(f"wrote {save('bench_knn', payload)}")


if __name__ == "__main__":
    main()
