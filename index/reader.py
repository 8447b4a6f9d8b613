"""Memory-mapped access to an index directory."""

from __future__ import annotations

import hashlib
from functools import cached_property
from pathlib import Path
from typing import NamedTuple

import lmdb
import numpy as np

from teralm.errors import ConfigError, damaged
from teralm.index import format as fmt
from teralm.index.catalog import Catalog
from teralm.index.query import QueryEngine
from teralm.index.tokenizer import load_tokenizer

# what lookups read, most often first: what ``Index.open``'s ``memory`` holds in memory
RESIDENT_ORDER = ("buckets", "keys", "tokens", "follow", "positions")


def resident_kinds(manifest: dict, memory: int) -> frozenset[str]:
    """The files (by kind, of RESIDENT_ORDER) that ``memory`` bytes hold whole, taken in that
    order; a kind that does not fit is passed over for the next."""
    files = manifest["order"]["files"]
    sizes = {kind: files[kind]["bytes"] for kind in ("buckets", "keys", "follow", "positions")}
    sizes["tokens"] = sum(s["files"]["tokens"]["bytes"] for s in manifest["shards"])
    chosen = []
    for kind in RESIDENT_ORDER:
        if sizes[kind] <= memory:
            chosen.append(kind)
            memory -= sizes[kind]
    return frozenset(chosen)


class ShardedTokens:
    """The global token stream over fixed-size shard files (the last one may be shorter)."""

    def __init__(
        self, directory: Path, shard_tokens: int, sizes: list[int], dtype, resident: bool = False
    ):
        self.directory = Path(directory)
        self.resident = resident
        self.shard_tokens = shard_tokens
        self.sizes = list(sizes)
        self.dtype = np.dtype(dtype)
        self.num_tokens = sum(self.sizes)
        self._maps: dict[int, np.ndarray] = {}

    def shard(self, k: int) -> np.ndarray:
        """The tokens of shard ``k`` (a read-only mapping of its file, or its copy in memory when
        ``resident``, opened on first use; a plain ndarray, whose item reads cost a tenth of an
        np.memmap's)."""
        if k not in self._maps:
            path = fmt.shard_file(self.directory, k, "tokens")
            self._maps[k] = (
                fmt.map_for_lookups(path, self.dtype, self.sizes[k], resident=self.resident)
                if self.sizes[k]
                else np.empty(0, self.dtype)
            )
        return self._maps[k]

    def spans(self, start: int, stop: int):
        """``(shard, a, b)`` for each shard piece ``shard[a:b]`` of the global range."""
        start, stop, _ = slice(start, stop).indices(self.num_tokens)
        for k in range(start // self.shard_tokens, -(-stop // self.shard_tokens)):
            base = k * self.shard_tokens
            a, b = max(start - base, 0), min(stop - base, self.sizes[k])
            if a < b:
                yield k, a, b

    def token_at(self, p: int) -> int:
        """The token at global position ``p``."""
        k, q = divmod(p, self.shard_tokens)
        return int(self.shard(k)[q])

    def __getitem__(self, window: slice) -> np.ndarray:
        parts = [self.shard(k)[a:b] for k, a, b in self.spans(window.start, window.stop)]
        return np.concatenate([np.empty(0, self.dtype), *parts])


class Features(NamedTuple):
    """Causal match features of a range of positions.

    ``match_len[i]``: length of the longest earlier match ending at the position (capped).
    ``next_token[i]``: the token that followed that match, or ``Index.no_token`` when none did.
    """

    match_len: np.ndarray
    next_token: np.ndarray


class Index:
    """A complete index directory, opened read-only with mmap (nothing is loaded whole), but
    for the files in ``resident`` (kinds of RESIDENT_ORDER), which are read into memory."""

    def __init__(self, directory: Path, manifest: dict, resident: frozenset[str] = frozenset()):
        self.directory = Path(directory)
        self.manifest = manifest
        self.resident = resident
        self.tokenizer = load_tokenizer(self.directory, manifest["tokenizer"])
        self.vocab_size: int = manifest["vocab_size"]
        self.max_match: int = manifest["max_match"]
        self.num_tokens: int = manifest["num_tokens"]
        self.num_documents: int = manifest["num_documents"]
        self.no_token: int = self.vocab_size
        sizes = [s["num_tokens"] for s in manifest["shards"]]
        self.stream = ShardedTokens(
            self.directory,
            manifest["shard_tokens"],
            sizes,
            manifest["token_dtype"],
            "tokens" in resident,
        )
        self.offsets = np.memmap(
            self.directory / fmt.DOCUMENT_OFFSETS, dtype=fmt.OFFSET_DTYPE, mode="r"
        )
        self._match: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._catalog: Catalog | None = None

    @classmethod
    def open(cls, directory: str | Path, memory: int = 0) -> Index:
        """Open a complete index; a TeralmError with a user message if it is not one (IndexDamaged
        when a file that readers open is missing or has the wrong size). ``memory``: bytes of
        the files that lookups read most (``resident_kinds``) to read into memory up front,
        so that a lookup on an index larger than the machine's memory reads few pages."""
        directory = Path(directory)
        if not directory.is_dir():
            raise ConfigError(f"{directory}: no such index directory")
        manifest = fmt.read_manifest(directory)
        problems = fmt.file_problems(directory, manifest)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise damaged(directory, problems[0] + more)
        return cls(directory, manifest, resident_kinds(manifest, memory))

    def identity(self) -> dict:
        """What a model trained on this index depends on: its tokens and tokenizer."""
        m = self.manifest
        return {
            "directory": str(self.directory.resolve()),
            "tokenizer": m["tokenizer"],
            "tokenizer_sha256": m.get("tokenizer_sha256"),
            "vocab_size": m["vocab_size"],
            "num_tokens": m["num_tokens"],
            "max_match": m["max_match"],
            "tokens_sha256": tokens_digest(m),
        }

    def differs_from(self, recorded: dict) -> list[str]:
        """The fields of ``recorded`` (an ``identity`` saved earlier) that this index does not
        share; where it lies is not compared, nor what a record from an older teralm lacks."""
        here = self.identity()
        return [k for k, v in recorded.items() if k != "directory" and here.get(k, v) != v]

    def encode(self, text: str | bytes) -> np.ndarray:
        return self.tokenizer.encode(text)

    def decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens)

    def document_range(self, i: int) -> tuple[int, int]:
        """(start, stop) of document ``i`` in the global token stream."""
        if not 0 <= i < self.num_documents:
            raise IndexError(f"document {i} out of range 0..{self.num_documents - 1}")
        return int(self.offsets[i]), int(self.offsets[i + 1])

    def document_source(self, i: int) -> str:
        """Source label of document ``i`` (path, title or record id) from the catalog."""
        try:
            if self._catalog is None:
                self._catalog = Catalog(self.directory / fmt.CATALOG, readonly=True)
            record = self._catalog.document(i)
        except lmdb.Error as e:
            raise damaged(self.directory, f"{fmt.CATALOG}: {e}") from None
        return record["source"] if record else ""

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the global stream."""
        return self.stream[start:stop]

    def features(self, start: int, stop: int) -> Features:
        """Match features of positions ``[start, stop)``; IndexDamaged for a value that the
        format rules out (a length over ``max_match``, a token outside the vocabulary)."""
        lens, nexts = [np.empty(0, np.uint8)], [np.empty(0, self.stream.dtype)]
        for k, a, b in self.stream.spans(start, stop):
            length, nxt = self._match_arrays(k)
            lens.append(length[a:b])
            nexts.append(nxt[a:b])
        features = decode_features(np.concatenate(lens), np.concatenate(nexts), self.no_token)
        bad = (features.match_len > self.max_match) | (features.next_token > self.no_token)
        if bad.any():
            p = slice(start, stop).indices(self.num_tokens)[0] + int(bad.argmax())
            name = fmt.shard_file(self.directory, p // self.stream.shard_tokens, "match").name
            raise damaged(self.directory, f"{name} holds a value out of range for position {p}")
        return features

    @cached_property
    def query(self) -> QueryEngine:
        """The queries over this index: longest match, next-token counts, ∞-gram probability,
        the documents that hold a context (opened on first use)."""
        return QueryEngine(self)

    def _match_arrays(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        if k not in self._match:
            self._match[k] = open_match(
                self.directory, k, self.stream.sizes[k], self.stream.dtype, "r"
            )
        return self._match[k]


def tokens_digest(manifest: dict) -> str:
    """One sha256 of the index's token stream, from its shards' recorded checksums."""
    digest = hashlib.sha256()
    for shard in manifest["shards"]:
        digest.update(shard["files"]["tokens"]["sha256"].encode())
    return digest.hexdigest()


def open_match(directory: Path, k: int, n: int, dtype, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """The two arrays of a ``.match`` file: length bytes, then next tokens."""
    path = fmt.shard_file(directory, k, "match")
    if n == 0:
        return np.empty(0, np.uint8), np.empty(0, dtype)
    if mode == "r":
        return (
            fmt.map_for_lookups(path, fmt.MATCH_LEN_DTYPE, n),
            fmt.map_for_lookups(path, dtype, n, offset=n),
        )
    length = np.memmap(path, dtype=fmt.MATCH_LEN_DTYPE, mode=mode, shape=(n,))
    nxt = np.memmap(path, dtype=dtype, mode=mode, offset=n, shape=(n,))
    return length, nxt


def decode_features(raw_len: np.ndarray, raw_next: np.ndarray, no_token: int) -> Features:
    """On-disk match bytes -> Features (lengths, next tokens with ``no_token`` for none)."""
    missing = (raw_len & fmt.NO_FOLLOWER_BIT) != 0
    match_len = (raw_len & ~np.uint8(fmt.NO_FOLLOWER_BIT)).astype(np.int32)
    next_token = np.where(missing, no_token, raw_next.astype(np.int32)).astype(np.int32)
    return Features(match_len, next_token)
