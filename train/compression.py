"""What the gradient exchanges put on the wire: bit packing, 1-bit signs with block scales, and
DeMo's top-k DCT components with Elias-Fano coded indices.

Every message is a flat uint8 tensor of a size known from the shapes alone, so that ranks can
exchange them with fixed-size collectives (gloo gathers bytes, not int16 or fp8).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from teralm.errors import ConfigError
from teralm.kernels.fp8 import E4M3, quantize_fp8

_BYTE_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative integers ``values`` [n] (each below ``2**bits``) as a bit stream, most
    significant bit first, in ``ceil(n * bits / 8)`` bytes."""
    shifts = torch.arange(bits - 1, -1, -1, device=values.device)
    stream = ((values.long()[:, None] >> shifts) & 1).reshape(-1)
    padded = torch.zeros(math.ceil(stream.numel() / 8) * 8, dtype=torch.uint8, device=values.device)
    padded[: stream.numel()] = stream
    weights = torch.tensor(_BYTE_WEIGHTS, dtype=torch.uint8, device=values.device)
    return (padded.view(-1, 8) * weights).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The ``n`` integers (int64) that ``pack_bits(values, bits)`` packed."""
    shifts = torch.arange(7, -1, -1, device=packed.device, dtype=torch.uint8)
    stream = ((packed[:, None] >> shifts) & 1).reshape(-1)[: n * bits].view(n, bits).long()
    return (stream << torch.arange(bits - 1, -1, -1, device=packed.device)).sum(1)


def pack_signs(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [n] as 1-bit signs (uint8, 8 a byte, ``x >= 0`` as 1) and the mean magnitude of each
    block of ``block`` values (fp32; the last block may be shorter)."""
    n = x.numel()
    blocks = math.ceil(n / block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=x.device)
    padded[:n] = x
    sizes = torch.full((blocks,), float(block), device=x.device)
    sizes[-1] = n - (blocks - 1) * block
    return pack_bits(x >= 0, 1), padded.abs().view(blocks, block).sum(1) / sizes


def unpack_signs(signs: torch.Tensor, scales: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """The values a 1-bit message stands for: each sign times its block's scale [n]."""
    bits = unpack_bits(signs, 1, n).bool()
    magnitude = scales.repeat_interleave(block)[:n]
    return torch.where(bits, magnitude, -magnitude)


class SignMessage:
    """1-bit messages of fixed size for vectors of up to ``length`` values (a multiple of
    ``block``): one fp32 scale per block, as bytes, then ``length / 8`` bytes of signs. A
    shorter vector's message is padded with zero scales and zero signs."""

    def __init__(self, length: int, block: int):
        if length % block or block % 8:
            raise ConfigError("a 1-bit message holds whole blocks of a multiple of 8 values")
        self.length, self.block = length, block
        self.nbytes = length // 8 + 4 * (length // block)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The message of ``x`` (at most ``length`` values; block means over its real values)."""
        out = torch.zeros(self.nbytes, dtype=torch.uint8, device=x.device)
        if x.numel():
            signs, scales = pack_signs(x, self.block)
            out[: 4 * scales.numel()] = scales.float().view(torch.uint8)
            start = 4 * (self.length // self.block)
            out[start : start + signs.numel()] = signs
        return out

    def decode(self, message: torch.Tensor, n: int) -> torch.Tensor:
        """The first ``n`` values a message stands for."""
        start = 4 * (self.length // self.block)
        scales = message[:start].clone().view(torch.float32)  # a row of a batch may sit unaligned
        return unpack_signs(message[start:], scales, n, self.block)


class ShardedSignMean:
    """The arithmetic of a mean of ``workers`` vectors of ``n`` values through 1-bit messages in
    two stages (1-bit Adam's compressed all-reduce; the collectives are the caller's). Each
    worker cuts its vector into one shard per worker, of whole blocks (the last one shorter),
    and sends shard ``j``'s 1-bit message to worker ``j`` (``encode``). Worker ``j`` averages the
    messages of its shard, adds what its last reply missed, and sends the 1-bit message of that
    to everyone (``reply``); every worker then holds the mean as ``decode`` of the replies. A
    worker sends ``2 (W - 1) / W`` of one 1-bit message of the vector, against ``W - 1`` for an
    all-gather of whole messages."""

    def __init__(self, n: int, workers: int, block: int):
        self.workers = workers
        self.length = math.ceil(n / workers / block) * block
        self.real = [min(max(n - j * self.length, 0), self.length) for j in range(workers)]
        self.wire = SignMessage(self.length, block)

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """The 1-bit message of every shard of ``values`` [n]: [workers, wire.nbytes]."""
        starts = [j * self.length for j in range(self.workers)]
        shards = [values[s : s + k] for s, k in zip(starts, self.real)]
        return torch.stack([self.wire.encode(x) for x in shards])

    def decode(self, messages: torch.Tensor) -> torch.Tensor:
        """The vector [n] that one message per shard, in shard order, stands for."""
        return torch.cat([self.wire.decode(m, k) for m, k in zip(messages, self.real)])

    def reply(
        self, incoming: torch.Tensor, weights: list[float], shard: int, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Worker ``shard``'s reply: the 1-bit message of the mean of the workers' messages of
        its shard (``incoming``, one row each), weighted by ``weights`` (which sum above 0),
        plus ``residual`` (a shard's length, zeros past the real values); and what the reply
        missed, the next residual."""
        k, total = self.real[shard], sum(weights)
        mean = residual[:k].clone()
        for message, w in zip(incoming, weights):
            if w:
                mean += self.wire.decode(message, k) * (w / total)
        reply = self.wire.encode(mean)
        missed = torch.zeros_like(residual)
        missed[:k] = mean - self.wire.decode(reply, k)
        return reply, missed


def dct_matrix(n: int, dtype=torch.float64) -> torch.Tensor:
    """The orthonormal DCT-II [n, n]: ``dct_matrix(n) @ x`` is ``scipy.fft.dct(x, norm='ortho')``."""
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None, :]
    c = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2 / n)
    c[0] /= math.sqrt(2)
    return c.to(dtype)


class DCTTopK:
    """DeMo's compression of a tensor: cut into chunks of ``chunk`` (``chunk`` × ``chunk`` tiles
    for matrices, zero-padded at the edges), each chunk through a DCT-II, and its ``k`` largest
    components kept as (index in the chunk, value)."""

    def __init__(self, chunk: int, k: int):
        if chunk < 1 or k < 1:
            raise ConfigError("the DCT chunk size and top-k must be at least 1")
        self.chunk, self.k = chunk, k
        self._bases: dict[tuple, torch.Tensor] = {}

    def _basis(self, device, dtype) -> torch.Tensor:
        key = (device, dtype)
        if key not in self._bases:
            self._bases[key] = dct_matrix(self.chunk).to(device=device, dtype=dtype)
        return self._bases[key]

    def _grid(self, shape: torch.Size) -> tuple[int, int]:
        """Rows and columns of ``shape`` as a padded matrix (one row for a vector)."""
        c = self.chunk
        if len(shape) == 1:
            return 1, math.ceil(shape[0] / c) * c
        return math.ceil(shape[0] / c) * c, math.ceil(math.prod(shape[1:]) / c) * c

    def _tiles(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as zero-padded chunks: [tiles, c] (vectors) or [tiles, c, c] (matrices)."""
        c = self.chunk
        m = x.reshape(x.shape[0], -1) if x.dim() > 1 else x.reshape(1, -1)
        rows, cols = self._grid(x.shape)
        padded = torch.zeros(rows, cols, dtype=x.dtype, device=x.device)
        padded[: m.shape[0], : m.shape[1]] = m
        if x.dim() == 1:
            return padded.view(-1, c)
        return padded.view(rows // c, c, cols // c, c).permute(0, 2, 1, 3).reshape(-1, c, c)

    def _untile(self, tiles: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        c = self.chunk
        if len(shape) == 1:
            return tiles.reshape(-1)[: shape[0]]
        rows, cols = self._grid(shape)
        m = tiles.view(rows // c, cols // c, c, c).permute(0, 2, 1, 3).reshape(rows, cols)
        return m[: shape[0], : math.prod(shape[1:])].reshape(shape)

    def width(self, shape: torch.Size) -> int:
        """Components in one chunk of a tensor of ``shape``."""
        return self.chunk if len(shape) == 1 else self.chunk * self.chunk

    def kept(self, shape: torch.Size) -> int:
        """Components sent for a tensor of ``shape``: ``k`` (at most a whole chunk) per chunk."""
        rows, cols = self._grid(shape)
        return rows * cols // self.width(shape) * min(self.k, self.width(shape))

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        """The DCT of every chunk, flattened: [tiles, chunk elements]."""
        tiles, basis = self._tiles(x), self._basis(x.device, x.dtype)
        if x.dim() == 1:
            return tiles @ basis.T
        return (basis @ tiles @ basis.T).flatten(1)

    def inverse(self, coefficients: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        basis = self._basis(coefficients.device, coefficients.dtype)
        if len(shape) == 1:
            return self._untile(coefficients @ basis, shape)
        c = self.chunk
        tiles = basis.T @ coefficients.view(-1, c, c) @ basis
        return self._untile(tiles, shape)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` largest DCT components of each chunk: indices (int64) and values."""
        coefficients = self.transform(x)
        k = min(self.k, coefficients.shape[1])
        index = coefficients.abs().topk(k, dim=1).indices
        return index, coefficients.gather(1, index)

    def scatter(self, index: torch.Tensor, values: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The chunks' DCT coefficients [tiles, width] holding only these components."""
        coefficients = torch.zeros(
            index.shape[0], self.width(shape), dtype=values.dtype, device=values.device
        )
        return coefficients.scatter_(1, index, values)

    def decode(self, index: torch.Tensor, values: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The tensor of ``shape`` whose chunks hold only these components."""
        return self.inverse(self.scatter(index, values, shape), shape)


class _TensorLayout(NamedTuple):
    """One tensor's part of a DeMo message: its chunks, the components kept per chunk, the low
    bits of an index, the values its high part takes, and the bytes of the unary vectors and of
    the records."""

    chunks: int
    k: int
    low: int
    buckets: int
    unary_bytes: int
    record_bytes: int


class DCTMessage:
    """One rank's DeMo message for tensors of ``shapes``: one fp32 scale per tensor, then each
    tensor's kept components, their indices in Elias-Fano code and their values in e4m3.

    A chunk's ``k`` indices (below its width ``w``) are sorted and split. The low
    ``l = floor(log2(w / k))`` bits of each go beside its value, in an ``l + 8``-bit record.
    The high parts, ascending, are written in unary: the ``i``-th index sets bit ``high + i``
    of a vector of ``k + ceil(w / 2**l)`` bits. That is at most ``l + 3`` bits an index: for
    ``k = 32`` of a 64 × 64 chunk, 9 bits against the 12 written out, 17 bits a component.
    The size depends on the shapes alone."""

    def __init__(self, compression: DCTTopK, shapes: list[torch.Size]):
        self.compression, self.shapes = compression, shapes
        self.layouts = [self._layout(s) for s in shapes]
        self.nbytes = 4 * len(shapes) + sum(t.unary_bytes + t.record_bytes for t in self.layouts)

    def _layout(self, shape: torch.Size) -> _TensorLayout:
        width = self.compression.width(shape)
        k = min(self.compression.k, width)
        low = (width // k).bit_length() - 1
        chunks, buckets = self.compression.kept(shape) // k, ((width - 1) >> low) + 1
        return _TensorLayout(
            chunks, k, low, buckets,
            math.ceil(chunks * (k + buckets) / 8), math.ceil(chunks * k * (low + 8) / 8),
        )  # fmt: skip

    @staticmethod
    def quantize(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(e4m3 bytes, scale)`` of a tensor's sent values (``value ~= e4m3 / scale``)."""
        q, scale = quantize_fp8(values, E4M3)
        return q.view(torch.uint8), scale.reshape(1)

    @staticmethod
    def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The values ``quantize`` rounded (fp32)."""
        return q.view(E4M3).float() / scale

    def encode(self, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The message of each tensor's ``(index, e4m3 bytes, scale)``, in ``shapes``' order."""
        out = [torch.cat([s.float() for _, _, s in parts]).view(torch.uint8)]
        for (index, q, _), (chunks, k, low, buckets, _, _) in zip(parts, self.layouts):
            index, order = index.reshape(chunks, k).sort(dim=1)
            q = q.reshape(chunks, k).gather(1, order).long()
            rank = torch.arange(k, device=index.device)
            unary = torch.zeros(chunks, k + buckets, dtype=torch.bool, device=index.device)
            unary.scatter_(1, (index >> low) + rank, True)
            out.append(pack_bits(unary.reshape(-1), 1))
            out.append(pack_bits((((index & ((1 << low) - 1)) << 8) | q).reshape(-1), low + 8))
        return torch.cat(out)

    def coefficients(self, message: torch.Tensor) -> list[torch.Tensor]:
        """Per tensor, the chunks' DCT coefficients [tiles, width] that ``message`` holds."""
        scales = message[: 4 * len(self.shapes)].view(torch.float32)
        out, at = [], 4 * len(self.shapes)
        for shape, layout, scale in zip(self.shapes, self.layouts, scales):
            chunks, k, low, buckets, unary_bytes, record_bytes = layout
            unary = unpack_bits(message[at : at + unary_bytes], 1, chunks * (k + buckets))
            unary = unary.view(chunks, k + buckets)
            at += unary_bytes
            if not bool((unary.sum(1) == k).all()):
                raise ValueError(f"a DeMo message without {k} indices in each chunk: corrupt")
            high = unary.nonzero()[:, 1].view(chunks, k) - torch.arange(k, device=unary.device)
            records = unpack_bits(message[at : at + record_bytes], low + 8, chunks * k)
            records = records.view(chunks, k)
            at += record_bytes
            index = (high << low) | (records >> 8)
            values = self.dequantize((records & 255).to(torch.uint8), scale)
            out.append(self.compression.scatter(index, values, shape))
        return out
