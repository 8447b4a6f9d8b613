"""Keys and values of the sequences being generated, allocated once: one slot per sequence."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from teralm.errors import InputError
from teralm.model.config import ModelConfig


@dataclass
class LayerCache:
    """One layer's view of the slots a decode call covers (``keys``/``values`` [B, H, L, D]):
    where its tokens go (``rows`` [B, 1] and ``positions`` [B, T]), and each query's distance
    to every key slot in use (``gap`` [B, T, used]; negative for keys after the query, which
    ``later`` marks)."""

    keys: torch.Tensor
    values: torch.Tensor
    rows: torch.Tensor
    positions: torch.Tensor
    gap: torch.Tensor
    later: torch.Tensor

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None
    ) -> torch.Tensor:
        """Store ``k``, ``v`` [B, H, T, D] at their positions, then attend ``q`` to every earlier
        key of its own slot (within ``window`` when set)."""
        self.keys[self.rows, :, self.positions] = k.transpose(1, 2).to(self.keys.dtype)
        self.values[self.rows, :, self.positions] = v.transpose(1, 2).to(self.values.dtype)
        used = self.gap.shape[-1]
        keys, values = self.keys[:, :, :used].to(q.dtype), self.values[:, :, :used].to(q.dtype)
        hidden = self.later if window is None else self.later | (self.gap >= window)
        # explicit softmax attention: for a few queries it is many times faster on the CPU
        # than the fused kernel with a mask
        scores = (q @ keys.transpose(-1, -2)) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(hidden[:, None], float("-inf"))
        return torch.softmax(scores, dim=-1) @ values


class KVCache:
    """Per layer, keys and values [slots, heads, max_seq_len, head_dim], preallocated. A decode
    call covers the consecutive slots ``first .. first + B - 1`` and writes one entry per token
    at each slot's next position; ``lengths[s]`` counts the entries of slot ``s``."""

    def __init__(self, cfg: ModelConfig, slots: int, device: torch.device, dtype: torch.dtype):
        shape = (slots, cfg.n_head, cfg.max_seq_len, cfg.d_model // cfg.n_head)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layer)]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.lengths = torch.zeros(slots, dtype=torch.long)
        self.slots = slots
        self.max_len = cfg.max_seq_len

    def layers(self, first: int, tokens: int, batch: int) -> list[LayerCache]:
        """Every layer's view for a call that adds ``tokens`` tokens to each of ``batch`` slots
        from ``first`` (InputError when one would pass ``max_seq_len``)."""
        start = self.lengths[first : first + batch]
        used = int(start.max()) + tokens
        if used > self.max_len:
            raise InputError(f"positions beyond max_seq_len {self.max_len}")
        device = self.keys[0].device
        positions = (start[:, None] + torch.arange(tokens)).to(device)
        gap = positions[:, :, None] - torch.arange(used, device=device)
        rows, later = torch.arange(batch, device=device)[:, None], gap < 0
        slots = slice(first, first + batch)
        return [
            LayerCache(k[slots], v[slots], rows, positions, gap, later)
            for k, v in zip(self.keys, self.values)
        ]

    def save(
        self, slot: int, n: int | None = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A copy of slot ``slot``'s first ``n`` entries (all: None), per layer [heads, n,
        head_dim] (to ``restore`` later, in any slot)."""
        n = int(self.lengths[slot]) if n is None else n
        keys = [k[slot, :, :n].clone() for k in self.keys]
        return keys, [v[slot, :, :n].clone() for v in self.values]

    def restore(
        self, slot: int, saved: tuple[list[torch.Tensor], list[torch.Tensor]], n: int | None = None
    ) -> None:
        """Put the first ``n`` (all: None) of the entries ``save`` copied into slot ``slot``."""
        keys, values = saved
        n = keys[0].shape[1] if n is None else n
        for k, v, sk, sv in zip(self.keys, self.values, keys, values):
            k[slot, :, :n] = sk[:, :n]
            v[slot, :, :n] = sv[:, :n]
        self.lengths[slot] = n

    def move(self, source: int, target: int) -> None:
        """Copy slot ``source`` into slot ``target`` (keeping running sequences in front)."""
        n = int(self.lengths[source])
        for k, v in zip(self.keys, self.values):
            k[target, :, :n] = k[source, :, :n]
            v[target, :, :n] = v[source, :, :n]
        self.lengths[target] = n
