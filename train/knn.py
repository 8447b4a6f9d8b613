"""``teralm build-knn``: the kNN datastore of a trained run over its index's training text
(format: teralm.index.knn), built in resumable shards.

1. The faiss index named by the factory string is trained once, on the keys of a random sample of
   training windows, and written as ``trained.faiss``.
2. Shard by shard, the training documents that start in the shard's positions go through the
   model in windows of its context, each document from its start (as ``teralm eval`` reads
   held-out text). Each position's hidden state is added with the position as its id; the
   shard's index is written whole (temp name, fsync, rename), then recorded in the manifest. A
   killed build re-run with the same command redoes only the shard it was in.
3. Calibration: the kNN distribution's temperature and mixture weight are chosen on the
   validation half of the held-out documents (no held-out document is in the datastore;
   ``teralm eval --knn`` scores the other half).

The key is the last block's output, the final norm's input: the state the output layer reads,
before the norm rescales each channel for the output embedding. Khandelwal et al. found the input
of the last feed-forward layer the best key for their model; ours is the same residual stream
one layer on, with that layer's work in it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from teralm.errors import ConfigError
from teralm.files import folder_lock, format_bytes, fsync_path, sha256_file, write_atomic
from teralm.index import Index
from teralm.index import format as fmt
from teralm.index.knn import (
    FORMAT,
    MANIFEST,
    MERGED,
    MERGED_DATA,
    TRAINED,
    VERSION,
    KnnDatastore,
    datastore_bytes,
    faiss_quiet,
    import_faiss,
    index_identity,
    read_manifest,
    shard_path,
)
from teralm.infer.load import check_tokenizer, load_model
from teralm.infer.precision import autocast, default_device
from teralm.model import Transformer, checkpoint
from teralm.model.config import AUTO
from teralm.model.transformer import FollowerInput
from teralm.train.data import fragment, held_out
from teralm.train.evaluate import (
    calibrate_knn,
    document_windows,
    held_out_documents,
    score,
    summarize,
    window_answers,
)

KEY = "final norm input"
FLAT_KEYS = 1 << 18  # the default factory stores keys whole up to this many (1 KiB each at 256)
# OPQ's rotation is trained in this many rounds (faiss: 50). On 3M keys of pydocs, 15 gave the
# same recall@8 (0.932 against exact search, IVF2048, nprobe 32) in 21.7 s of training
# instead of 36.9 s (without polysemous training, which IVF-PQ searches here do not use and
# which took another 20 s).
OPQ_ROUNDS = 15
# the plan's estimate of faiss' share, per key added and per training key (measured on 2 Zen 4
# cores with the tiny preset's 256-dimensional keys: 4.3 µs and 22 s for 131,072)
ADD_US_PER_KEY = 4.3
TRAIN_US_PER_KEY = 170.0


@dataclass
class KnnBuildConfig:
    run: Path
    index: Path
    out: Path
    factory: str | None = None  # default: default_factory(keys, dim)
    shard_tokens: int = 1 << 22
    k: int = 32
    nprobe: int = 32
    validation_tokens: int = 50_000
    batch_windows: int = 16
    precision: str = "auto"
    force: bool = False
    progress: bool = True


@dataclass
class KnnBuildResult:
    manifest: dict
    wall_s: float
    built_shards: int


def default_factory(keys: int, dim: int) -> str:
    """``Flat`` for small datastores; else IVF with about √keys lists (a power of two, at least
    256) and PQ with a byte per 8 dimensions, at most 32 bytes (40 a key with its 8-byte id),
    behind an OPQ rotation that also reduces the keys to 2 dimensions per code byte.

    Hidden states put most of their variance in a few directions (on pydocs, the tiny
    preset's top 64 of 256 hold 98.8%). Rotated and reduced, the PQ spends its bytes where the
    keys differ: recall@8 against exact search rose from 0.64 to 0.85 there, at the same size."""
    if keys <= FLAT_KEYS:
        return "Flat"
    lists = 1 << max(8, round(math.log2(math.sqrt(keys))))
    codes = max(m for m in range(1, max(1, min(32, dim // 8)) + 1) if dim % m == 0)
    rotation = f"OPQ{codes}_{2 * codes}" if 2 * codes < dim else f"OPQ{codes}"
    return f"{rotation},IVF{lists},PQ{codes}"


def _with_ids(factory: str) -> str:
    """Factory strings of indexes that keep no ids of their own get an id map."""
    return factory if "IVF" in factory or factory.startswith("IDMap") else f"IDMap,{factory}"


def training_size(factory: str, keys: int) -> int:
    """Keys to train on: 64 per IVF list or PQ centroid (faiss asks for at least 39), at most
    2^18."""
    lists = int(factory.split("IVF")[1].split(",")[0].split("_")[0]) if "IVF" in factory else 0
    return min(keys, 1 << 18, 64 * max(lists, 256))


class KeyWriter:
    """Hidden states of training windows: ``keys(windows)`` runs them through the model in
    batches of ``batch`` (padded to the longest; causal attention keeps padding out of earlier
    positions) and returns their keys [n, d_model] and positions [n]."""

    def __init__(self, model: Transformer, ix: Index, device: torch.device, batch: int):
        self.model, self.ix, self.device, self.batch = model, ix, device, batch

    @torch.no_grad()
    def keys(self, windows: list[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray]:
        keys, positions = [], []
        for i in range(0, len(windows), self.batch):
            group = windows[i : i + self.batch]
            width = max(length for _, _, length in group)
            columns = np.zeros((3, len(group), width), dtype=np.int64)
            columns[1] = self.ix.no_token
            followers = []
            for row, (doc_start, a, length) in enumerate(group):
                tokens, next_token, match_len, _ = fragment(self.ix, a, length)
                columns[:, row, :length] = tokens, next_token, match_len
                positions.append(np.arange(a, a + length))
                window = (doc_start, a, length, match_len, self.device)
                followers.append(window_answers(self.ix, self.model, *window))
            inputs = torch.from_numpy(columns).to(self.device)
            with autocast(self.device, self.model.cfg.precision):
                padded = _padded(followers, width, self.model.cfg.vocab_size)
                hidden = self.model.hidden(*inputs, padded).float().cpu().numpy()
            keys += [hidden[row, :length] for row, (_, _, length) in enumerate(group)]
        if not keys:
            return np.empty((0, self.model.cfg.d_model), np.float32), np.empty(0, np.int64)
        return np.concatenate(keys), np.concatenate(positions)


def _padded(rows: list[FollowerInput | None], width: int, missing: int) -> FollowerInput | None:
    """Windows' followers ([1, length, ...] each) padded to ``width`` positions (no follower,
    ``missing``, in the padding) and stacked; None for a model without."""
    if rows[0] is None:
        return None
    columns = []
    for name, fill in zip(("tokens", "shares", "length", "total"), (missing, 0, 0, 0)):
        parts = [getattr(row, name) for row in rows]
        pads = [p.new_full((1, width - p.shape[1], *p.shape[2:]), fill) for p in parts]
        columns.append(torch.cat([torch.cat(pair, 1) for pair in zip(parts, pads)]))
    return FollowerInput(*columns)


def training_documents(ix: Index, holdout_every: int) -> tuple[list[int], int]:
    """The documents whose positions become keys, and the number of keys (every position of
    a document but its last, which has no value)."""
    docs = [d for d in range(ix.num_documents) if not held_out(d, holdout_every)]
    return docs, sum(int(ix.offsets[d + 1] - ix.offsets[d]) - 1 for d in docs)


def shard_documents(ix: Index, holdout_every: int, shard: int, shard_tokens: int) -> list[int]:
    """The training documents that start in the shard's positions."""
    starts = np.asarray(ix.offsets[:-1], dtype=np.int64)
    a, b = np.searchsorted(starts, [shard * shard_tokens, (shard + 1) * shard_tokens])
    return [d for d in range(int(a), int(b)) if not held_out(d, holdout_every)]


def _write_index(faiss, index, path: Path) -> None:
    """Write a faiss index so that readers see the old file or the whole new one."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        faiss.write_index(index, str(tmp))
        fsync_path(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_path(path.parent)


def _write_manifest(out: Path, manifest: dict) -> None:
    write_atomic(out / MANIFEST, json.dumps(manifest, indent=1).encode())


def _resumed_precision(out: Path) -> str | None:
    """The precision of the datastore in ``out`` being resumed, or None when there is none."""
    try:
        return read_manifest(out).get("precision")
    except (OSError, ValueError):
        return None


def _start(config: KnnBuildConfig, settings: dict) -> dict:
    """The manifest to continue: a new one, or the folder's own when it was built with the
    same settings; a ConfigError when it holds another datastore (unless ``force``)."""
    out = config.out
    if (out / MANIFEST).exists():
        try:
            m = read_manifest(out)
            different = [k for k, v in settings.items() if m.get(k) != v]
        except ValueError:
            if not config.force:
                raise
            different = ["manifest"]
        if not different:
            return m
        if not config.force:
            raise ConfigError(
                f"{out} holds a kNN datastore built with other settings ({', '.join(different)}); "
                "choose another --out, or --force to replace it"
            )
        for p in fmt.folder_contents(out):  # all but the lock this build holds
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    m = {"format": FORMAT, "version": VERSION, **settings, "shards": [], "complete": False}
    _write_manifest(out, m)
    return m


def build_knn(config: KnnBuildConfig) -> KnnBuildResult:
    """Build (or resume) the datastore; a TeralmError with a user message when it cannot (a
    FolderBusy at once when another build holds ``out``)."""
    out = config.out
    if (
        out.is_dir()
        and not (out / MANIFEST).exists()
        and fmt.folder_contents(out)
        and not config.force
    ):
        raise ConfigError(f"{out} exists and is not a kNN datastore; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    with folder_lock(out, "build-knn"):
        return _build_knn(config)


def _build_knn(config: KnnBuildConfig) -> KnnBuildResult:
    faiss = import_faiss()
    began = time.perf_counter()
    ix = Index.open(config.index)
    device = default_device()
    precision = config.precision
    if precision == AUTO and not config.force:  # a resumed build keeps what auto chose then
        precision = _resumed_precision(config.out) or precision
    model, state, choice = load_model(config.run, device, precision)
    check_tokenizer(state, ix)
    if not state.get("index") or ix.differs_from(state["index"]):
        raise ConfigError(f"the run was trained on another index than {config.index}")
    holdout = state["config"]["train"]["holdout_every"]
    seq_len, dim = model.cfg.max_seq_len, model.cfg.d_model
    shards = -(-ix.num_tokens // config.shard_tokens)
    validation_windows(ix, holdout, seq_len, config.validation_tokens)  # before hours of work
    train_docs, num_keys = training_documents(ix, holdout)
    settings = {
        "weights_sha256": checkpoint.weights_sha256(config.run),
        "index": index_identity(ix),
        "key": KEY,
        "dim": dim,
        "precision": choice.precision,
        "factory": config.factory or default_factory(num_keys, dim),
        "holdout_every": holdout,
        "seq_len": seq_len,
        "shard_tokens": config.shard_tokens,
    }
    m = _start(config, settings)
    m["run"] = str(config.run)  # where the weights were read (the checksum is what counts)
    writer = KeyWriter(model, ix, device, config.batch_windows)
    windows = list(document_windows(ix, train_docs, seq_len))
    print(plan(m, num_keys, len(train_docs), _seconds_per_key(writer, windows)), flush=True)
    if not (config.out / TRAINED).exists():
        _train_index(faiss, config, m, writer, windows, num_keys)
    done = {s["shard"] for s in m["shards"]}
    bar = tqdm(
        total=num_keys, desc="keys", unit="key", unit_scale=True, disable=not config.progress
    )
    bar.update(sum(s["keys"] for s in m["shards"]))
    built = [k for k in range(shards) if k not in done]
    for shard in built:
        docs = shard_documents(ix, holdout, shard, config.shard_tokens)
        m["shards"].append(_build_shard(faiss, config, writer, ix, shard, docs, bar))
        _write_manifest(config.out, m)
    bar.close()
    _finish(faiss, config, m, ix, model, device)
    return KnnBuildResult(m, time.perf_counter() - began, len(built))


def _train_index(faiss, config: KnnBuildConfig, m: dict, writer, windows, num_keys: int) -> None:
    """The empty faiss index of ``m["factory"]``, trained on a sample of the keys (when its
    factory needs training), written to ``TRAINED``."""
    index = faiss.index_factory(m["dim"], _with_ids(m["factory"]))
    if not index.is_trained:
        size = training_size(m["factory"], num_keys)
        with tqdm(
            total=size, desc="training keys", unit="key", unit_scale=True,
            disable=not config.progress,
        ) as bar:  # fmt: skip
            keys = training_keys(writer, windows, size, bar)
        with _stage("train faiss", config.progress):
            _train(faiss, index, keys)
    _write_index(faiss, index, config.out / TRAINED)


def _finish(faiss, config: KnnBuildConfig, m: dict, ix, model, device) -> None:
    """Merge the shards of an IVF datastore into one, then calibrate the mixture (again when
    ``k`` or ``nprobe`` changed) and mark the datastore complete."""
    if "IVF" in m["factory"] and not m.get("merged"):
        with _stage("merge shards", config.progress):
            m["merged"] = _merge_shards(faiss, config.out, m["shards"])
        _write_manifest(config.out, m)
        for shard in m["shards"]:  # merged: the shards' files are work files now
            shard_path(config.out, shard["shard"]).unlink(missing_ok=True)
    calibration = m.get("calibration") or {}
    if not m["complete"] or (calibration.get("k"), calibration.get("nprobe")) != (
        config.k,
        config.nprobe,
    ):
        m["calibration"] = calibrate(config, m, ix, model, device)
        m["complete"] = True
        _write_manifest(config.out, m)


def training_keys(writer: KeyWriter, windows: list, n: int, bar=None) -> np.ndarray:
    """The keys of the first ``n`` positions of the windows in a fixed random order."""
    order, keys, got = np.random.default_rng(0).permutation(len(windows)), [], 0
    for i in range(0, len(order), writer.batch):
        keys.append(writer.keys([windows[j] for j in order[i : i + writer.batch]])[0])
        got += len(keys[-1])
        if bar is not None:
            bar.update(min(got, n) - bar.n)
        if got >= n:
            break
    return np.concatenate(keys)[:n]


def _seconds_per_key(writer: KeyWriter, windows: list) -> float:
    """The model's time per key, from its second batch of windows (the first warms it up)."""
    sample = windows[: 2 * writer.batch]
    writer.keys(sample[: writer.batch])
    began = time.perf_counter()
    keys, _ = writer.keys(sample[writer.batch :] or sample)
    return (time.perf_counter() - began) / max(len(keys), 1)


def plan(m: dict, keys: int, documents: int, seconds_per_key: float) -> str:
    """The line ``build-knn`` prints before its work: what it builds and about what it costs."""
    forward = keys * seconds_per_key
    faiss_s = 0.0
    if "IVF" in m["factory"]:
        faiss_s = (
            keys * ADD_US_PER_KEY + training_size(m["factory"], keys) * TRAIN_US_PER_KEY
        ) / 1e6
    return (
        f"build-knn: {keys:,} keys of {m['dim']} from {documents:,} documents, faiss "
        f"{m['factory']}, about {format_bytes(expected_bytes(m['factory'], keys, m['dim']))} "
        f"on disk; about {_minutes(forward + faiss_s)} (the model's forward over them "
        f"{_minutes(forward)}, {seconds_per_key * 1e6:.0f} µs a key)"
    )


def expected_bytes(factory: str, keys: int, dim: int) -> int:
    """The datastore's size: a key's code (its dimensions as fp32 for Flat, else the PQ's
    bytes) and its 8-byte id, plus the IVF lists' centroids, the PQ's codebooks and the OPQ
    rotation, in the dimensions the rotation leaves."""
    if "PQ" not in factory.replace("OPQ", ""):
        return keys * (4 * dim + 8)
    code = int(factory.rsplit("PQ", 1)[1].split("x")[0])
    lists = int(factory.split("IVF")[1].split(",")[0].split("_")[0]) if "IVF" in factory else 0
    rotation = factory.split(",")[0] if factory.startswith("OPQ") else ""
    reduced = int(rotation.split("_")[1]) if "_" in rotation else dim
    return keys * (code + 8) + (lists + 256) * reduced * 4 + (dim * reduced * 4 if rotation else 0)


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


@contextlib.contextmanager
def _stage(desc: str, progress: bool) -> Iterator[None]:
    """A progress line with the time taken so far, for a step that reports no progress."""
    bar = tqdm(total=1, desc=desc, bar_format="{desc}: {elapsed}", disable=not progress)
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(1.0):
            bar.refresh()

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join()
        bar.update(1)
        bar.close()


def _train(faiss, index, keys: np.ndarray) -> None:
    """Train an empty index: OPQ in OPQ_ROUNDS rounds, IVF-PQ without polysemous training.
    With faiss-gpu on a CUDA machine, an IVF index's lists are clustered on the GPUs (the costly
    part of training); everything else runs on the CPU."""
    if isinstance(index, faiss.IndexPreTransform):
        for i in range(index.chain.size()):
            transform = faiss.downcast_VectorTransform(index.chain.at(i))
            if isinstance(transform, faiss.OPQMatrix):
                transform.niter = OPQ_ROUNDS
    with contextlib.suppress(RuntimeError):  # raised for an index without lists
        ivf = faiss.downcast_index(faiss.extract_index_ivf(index))
        if isinstance(ivf, faiss.IndexIVFPQ):
            ivf.do_polysemous_training = False
        if getattr(faiss, "get_num_gpus", lambda: 0)() > 0:
            ivf.clustering_index = faiss.index_cpu_to_all_gpus(faiss.IndexFlatL2(ivf.d))
    index.train(keys)


def _build_shard(faiss, config, writer: KeyWriter, ix: Index, shard: int, docs, bar) -> dict:
    """Add the keys of the shard's documents to a copy of the trained index and write it whole;
    the shard's manifest record."""
    windows = list(document_windows(ix, docs, writer.model.cfg.max_seq_len))
    index = faiss.read_index(str(config.out / TRAINED))
    count, step = 0, 16 * writer.batch
    for i in range(0, len(windows), step):
        keys, positions = writer.keys(windows[i : i + step])
        index.add_with_ids(keys, positions)
        count += len(keys)
        bar.update(len(keys))
    path = shard_path(config.out, shard)
    record = {"shard": shard, "keys": count, "file": path.name, "bytes": 0, "sha256": None}
    if count:
        _write_index(faiss, index, path)
        record.update(bytes=path.stat().st_size, sha256=sha256_file(path))
    return record


def _merge_shards(faiss, out: Path, shards: list[dict]) -> dict:
    """Merge the shards' inverted lists into one index over one on-disk list file (faiss'
    ondisk merge): one coarse quantizer to search and store instead of one per shard, read
    memory-mapped. Its manifest record (the list file's name is fixed: the index names it)."""
    from faiss.contrib.ondisk import merge_ondisk

    data = out / MERGED_DATA
    data.unlink(missing_ok=True)  # a merge that was killed: start it afresh
    index = faiss.read_index(str(out / TRAINED))
    with faiss_quiet():
        merge_ondisk(
            index, [str(out / s["file"]) for s in shards if s["keys"]], str(data.resolve())
        )
    fsync_path(data)
    # the index names its list file: by its name alone (readers look beside the index), so
    # that the folder can move and its files do not depend on where it was built
    faiss.downcast_InvertedLists(faiss.extract_index_ivf(index).invlists).filename = MERGED_DATA
    _write_index(faiss, index, out / MERGED)
    return {
        "file": MERGED,
        "data": MERGED_DATA,
        "bytes": (out / MERGED).stat().st_size + data.stat().st_size,
        "sha256": sha256_file(data),
        "index_sha256": sha256_file(out / MERGED),
    }


def validation_windows(ix: Index, holdout_every: int, seq_len: int, tokens: int) -> list:
    """The windows the calibration scores; a ConfigError when there are none."""
    docs = held_out_documents(ix, holdout_every, "validation")
    windows = list(document_windows(ix, docs, seq_len, tokens))
    if not windows:
        raise ConfigError(
            "no validation text to calibrate the kNN mixture on: the index needs at least two "
            "held-out documents (ids that are multiples of the run's holdout_every)"
        )
    return windows


def calibrate(config: KnnBuildConfig, m: dict, ix: Index, model, device) -> dict:
    """The kNN mixture's settings, chosen on the validation half of the held-out documents,
    with the validation scores they give."""
    windows = validation_windows(ix, m["holdout_every"], m["seq_len"], config.validation_tokens)
    store = KnnDatastore(config.out, m, ix, config.k, config.nprobe)
    scores = score(ix, model, windows, device, config.progress, store)
    choice = calibrate_knn(scores)
    summary = summarize(scores, ix.vocab_size, ix.manifest["tokenizer"] == "bytes", choice)
    return {"k": config.k, "nprobe": config.nprobe, **choice, "validation": summary}


def format_summary(result: KnnBuildResult, out: Path) -> str:
    """One screen: keys, bytes per token, what the build cost and the calibration."""
    m = result.manifest
    keys = sum(s["keys"] for s in m["shards"])
    stored = datastore_bytes(out, m)
    c = m["calibration"]
    v = c["validation"]
    unit = v["metric"]
    return "\n".join(
        [
            f"datastore  {out}: {keys:,} keys of {m['dim']} ({m['key']}, {m['precision']})",
            f"faiss      {m['factory']}, {len(m['shards'])} shards{' merged' if m.get('merged') else ''}, "
            f"{stored / max(keys, 1):.1f} bytes/key, {stored / m['index']['num_tokens']:.1f} "
            "bytes/token of the corpus",
            f"built      {result.built_shards} shards in {result.wall_s:.1f} s"
            if result.built_shards
            else "built      every shard earlier",
            f"calibrated k {c['k']}, nprobe {c['nprobe']}, on {v['tokens']:,} validation tokens:",
            f"  model as served {v['model']:.4f} {unit}, with kNN {v['model_knn']:.4f} "
            f"(λ {c['model']['lam']:.2f}, T {c['model']['temperature']:.3g})",
            f"  model alone     {v['model_alone']:.4f} {unit}, with kNN "
            f"{v['model_alone_knn']:.4f} (λ {c['model_alone']['lam']:.2f})",
        ]
    )
