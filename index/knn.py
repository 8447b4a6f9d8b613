"""The embedding index (kNN-LM, Khandelwal et al. 2020): the model's hidden state at every training
position, searched with faiss; the nearest stored states vote for the tokens that followed them.

A datastore folder (format ``teralm-knn`` version 1):

- ``knn.json``: the manifest: the model weights' sha256 (and the run they were read from) and the
  token index (its identity without its folder) that the keys come from, the key's width and the precision it was computed in, the
  faiss factory string, the held-out rule, ``shard_tokens``, the finished shards (keys, bytes,
  sha256) and, once complete, the calibration chosen on validation text (see
  teralm.train.knn).
- ``trained.faiss``: the empty index trained on a sample of keys (IVF centroids, PQ codebooks);
  every shard's index starts from it.
- ``shard-XXXXX.faiss``: the keys of the training documents that start in positions
  ``[k * shard_tokens, (k + 1) * shard_tokens)``. For IVF indexes these are work files: once every
  shard is built, their inverted lists are merged into ``merged.faiss`` (the trained index) and
  ``merged.ivfdata`` (all lists, read memory-mapped), and the shard files are removed. A key's faiss id is its corpus position ``p``:
  the state after reading token ``p``, whose value is token ``p + 1`` of the token index. The
  datastore stores no values of its own, and every neighbour names its document.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from teralm.errors import ConfigError, IndexDamaged, InputError
from teralm.files import read_manifest_file, sha256_file
from teralm.index.query import SNIPPET
from teralm.index.reader import Index

FORMAT, VERSION = "teralm-knn", 1
MANIFEST = "knn.json"
TRAINED = "trained.faiss"
MERGED, MERGED_DATA = "merged.faiss", "merged.ivfdata"


def import_faiss():
    """The faiss module, or a ConfigError that says how to install it."""
    try:
        import faiss
    except ImportError:
        raise ConfigError(
            "the kNN datastore needs faiss: pip install 'teralm[knn]' (faiss-cpu), or "
            "faiss-gpu-cu12 on a CUDA machine"
        ) from None
    return faiss


@contextlib.contextmanager
def faiss_quiet() -> Iterator[None]:
    """Keep the notes faiss prints on the process's own stdout (where it found or resized an
    on-disk list file) out of ours, which may be JSON (``teralm eval --json``)."""
    sys.stdout.flush()
    saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        ctypes.CDLL(None).fflush(None)  # what C wrote is still in its buffer
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def shard_path(directory: Path, shard: int) -> Path:
    return Path(directory) / f"shard-{shard:05d}.faiss"


def index_identity(ix: Index) -> dict:
    """What the keys depend on in the token index: its identity, wherever the folder lies."""
    return {k: v for k, v in ix.identity().items() if k != "directory"}


def read_manifest(directory: Path) -> dict:
    """The datastore's manifest (errors with a user message)."""
    return read_manifest_file(
        Path(directory) / MANIFEST,
        FORMAT,
        VERSION,
        missing=f"{directory}: no kNN datastore here (no {MANIFEST})",
        rebuild="rebuild the datastore with teralm build-knn --force",
    )


@dataclass
class Neighbours:
    """The ``k`` nearest stored keys of each query, nearest first: squared L2 ``distances``
    [n, k] (inf where the datastore holds fewer than ``k`` keys), their corpus ``positions``
    (-1 there) and the ``tokens`` that followed them (-1 there)."""

    distances: np.ndarray
    positions: np.ndarray
    tokens: np.ndarray


def set_nprobe(index, nprobe: int) -> None:
    """Inverted lists visited per query, where the index has them."""
    faiss = import_faiss()
    with contextlib.suppress(RuntimeError):  # raised for an index without lists
        faiss.extract_index_ivf(index).nprobe = nprobe


class KnnDatastore:
    """A datastore opened for search beside its token index: its faiss indexes (the merged one,
    or one per shard), memory-mapped."""

    def __init__(self, directory: Path, manifest: dict, ix: Index, k: int, nprobe: int):
        faiss = import_faiss()
        self.directory, self.manifest, self.ix = Path(directory), manifest, ix
        self.dim: int = manifest["dim"]
        self.k = k
        self.calibration: dict | None = manifest.get("calibration")
        self.indexes = []
        if manifest.get("merged"):
            flags = faiss.IO_FLAG_ONDISK_SAME_DIR | faiss.IO_FLAG_READ_ONLY
            files = [manifest["merged"]["file"]]
        else:
            flags = faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY
            files = [shard["file"] for shard in manifest["shards"] if shard["keys"]]
        for name in files:
            try:
                with faiss_quiet():
                    index = faiss.read_index(str(self.directory / name), flags)
            except RuntimeError as e:  # faiss's C++ exception, many lines long
                problem = str(e).strip().splitlines()[-1][:200]
                raise IndexDamaged(
                    f"{self.directory / name} cannot be read by faiss ({problem}); rebuild the "
                    "datastore (build-knn --force)"
                ) from None
            set_nprobe(index, nprobe)
            self.indexes.append(index)

    @classmethod
    def open(cls, directory: Path, ix: Index, weights_sha256: str) -> KnnDatastore:
        """Open a complete datastore; a TeralmError unless it was built from this token index
        and these model weights."""
        m = read_manifest(directory)
        needed = ("weights_sha256", "index", "dim", "shards", "calibration")
        if m.get("complete") and not all(k in m for k in needed):
            raise IndexDamaged(f"{directory}/{MANIFEST} is damaged; rebuild the datastore")
        if not m.get("complete"):
            raise ConfigError(
                f"{directory}: the kNN build did not finish; run the same build-knn command "
                "again to resume it"
            )
        if ix.differs_from(m["index"]):
            raise ConfigError(f"{directory} was built from another token index than {ix.directory}")
        if m["weights_sha256"] != weights_sha256:
            raise ConfigError(
                f"{directory} holds the hidden states of other model weights than these "
                f"(built from {m.get('run')}); rebuild it for this run"
            )
        if datastore_bytes(Path(directory), m) is None:
            raise IndexDamaged(
                f"{directory}: a file is missing or truncated; rebuild the datastore"
            )
        problem = calibration_problem(m["calibration"]) or checksum_problem(Path(directory), m)
        if problem:
            raise IndexDamaged(
                f"{directory}: {problem}; rebuild the datastore (build-knn --force), or run "
                "build-knn again to recalibrate it"
            )
        return cls(directory, m, ix, m["calibration"]["k"], m["calibration"]["nprobe"])

    @property
    def num_keys(self) -> int:
        return sum(shard["keys"] for shard in self.manifest["shards"])

    def search(self, keys: np.ndarray) -> Neighbours:
        """The ``k`` nearest keys of each row of ``keys`` [n, dim] over every shard, and the
        tokens that followed them."""
        k = self.k
        keys = np.ascontiguousarray(keys, dtype=np.float32)
        if keys.ndim != 2 or keys.shape[1] != self.dim:
            raise InputError(f"queries of shape {keys.shape}; the datastore's keys have {self.dim}")
        n = len(keys)
        distances = np.full((n, k), np.inf, dtype=np.float32)
        positions = np.full((n, k), -1, dtype=np.int64)
        for index in self.indexes:
            d, p = index.search(keys, k)
            d[p < 0] = np.inf
            distances, positions = merge_nearest(distances, positions, d, p, k)
        tokens = np.full((n, k), -1, dtype=np.int64)
        found = positions >= 0
        tokens[found] = take_tokens(self.ix, positions[found] + 1)
        return Neighbours(distances, positions, tokens)

    def sources(self, found: Neighbours, row: int = 0) -> list[dict]:
        """Query ``row``'s neighbours as the documents they come from (attribution): the
        document, its source, the position's offset in it, the distance, the token that
        followed and a snippet around it."""
        ix, hits = self.ix, []
        for p, d, token in zip(found.positions[row], found.distances[row], found.tokens[row]):
            if p < 0:
                break
            doc = int(np.searchsorted(ix.offsets, p, side="right")) - 1
            first, stop = ix.document_range(doc)
            a, b = max(first, int(p) - SNIPPET), min(stop, int(p) + 2 + SNIPPET)
            hits.append(
                {
                    "document": doc,
                    "source": ix.document_source(doc),
                    "offset": int(p) - first,
                    "distance": float(d),
                    "token": int(token),
                    "snippet": ix.decode(ix.tokens(a, b)),
                }
            )
        return hits


def calibration_problem(c) -> str | None:
    """What is wrong with a manifest's calibration (None: nothing): neighbours and lists to
    visit are positive counts, each mixture's weight λ lies in [0, 1], its temperature is a
    positive number."""
    counts = isinstance(c, dict) and all(
        isinstance(c.get(k), int) and c[k] > 0 for k in ("k", "nprobe")
    )
    if not counts:
        return f"{MANIFEST}: calibration k and nprobe must be positive counts"
    for name in ("model", "model_alone"):
        mix = c.get(name)
        lam, t = (mix.get("lam"), mix.get("temperature")) if isinstance(mix, dict) else (None, None)
        if not (isinstance(lam, (int, float)) and 0 <= lam <= 1):
            return f"{MANIFEST}: calibration {name} λ {lam!r} is not in [0, 1]"
        if not (isinstance(t, (int, float)) and 0 < t < math.inf):
            return f"{MANIFEST}: calibration {name} temperature {t!r} is not a positive number"
    return None


def checksum_problem(directory: Path, m: dict) -> str | None:
    """The first file a search reads whose sha256 differs from the manifest's (None: none)."""
    if m.get("merged"):
        merged = m["merged"]
        recorded = {merged["data"]: merged["sha256"], merged["file"]: merged.get("index_sha256")}
    else:
        recorded = {s["file"]: s["sha256"] for s in m["shards"] if s["keys"]}
    for name, sha256 in recorded.items():
        if sha256 is not None and sha256_file(directory / name) != sha256:
            return f"{name} does not match its sha256 in {MANIFEST}"
    return None


def datastore_bytes(directory: Path, m: dict) -> int | None:
    """The bytes of the files a search reads (None when one is missing or of the wrong size):
    the merged index with its list file, or else every shard's index."""
    parts = [m["merged"]] if m.get("merged") else [s for s in m["shards"] if s["keys"]]
    total = 0
    for part in parts:
        files = [part["file"], *([part["data"]] if "data" in part else [])]
        sizes = [(directory / f).stat().st_size if (directory / f).exists() else -1 for f in files]
        if min(sizes, default=0) < 0 or sum(sizes) != part["bytes"]:
            return None
        total += sum(sizes)
    return total


def merge_nearest(d1, p1, d2, p2, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` nearest of two neighbour lists per row (ties: the first list's first)."""
    d, p = np.concatenate([d1, d2], axis=1), np.concatenate([p1, p2], axis=1)
    order = np.argsort(d, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(d, order, 1), np.take_along_axis(p, order, 1)


def take_tokens(ix: Index, positions: np.ndarray) -> np.ndarray:
    """The tokens at global ``positions`` (any order), one gather per shard file."""
    positions = np.asarray(positions, dtype=np.int64)
    out = np.empty(len(positions), dtype=np.int64)
    shard = positions // ix.stream.shard_tokens
    for k in np.unique(shard):
        rows = shard == k
        out[rows] = ix.stream.shard(int(k))[positions[rows] - k * ix.stream.shard_tokens]
    return out
