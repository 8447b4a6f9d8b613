"""The on-disk index format: file names, dtypes and the manifest. Shared by the builder and readers.

Layout of an index directory (format version 4; versions 1-3 kept one sorted order per shard and
are refused with a request to rebuild):

- ``manifest.json``: written last; its presence marks a complete index.
- ``tokenizer.json``: HF ``tokenizers`` BPE model (absent for byte-level indexes).
- ``documents.offsets``: uint64[num_documents + 1], the start of every document in the global
  token stream, then ``num_tokens``.
- ``shard-XXXXX.tokens``: the shard's tokens (uint8 for bytes, uint16 for BPE).
- ``shard-XXXXX.match``: ``n`` bytes of match length (bit 7 set when no follower token exists),
  then ``n`` next tokens in the token dtype.
- ``order.positions``: the global sorted order: every global position once, as ``order_width``
  -byte little-endian integers (4 bytes below 2^32 tokens, else 5), sorted by key (below).
- ``order.follow``: in that order, the token that follows each position in its document, or the
  separator where none does (sort-key dtype: ``sort_dtype``). The next-token counts of a context
  are a histogram of one contiguous slice of it (or of a few, see below).
- ``order.keys``: uint64, the first word of the sort key of every ``KEY_SAMPLE``-th rank:
  ``64 / element bits`` key elements, big-endian, cut by the separator, zero after it. Binary
  searches run over it before they touch ``order.positions``.
- ``order.buckets``: uint64[65537]: where each bucket (the leading 16 bits of the sort key)
  starts in the order; searches start there.
- ``catalog.lmdb``: documents (start, length, source) and build progress records; rewritten in
  key order when the build ends, so that it depends on its records only.
- ``build-stats.json``: when the build ended and what each pass cost (time, peak memory). Not
  part of the index: two builds of the same input with the same flags give the same files but
  this one.
- ``.lock``: held (``flock``) by the one build writing the folder, and naming it.

Sort key of position ``t``: its reversed context ``x[t], x[t-1], ...`` back to the start of its
document, followed by the separator value ``manifest["separator"]`` (a value no token takes). A
context also ends ``context_overlap`` tokens before the start of the shard holding ``t``. The
global order compares the first ``sort_depth`` key elements; positions whose first ``sort_depth``
elements agree are ordered by shard, then by their whole keys. So a context of at most
``sort_depth`` tokens has one contiguous range of occurrences; a longer one has at most one range
per shard inside the range of its first ``sort_depth`` tokens.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np

from teralm.errors import ConfigError, damaged
from teralm.files import LOCK, read_manifest_file, sha256_file

FORMAT_NAME = "teralm-index"
FORMAT_VERSION = 4

MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
DOCUMENT_OFFSETS = "documents.offsets"
CATALOG = "catalog.lmdb"
BUILD_STATS = "build-stats.json"  # what a build cost: not part of the index
BUCKET_DTYPE = np.dtype("<u8")
NUM_BUCKETS = 1 << 16
FILE_KINDS = ("tokens", "match")
ORDER_KINDS = ("positions", "follow", "keys", "buckets")
KEY_SAMPLE = 32
KEY_DTYPE = np.dtype("<u8")

PREFIX_DTYPE = np.dtype("<u4")  # pass 2's per-shard order (a work file of the build)
OFFSET_DTYPE = np.dtype("<u8")
MATCH_LEN_DTYPE = np.dtype("u1")
NO_FOLLOWER_BIT = 0x80
MAX_MATCH_LIMIT = 127
CONTEXT_OVERLAP = 1 << 16


def shard_file(directory: Path, shard: int, kind: str) -> Path:
    """Path of one shard file (``kind`` is one of FILE_KINDS)."""
    return Path(directory) / f"shard-{shard:05d}.{kind}"


def order_file(directory: Path, kind: str) -> Path:
    """Path of one file of the global order (``kind`` is one of ORDER_KINDS)."""
    return Path(directory) / f"order.{kind}"


def order_width(num_tokens: int) -> int:
    """Bytes per entry of ``order.positions``: 4 below 2^32 tokens, else 5."""
    return 4 if num_tokens <= 1 << 32 else 5


def sort_depth(max_match: int, elem_bits: int) -> int:
    """Key elements the global order compares: the match cap, and at least one key word."""
    return max(max_match, 64 // elem_bits)


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every token id."""
    if vocab_size <= 256:
        return np.dtype("u1")
    if vocab_size <= 65535:
        return np.dtype("<u2")
    raise ConfigError(f"vocabulary of {vocab_size} tokens does not fit uint16 (at most 65535)")


def sort_dtype(token_dtype, separator: int) -> np.dtype:
    """Element type of the sort keys: wide enough for every token and the separator."""
    if np.dtype(token_dtype).itemsize == 1 and separator < 256:
        return np.dtype("u1")
    return np.dtype("<u2")


def content_digests(directory: Path) -> dict[str, str]:
    """The sha256 of every file of an index folder by its path in the folder, but BUILD_STATS:
    two builds of the same input with the same flags give the same, killed and resumed or not,
    on one machine or a cluster."""
    directory = Path(directory)
    return {
        str(p.relative_to(directory)): sha256_file(p)
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != BUILD_STATS
    }


def map_for_lookups(
    path: Path, dtype, count: int = -1, offset: int = 0, resident: bool = False
) -> np.ndarray:
    """``count`` items of ``dtype`` from byte ``offset`` of ``path`` (all that follow: -1) as a
    read-only mapping in a plain ndarray, advised for random access: a page fault then reads
    its page, not the disk's read-ahead window (8 MiB here, which with the index larger than
    memory read 5.6 MB per fault and pushed out the pages lookups were about to use).
    ``resident``: read into this process's memory instead, in one sequential pass."""
    if resident:
        data = np.fromfile(path, dtype=dtype, count=count, offset=offset)
        data.flags.writeable = False
        return data
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mapped, dtype=dtype, count=count, offset=offset)


def read_rows(path: Path, dtype, a: int, b: int) -> np.ndarray:
    """Entries ``[a, b)`` of a file of ``dtype`` entries, read (not mapped: the pages of a
    mapping count in the process's RSS once touched)."""
    dtype = np.dtype(dtype)
    return np.fromfile(path, dtype=dtype, count=b - a, offset=a * dtype.itemsize)


def read_manifest(directory: Path) -> dict:
    """Load and check the manifest of a complete index (errors with a user message)."""
    manifest = read_manifest_file(
        Path(directory) / MANIFEST,
        FORMAT_NAME,
        FORMAT_VERSION,
        missing=f"{directory} is not a complete teralm index (no {MANIFEST}); "
        "run build-index again with the same arguments to finish it",
        rebuild="rebuild it with build-index --force",
    )
    problem = manifest_problem(manifest)
    if problem:
        raise damaged(directory, f"{MANIFEST}: {problem}")
    return manifest


def folder_contents(directory: Path) -> list[Path]:
    """What ``directory`` holds, but its writer's lock file."""
    return [p for p in Path(directory).iterdir() if p.name != LOCK]


MANIFEST_FIELDS = {
    "tokenizer": str,
    "vocab_size": int,
    "token_dtype": str,
    "max_match": int,
    "separator": int,
    "context_overlap": int,
    "num_tokens": int,
    "num_documents": int,
    "shard_tokens": int,
    "shards": list,
    "order": dict,
}


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _files_ok(files, kinds) -> bool:
    """A manifest's ``files`` entry has each kind's bytes and sha256."""
    return isinstance(files, dict) and all(
        isinstance(files.get(kind), dict)
        and _is_count(files[kind].get("bytes"))
        and isinstance(files[kind].get("sha256"), str)
        for kind in kinds
    )


def _shard_entry_ok(shard) -> bool:
    """A shard's manifest entry has its num_tokens and each file's bytes and sha256."""
    if not isinstance(shard, dict) or not _is_count(shard.get("num_tokens")):
        return False
    return _files_ok(shard.get("files"), FILE_KINDS)


def manifest_problem(m: dict) -> str | None:
    """What makes a manifest unusable (a missing or ill-typed field, sizes that disagree), or None."""
    for key, kind in MANIFEST_FIELDS.items():
        value = m.get(key)
        if not (_is_count(value) if kind is int else isinstance(value, kind)):
            return f"{key!r} is missing or not a {'count' if kind is int else kind.__name__}"
    if m["tokenizer"] not in ("bytes", "bpe"):
        return f"unknown tokenizer {m['tokenizer']!r}"
    if not 0 < m["vocab_size"] <= 65535 or m["token_dtype"] != token_dtype(m["vocab_size"]).str:
        return f"token_dtype {m['token_dtype']!r} does not fit vocab_size {m['vocab_size']}"
    if not 0 < m["max_match"] <= MAX_MATCH_LIMIT or m["separator"] > 65535:
        return "max_match or separator is out of range"
    for k, shard in enumerate(m["shards"]):
        if not _shard_entry_ok(shard):
            return f"the entry of shard {k} lacks num_tokens or a file's bytes and sha256"
    sizes, full = [s["num_tokens"] for s in m["shards"]], m["shard_tokens"]
    if not sizes or sizes[:-1] != [full] * (len(sizes) - 1) or not 0 < sizes[-1] <= full:
        return f"shard num_tokens are not {full} each (the last at most that)"
    if sum(sizes) != m["num_tokens"]:
        return f"shard num_tokens add up to {sum(sizes)}, not num_tokens {m['num_tokens']}"
    order = m["order"]
    if not _files_ok(order.get("files"), ORDER_KINDS):
        return "the entry of the order lacks a file's bytes and sha256"
    if order.get("width") != order_width(m["num_tokens"]) or not _is_count(order.get("depth")):
        return "the order's width or depth is missing or wrong"
    recorded = {
        shard_file(Path(), k, kind).name: shard["files"][kind]["bytes"]
        for k, shard in enumerate(m["shards"])
        for kind in FILE_KINDS
    }
    recorded |= {
        order_file(Path(), kind).name: order["files"][kind]["bytes"] for kind in ORDER_KINDS
    }
    for path, size in reader_files(Path(), m).items():
        if path.name in recorded and recorded[path.name] != size:
            return f"{path.name} is recorded as {recorded[path.name]} bytes, not {size}"
    return None


def shard_file_bytes(manifest: dict, num_tokens: int) -> dict[str, int]:
    """Size in bytes of each file of a shard of ``num_tokens`` tokens."""
    token_size = np.dtype(manifest["token_dtype"]).itemsize
    return {
        "tokens": num_tokens * token_size,
        "match": num_tokens * (MATCH_LEN_DTYPE.itemsize + token_size),
    }


def order_file_bytes(manifest: dict) -> dict[str, int]:
    """Size in bytes of each file of the global order."""
    n = manifest["num_tokens"]
    follow_size = sort_dtype(manifest["token_dtype"], manifest["separator"]).itemsize
    return {
        "positions": n * order_width(n),
        "follow": n * follow_size,
        "keys": -(-n // KEY_SAMPLE) * KEY_DTYPE.itemsize,
        "buckets": (NUM_BUCKETS + 1) * BUCKET_DTYPE.itemsize,
    }


def reader_files(directory: Path, manifest: dict) -> dict[Path, int | None]:
    """Every file that readers of the index open, with its size in bytes (None: any size)."""
    directory = Path(directory)
    files: dict[Path, int | None] = {
        directory / DOCUMENT_OFFSETS: (manifest["num_documents"] + 1) * OFFSET_DTYPE.itemsize,
        directory / CATALOG / "data.mdb": None,
    }
    for kind, size in order_file_bytes(manifest).items():
        files[order_file(directory, kind)] = size
    if manifest["tokenizer"] == "bpe":
        files[directory / TOKENIZER] = None
    for k, shard in enumerate(manifest["shards"]):
        for kind, size in shard_file_bytes(manifest, shard["num_tokens"]).items():
            files[shard_file(directory, k, kind)] = size
    return files


def file_problems(directory: Path, manifest: dict) -> list[str]:
    """One line for each file that readers open and that is missing or has the wrong size."""
    problems = []
    for path, size in reader_files(directory, manifest).items():
        name = path.relative_to(directory)
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif size is not None and path.stat().st_size != size:
            actual = path.stat().st_size
            problems.append(f"{name}: {actual} bytes, where the manifest implies {size}")
    return problems


def offsets_problem(offsets: np.ndarray, num_tokens: int) -> str | None:
    """What is wrong with the document offsets (they rise from 0 to ``num_tokens``), or None."""
    if offsets[0] != 0 or offsets[-1] != num_tokens or (offsets[1:] < offsets[:-1]).any():
        return f"{DOCUMENT_OFFSETS}: the document starts are out of order or beyond the corpus"
    return None


def bucket_problem(buckets: np.ndarray, num_tokens: int) -> str | None:
    """What is wrong with the bucket table (it rises from 0 to ``num_tokens``), or None."""
    if buckets[0] != 0 or buckets[-1] != num_tokens or (buckets[1:] < buckets[:-1]).any():
        return f"{order_file(Path(), 'buckets').name}: the bucket starts are out of order"
    return None


def positions(raw: np.ndarray, width: int) -> np.ndarray:
    """Entries of ``order.positions`` (its bytes ``raw``, a whole number of entries) as int64."""
    if width == 4:
        return raw.view("<u4").astype(np.int64)
    padded = np.zeros((len(raw) // width, 8), dtype=np.uint8)
    padded[:, :width] = raw.reshape(-1, width)
    return padded.view("<u8").reshape(-1).astype(np.int64)
