"""The on-disk index format: file names, dtypes and the manifest. Shared by the builder and readers.

Layout of an index directory (format version 3: version 1 had no buckets.u32,
version 2 no ``.follow`` files):

- ``manifest.json``: written last; its presence marks a complete index.
- ``tokenizer.json``: HF ``tokenizers`` BPE model (absent for byte-level indexes).
- ``documents.offsets``: uint64[num_documents + 1], the start of every document in the global
  token stream, then ``num_tokens``.
- ``shard-XXXXX.tokens``: the shard's tokens (uint8 for bytes, uint16 for BPE).
- ``shard-XXXXX.prefix``: uint32 positions within the shard, sorted by preceding context (see below).
- ``shard-XXXXX.match``: ``n`` bytes of match length (bit 7 set when no follower token exists),
  then ``n`` next tokens in the token dtype.
- ``shard-XXXXX.follow``: in ``.prefix`` order, the token that follows each position in its
  document, or the separator where none does (sort-key dtype: ``sort_dtype``). The next-token
  counts of a context are a histogram of one contiguous slice of it.
- ``shard-XXXXX.keys``: uint64, the first word of the sort key of every ``KEY_SAMPLE``-th rank:
  ``64 / element bits`` key elements, big-endian, cut by the separator, zero after it. Binary
  searches run over it before they touch ``.prefix``.
- ``catalog.lmdb``: documents (start, length, source) and build progress records.
- ``buckets.u32``: uint32[num_shards, 65537]: where each bucket (the leading 16 bits of the
  sort key) starts in each shard's ``.prefix``; queries start their binary searches there.

Sort order of ``.prefix``: position ``t`` is keyed by its reversed context ``x[t], x[t-1], ...``
back to the start of its document, followed by the separator value ``manifest["separator"]``
(a value no token takes). A context also ends ``context_overlap`` tokens before the start of its
shard, so a shard is sorted from its own tokens plus that much of the previous shard.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

FORMAT_NAME = "teralm-index"
FORMAT_VERSION = 3

MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
DOCUMENT_OFFSETS = "documents.offsets"
CATALOG = "catalog.lmdb"
BUCKETS = "buckets.u32"
BUCKET_DTYPE = np.dtype("<u4")
NUM_BUCKETS = 1 << 16
FILE_KINDS = ("tokens", "prefix", "match", "follow", "keys")
KEY_SAMPLE = 32
KEY_DTYPE = np.dtype("<u8")

PREFIX_DTYPE = np.dtype("<u4")
OFFSET_DTYPE = np.dtype("<u8")
MATCH_LEN_DTYPE = np.dtype("u1")
NO_FOLLOWER_BIT = 0x80
MAX_MATCH_LIMIT = 127
CONTEXT_OVERLAP = 1 << 16


def shard_file(directory: Path, shard: int, kind: str) -> Path:
    """Path of one shard file (``kind`` is one of FILE_KINDS)."""
    return Path(directory) / f"shard-{shard:05d}.{kind}"


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every token id."""
    if vocab_size <= 256:
        return np.dtype("u1")
    if vocab_size <= 65535:
        return np.dtype("<u2")
    raise ValueError(f"vocabulary of {vocab_size} tokens does not fit uint16 (at most 65535)")


def sort_dtype(token_dtype, separator: int) -> np.dtype:
    """Element type of the sort keys: wide enough for every token and the separator."""
    if np.dtype(token_dtype).itemsize == 1 and separator < 256:
        return np.dtype("u1")
    return np.dtype("<u2")


def write_atomic(path: Path, data) -> None:
    """Write ``data`` (bytes or a numpy array) so readers see the old file or the whole new one.

    Temp name, fsync, rename; the temp file is removed if writing fails (e.g. a full disk).
    """
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).view(np.uint8).data
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Make a rename inside ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(directory: Path) -> dict:
    """Load and check the manifest of a complete index; raises ValueError with a user message."""
    path = Path(directory) / MANIFEST
    if not path.exists():
        raise ValueError(
            f"{directory} is not a complete teralm index (no {MANIFEST}); "
            "run build-index again with the same arguments to finish it"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if manifest.get("format") != FORMAT_NAME:
        raise ValueError(f"{path} is not a teralm index manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{directory} has index format version {manifest.get('version')}, "
            f"this teralm reads version {FORMAT_VERSION}; rebuild it with build-index --force"
        )
    return manifest
