"""What every pass after tokenization needs to know about the index being built (picklable)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from teralm.index import format as fmt
from teralm.index.reader import ShardedTokens


@dataclass(frozen=True)
class Layout:
    directory: str
    shard_tokens: int
    sizes: tuple[int, ...]
    token_dtype: str
    vocab_size: int
    separator: int
    max_match: int
    overlap: int = fmt.CONTEXT_OVERLAP

    @classmethod
    def from_manifest(cls, directory: Path, m: dict) -> Layout:
        return cls(
            str(directory),
            m["shard_tokens"],
            tuple(s["num_tokens"] for s in m["shards"]),
            m["token_dtype"],
            m["vocab_size"],
            m["separator"],
            m["max_match"],
            m["context_overlap"],
        )

    @property
    def num_tokens(self) -> int:
        return sum(self.sizes)

    @property
    def num_shards(self) -> int:
        return len(self.sizes)

    @property
    def sort_dtype(self) -> np.dtype:
        return fmt.sort_dtype(self.token_dtype, self.separator)

    @property
    def elem_bits(self) -> int:
        return 8 * self.sort_dtype.itemsize

    @property
    def sort_depth(self) -> int:
        return fmt.sort_depth(self.max_match, self.elem_bits)

    @property
    def order_width(self) -> int:
        return fmt.order_width(self.num_tokens)

    def order_path(self, kind: str) -> Path:
        return fmt.order_file(Path(self.directory), kind)

    def shard_start(self, k: int) -> int:
        return k * self.shard_tokens

    def stream(self) -> ShardedTokens:
        return ShardedTokens(
            Path(self.directory), self.shard_tokens, list(self.sizes), self.token_dtype
        )

    def read_tokens(self, k: int, a: int = 0, b: int | None = None) -> np.ndarray:
        """Tokens ``[a, b)`` of shard ``k``, read into memory (``format.read_rows``)."""
        b = self.sizes[k] if b is None else b
        return fmt.read_rows(self.path(k, "tokens"), self.token_dtype, a, b)

    def offsets(self) -> np.ndarray:
        return np.fromfile(Path(self.directory) / fmt.DOCUMENT_OFFSETS, dtype=fmt.OFFSET_DTYPE)

    def path(self, k: int, kind: str) -> Path:
        return fmt.shard_file(Path(self.directory), k, kind)

    def context_bounds(self, k: int, offsets: np.ndarray) -> tuple[int, np.ndarray]:
        """Start of shard ``k``'s sort context, and the document starts inside that context."""
        start, stop = self.shard_start(k), self.shard_start(k) + self.sizes[k]
        doc_start = int(offsets[np.searchsorted(offsets, start, side="right") - 1])
        lo = max(start - self.overlap, doc_start)
        inside = offsets[
            np.searchsorted(offsets, lo, "right") : np.searchsorted(offsets, stop, "left")
        ]
        return lo, inside.astype(np.int64) - lo
