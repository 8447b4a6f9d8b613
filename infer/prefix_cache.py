"""Keys and values of recent prompts, so that a prompt that begins as an earlier one skips the
arithmetic of the part they share (automatic prefix caching, as vLLM does it, by blocks).

A prompt's keys and values depend only on its tokens (and on whether the index is used: the
features are causal), so the cached entries of a shared prefix are exactly what a prefill would
compute. Prefixes are found at block boundaries (every ``BLOCK`` tokens) and at the whole
length of a cached prompt, through a chain of hashes; a found entry's tokens are compared before
use, so a hash collision costs a miss, never a wrong answer. Entries are dropped least recently
used first once they hold more than ``max_bytes``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from teralm.model.kv_cache import KVCache

BLOCK = 16  # prefixes are found at multiples of this many tokens (and at a cached prompt's end)


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    use_index: bool
    keys: list[torch.Tensor]  # per layer [heads, len(tokens), head_dim]
    values: list[torch.Tensor]
    hashes: list[int] = field(default_factory=list)  # the prefix hashes pointing here

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def _prefix_hashes(tokens: list[int], use_index: bool) -> dict[int, int]:
    """Hash of ``tokens[:n]`` for every block boundary ``n`` and for ``n = len(tokens)``."""
    hashes, h = {}, hash(("teralm-prefix", use_index))
    ends = [*range(BLOCK, len(tokens) + 1, BLOCK), len(tokens)]
    start = 0
    for end in ends:
        if end > start:
            h = hash((h, tuple(tokens[start:end])))
            start = end
        hashes[end] = h
    return hashes


class PrefixCache:
    """``load`` copies the longest cached prefix of a prompt into a cache slot; ``store`` keeps a
    slot's prompt for later ones."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # by id, least recent first
        self._by_hash: dict[int, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def load(self, tokens: list[int], use_index: bool, cache: KVCache, slot: int) -> int:
        """Put the keys and values of the longest cached prefix of ``tokens``, at most all but
        the last token (whose logits the caller needs), in ``slot``: its length (0: none)."""
        for n, h in sorted(_prefix_hashes(tokens, use_index).items(), reverse=True):
            entry = self._by_hash.get(h)
            if (
                entry is None
                or entry.use_index != use_index
                or entry.tokens[:n] != tuple(tokens[:n])
            ):
                continue
            used = min(n, len(tokens) - 1)
            if used <= 0:
                break
            cache.restore(slot, (entry.keys, entry.values), used)
            self._entries.move_to_end(id(entry))
            return used
        cache.lengths[slot] = 0
        return 0

    def store(self, tokens: list[int], use_index: bool, cache: KVCache, slot: int) -> None:
        """Keep the keys and values of ``tokens``, the prompt just cached in ``slot``."""
        if not tokens:
            return
        hashes = _prefix_hashes(tokens, use_index)
        known = self._by_hash.get(hashes[len(tokens)])
        if known is not None and known.tokens == tuple(tokens) and known.use_index == use_index:
            self._entries.move_to_end(id(known))
            return
        entry = _Entry(tuple(tokens), use_index, *cache.save(slot, len(tokens)))
        if entry.nbytes > self.max_bytes:
            return
        for h in hashes.values():  # the newest holder of a prefix answers for it
            self._by_hash[h] = entry
        entry.hashes = list(hashes.values())
        self._entries[id(entry)] = entry
        self.bytes += entry.nbytes
        while self.bytes > self.max_bytes:
            self._evict()

    def _evict(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self.bytes -= entry.nbytes
        for h in entry.hashes:
            if self._by_hash.get(h) is entry:
                del self._by_hash[h]
