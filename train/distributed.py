"""Data-parallel training: the process group, the gradient exchanges, and the bytes they move.

``teralm train`` started by ``torchrun`` trains on ``WORLD_SIZE`` processes (gloo on the CPU,
NCCL on GPUs); started plainly, it is one process and nothing here communicates. Each step, after
every rank's backward, an exchange makes the ranks agree:

- ``allreduce``: the gradients' mean over ranks (the reference);
- ``onebit``: TScale's 1-bit compression with error feedback. Each rank adds its residual to its
  gradient, sends the signs (one bit each) and the mean magnitude of every block of
  ``ONEBIT_BLOCK`` values, and keeps what that message misses as the next residual. The ranks'
  decoded messages are averaged.
- ``demo``: DeMo (Peng, Quesnelle and Kingma, 2024), in teralm.train.optim.DeMo: the ranks
  exchange only the top-k DCT components of each chunk of their momentum (``DCTTopK``).

Traffic is counted as the usual ring algorithms move it: an all-reduce of ``n`` bytes sends and
receives ``2 (W - 1) / W * n`` per rank, an all-gather of ``n`` bytes per rank ``(W - 1) * n``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from teralm.train.config import COMMS

ONEBIT_BLOCK = 1024  # values sharing one scale in a 1-bit message


@dataclass(frozen=True)
class World:
    """This process's place among the training processes."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    device: str = "cpu"  # where the tensors of collectives live (the GPU with NCCL)

    @property
    def main(self) -> bool:
        """Whether this process writes checkpoints, metrics and progress (rank 0)."""
        return self.rank == 0


def join_world(device_type: str) -> World:
    """The world ``torchrun`` describes in the environment, with its process group started
    (NCCL for CUDA, else gloo); one process when started without it."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = f"cuda:{local_rank}" if device_type == "cuda" else "cpu"
    world = World(int(os.environ["RANK"]), size, local_rank, device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return world


def leave_world(world: World, together: bool = True) -> None:
    """End the process group: ``together``, once every process is here (one leaving while
    another still works can abort it in gloo); else at once (this process failed)."""
    if world.size > 1 and dist.is_initialized():
        if together:
            dist.barrier()
        dist.destroy_process_group()


@dataclass
class Traffic:
    """Bytes this rank sent, in the current step and in all. The ring algorithms counted here
    receive as much as they send, so the same numbers stand for what it received."""

    sent: int = 0
    step_sent: int = 0

    def all_reduced(self, nbytes: int, world: int) -> None:
        self._add(2 * (world - 1) * nbytes // world)

    def all_gathered(self, nbytes: int, world: int) -> None:
        self._add((world - 1) * nbytes)

    def new_step(self) -> None:
        self.step_sent = 0

    def _add(self, nbytes: int) -> None:
        self.sent += nbytes
        self.step_sent += nbytes


def all_gather(tensor: torch.Tensor, world: World, traffic: Traffic) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (of one shape on all ranks), in rank order."""
    if world.size == 1:
        return [tensor]
    raw = tensor.contiguous().view(torch.uint8)  # as bytes: gloo gathers no int16
    parts = [torch.empty_like(raw) for _ in range(world.size)]
    dist.all_gather(parts, raw)
    traffic.all_gathered(raw.numel(), world.size)
    return [part.view(tensor.dtype) for part in parts]


def _flat_grads(params: list[torch.Tensor]) -> torch.Tensor:
    """Every parameter's gradient in one vector (zeros for one that got none this step)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return torch.cat([p.grad.reshape(-1) for p in params])


def _set_grads(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
        offset += p.numel()


class AllReduce:
    """The gradients' mean over the ranks, in one all-reduce of all of them."""

    def __init__(self, world: World):
        self.world, self.traffic = world, Traffic()

    def exchange(self, params: list[torch.Tensor]) -> None:
        if self.world.size == 1:
            return
        flat = _flat_grads(params)
        dist.all_reduce(flat)
        self.traffic.all_reduced(flat.numel() * flat.element_size(), self.world.size)
        _set_grads(params, flat / self.world.size)


def pack_signs(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [n] as 1-bit signs (uint8, 8 a byte, ``x >= 0`` as 1) and the mean magnitude of each
    block of ``block`` values (fp32; the last block may be shorter)."""
    n = x.numel()
    blocks = math.ceil(n / block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=x.device)
    padded[:n] = x
    sums = padded.abs().view(blocks, block).sum(1)
    sizes = torch.full((blocks,), float(block), device=x.device)
    sizes[-1] = n - (blocks - 1) * block
    bits = (padded[: math.ceil(n / 8) * 8] >= 0).view(-1, 8).to(torch.uint8)
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=x.device)
    return (bits * weights).sum(1, dtype=torch.uint8), sums / sizes


def unpack_signs(signs: torch.Tensor, scales: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """The values a 1-bit message stands for: each sign times its block's scale [n]."""
    shifts = torch.arange(7, -1, -1, device=signs.device, dtype=torch.uint8)
    bits = ((signs[:, None] >> shifts) & 1).reshape(-1)[:n]
    magnitude = scales.repeat_interleave(block)[:n]
    return torch.where(bits.bool(), magnitude, -magnitude)


class OneBit:
    """1-bit gradients with error feedback: what a rank's message misses is added to its next
    gradient, so nothing is lost, only delayed."""

    def __init__(self, world: World, block: int = ONEBIT_BLOCK):
        self.world, self.block, self.traffic = world, block, Traffic()
        self.residual: torch.Tensor | None = None

    def exchange(self, params: list[torch.Tensor]) -> None:
        corrected = _flat_grads(params).float()
        if self.residual is not None:
            corrected += self.residual
        n = corrected.numel()
        signs, scales = pack_signs(corrected, self.block)
        own = unpack_signs(signs, scales, n, self.block)
        self.residual = corrected - own
        all_signs = all_gather(signs, self.world, self.traffic)
        all_scales = all_gather(scales, self.world, self.traffic)
        decoded = sum(
            own if r == self.world.rank else unpack_signs(s, c, n, self.block)
            for r, (s, c) in enumerate(zip(all_signs, all_scales))
        )
        _set_grads(params, decoded / self.world.size)


def make_exchange(comm: str, world: World) -> AllReduce | OneBit | None:
    """The gradient exchange for ``comm`` (None for ``demo``: its optimizer communicates)."""
    if comm not in COMMS:
        raise ValueError(f"unknown comm {comm!r}; choose from {', '.join(COMMS)}")
    if comm == "allreduce":
        return AllReduce(world)
    if comm == "onebit":
        return OneBit(world)
    return None


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
            raise ValueError("the DCT chunk size and top-k must be at least 1")
        self.chunk, self.k = chunk, k
        self._bases: dict[tuple, torch.Tensor] = {}

    def _basis(self, device, dtype) -> torch.Tensor:
        key = (device, dtype)
        if key not in self._bases:
            self._bases[key] = dct_matrix(self.chunk).to(device=device, dtype=dtype)
        return self._bases[key]

    def _tiles(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as zero-padded chunks: [tiles, c] (vectors) or [tiles, c, c] (matrices)."""
        c = self.chunk
        m = x.reshape(x.shape[0], -1) if x.dim() > 1 else x.reshape(1, -1)
        rows = math.ceil(m.shape[0] / c) * c if x.dim() > 1 else 1
        cols = math.ceil(m.shape[1] / c) * c
        padded = torch.zeros(rows, cols, dtype=x.dtype, device=x.device)
        padded[: m.shape[0], : m.shape[1]] = m
        if x.dim() == 1:
            return padded.view(-1, c)
        return padded.view(rows // c, c, cols // c, c).permute(0, 2, 1, 3).reshape(-1, c, c)

    def _untile(self, tiles: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        c = self.chunk
        if len(shape) == 1:
            return tiles.reshape(-1)[: shape[0]]
        rows_in, cols_in = shape[0], math.prod(shape[1:])
        rows, cols = math.ceil(rows_in / c) * c, math.ceil(cols_in / c) * c
        m = tiles.view(rows // c, cols // c, c, c).permute(0, 2, 1, 3).reshape(rows, cols)
        return m[:rows_in, :cols_in].reshape(shape)

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
        """The ``k`` largest DCT components of each chunk: indices (int16) and values."""
        coefficients = self.transform(x)
        k = min(self.k, coefficients.shape[1])
        index = coefficients.abs().topk(k, dim=1).indices
        return index.to(torch.int16), coefficients.gather(1, index)

    def decode(self, index: torch.Tensor, values: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The tensor of ``shape`` whose chunks hold only these components."""
        width = self.chunk if len(shape) == 1 else self.chunk * self.chunk
        coefficients = torch.zeros(index.shape[0], width, dtype=values.dtype, device=values.device)
        coefficients.scatter_(1, index.long(), values)
        return self.inverse(coefficients, shape)
