"""Data-parallel training: the process group, the gradient exchanges, and the bytes they move.

``teralm train`` started by ``torchrun`` trains on ``WORLD_SIZE`` processes (gloo on the CPU,
NCCL on GPUs); started plainly, it is one process and nothing here communicates. Each step, after
every rank's backward, an exchange makes the ranks agree:

- ``allreduce``: the gradients' mean over ranks (the reference);
- ``onebit``: TScale's 1-bit compression with error feedback, as a compressed all-reduce
  (``OneBitMean``). Each rank adds its residual to its vector and cuts it into one shard per
  rank; shard ``j`` goes to rank ``j`` as signs (one bit each) and the mean magnitude of every
  block of ``onebit_block`` values. Rank ``j`` averages the shards it received, compresses that
  mean the same way (with a residual of its own) and sends it to everyone. What a message
  misses is kept and added back the next time, so nothing is lost, only delayed. The vector is
  AdamW's momentum once its second moment is frozen, as in 1-bit Adam (``onebit_target =
  "momentum"``, teralm.train.optim.OneBitAdam), or the gradients (``"gradient"``).
- ``powersgd``: PyTorch's PowerSGD communication hook on DistributedDataParallel, as it is.
- ``demo``: DeMo (Peng, Quesnelle and Kingma, 2024), in teralm.train.optim.DeMo: the ranks
  exchange only the top-k DCT components of each chunk of their momentum.

Traffic is counted as the usual ring algorithms move it: an all-reduce of ``n`` bytes sends and
receives ``2 (W - 1) / W * n`` per rank, an all-gather of ``n`` bytes per rank ``(W - 1) * n``,
an all-to-all of ``n`` bytes per rank ``(W - 1) / W * n``.

Each exchange keeps what is this rank's own (error-feedback residuals, DeMo's momentum) in
``local_state()``, which checkpoints save for every rank and ``load_local_state`` restores.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel

from teralm.errors import ConfigError
from teralm.train.compression import ShardedSignMean
from teralm.train.config import COMMS, TrainConfig


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


def join_world(device_type: str, group_alone: bool = False) -> World:
    """The world ``torchrun`` describes in the environment, with its process group started
    (NCCL for CUDA, else gloo); one process when started without it, in a group of its own
    when ``group_alone`` (for DistributedDataParallel)."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        if group_alone and not dist.is_initialized():
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return World(device="cuda:0" if device_type == "cuda" else "cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = f"cuda:{local_rank}" if device_type == "cuda" else "cpu"
    world = World(int(os.environ["RANK"]), size, local_rank, device)
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return world


def leave_world(world: World, together: bool = True) -> None:
    """End the process group: ``together``, once every process is here (one leaving while
    another still works can abort it in gloo); else at once (this process failed)."""
    if dist.is_initialized():
        if together and world.size > 1:
            dist.barrier()
        dist.destroy_process_group()


def check_world(cfg: TrainConfig, world: World, state: dict | None) -> None:
    """ConfigError unless the processes divide the global batch and (resuming from checkpoint
    ``state``) are as many as the run was trained on."""
    if cfg.batch_size % world.size:
        raise ConfigError(
            f"batch_size {cfg.batch_size} (the global batch) is not a multiple of the "
            f"{world.size} processes; choose a batch_size that {world.size} divides"
        )
    if cfg.per_layer_update and world.size > 1:
        raise ConfigError(
            "per_layer_update steps before the processes could exchange gradients: "
            "train it on one process"
        )
    saved = (state or {}).get("world_size", 1)
    if state is not None and saved != world.size:
        raise ConfigError(
            f"the run was trained on {saved} processes, and resuming on {world.size} is not "
            f"supported; resume it with torchrun --nproc-per-node {saved} (in all)"
        )


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

    def broadcast(self, nbytes: int, world: int, root: bool) -> None:
        self._add((world - 1) * nbytes if root else 0)

    def all_to_all(self, nbytes: int, world: int) -> None:
        self._add((world - 1) * nbytes // world)

    def new_step(self) -> None:
        self.step_sent = 0

    def _add(self, nbytes: int) -> None:
        self.sent += nbytes
        self.step_sent += nbytes


def all_gather(message: torch.Tensor, world: World, traffic: Traffic) -> list[torch.Tensor]:
    """Every rank's ``message`` (uint8, of one size on all ranks), in rank order."""
    if world.size == 1:
        return [message]
    parts = [torch.empty_like(message) for _ in range(world.size)]
    dist.all_gather(parts, message)
    traffic.all_gathered(message.numel(), world.size)
    return parts


def all_to_all(messages: torch.Tensor, world: World, traffic: Traffic) -> torch.Tensor:
    """``messages`` [W, n] (uint8): row ``j`` goes to rank ``j``; row ``r`` of the result came
    from rank ``r``."""
    if world.size == 1:
        return messages
    out = torch.empty_like(messages)
    dist.all_to_all_single(out, messages)
    traffic.all_to_all(messages.numel(), world.size)
    return out


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


class Exchange:
    """How the ranks agree on a step; this base does nothing (one process, plain AdamW).

    The loop trains ``wrap(model)``, runs each micro-batch inside ``accumulating(last)``,
    calls ``exchange(params)`` after the last backward, and reads ``traffic``."""

    def __init__(self, world: World):
        self.world, self.traffic = world, Traffic()

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def accumulating(self, last: bool) -> contextlib.AbstractContextManager:
        """Around a micro-batch's forward and backward (``last``: the step's final one)."""
        return contextlib.nullcontext()

    def exchange(self, params: list[torch.Tensor]) -> None:
        """Make every rank's gradients of ``params`` the agreed ones."""

    def local_state(self) -> dict[str, torch.Tensor]:
        """This rank's own state, of the same names and shapes on every rank."""
        return {}

    def load_local_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore what ``local_state`` returned (nothing to restore: ``{}``)."""


class AllReduce(Exchange):
    """The gradients' mean over the ranks, in one all-reduce of all of them."""

    def exchange(self, params: list[torch.Tensor]) -> None:
        if self.world.size == 1:
            return
        flat = _flat_grads(params)
        dist.all_reduce(flat)
        self.traffic.all_reduced(flat.numel() * flat.element_size(), self.world.size)
        _set_grads(params, flat / self.world.size)


class OneBitMean:
    """The ranks' mean of a vector through 1-bit messages (``ShardedSignMean``), with error
    feedback on both sides: every rank keeps the ``residual`` its own message missed, and, for
    the shard it averages, the ``shard_residual`` that its reply missed; both are added back the
    next time."""

    def __init__(self, world: World, block: int, traffic: Traffic):
        self.world, self.block, self.traffic = world, block, traffic
        self.residual: torch.Tensor | None = None
        self.shard_residual: torch.Tensor | None = None

    def __call__(self, values: torch.Tensor) -> torch.Tensor:
        """The decoded mean of every rank's ``values`` (fp32, of one length on all ranks)."""
        corrected = values if self.residual is None else values + self.residual
        W, rank = self.world.size, self.world.rank
        mean = ShardedSignMean(corrected.numel(), W, self.block)
        outgoing = mean.encode(corrected)
        self.residual = corrected - mean.decode(outgoing)
        incoming = all_to_all(outgoing, self.world, self.traffic)
        if self.shard_residual is None:
            self.shard_residual = torch.zeros(mean.length, device=corrected.device)
        reply, self.shard_residual = mean.reply(incoming, [1.0] * W, rank, self.shard_residual)
        return mean.decode(all_gather(reply, self.world, self.traffic))

    def local_state(self) -> dict[str, torch.Tensor]:
        if self.residual is None:
            return {}
        return {"residual": self.residual, "shard_residual": self.shard_residual}

    def load_local_state(self, tensors: dict[str, torch.Tensor]) -> None:
        if "residual" in tensors:
            self.residual, self.shard_residual = tensors["residual"], tensors["shard_residual"]


class OneBit(Exchange):
    """``onebit`` of the gradients (``onebit_target = "gradient"``): plain all-reduce for
    ``warmup`` steps, then the gradients' ``OneBitMean``."""

    def __init__(self, world: World, block: int, warmup: int = 0):
        super().__init__(world)
        self.warmup, self.steps = warmup, 0
        self.plain = AllReduce(world)
        self.plain.traffic = self.traffic
        self.mean = OneBitMean(world, block, self.traffic)

    def exchange(self, params: list[torch.Tensor]) -> None:
        self.steps += 1
        if self.steps <= self.warmup:
            return self.plain.exchange(params)
        _set_grads(params, self.mean(_flat_grads(params).float()))

    def local_state(self) -> dict[str, torch.Tensor]:
        return {"steps": torch.tensor([self.steps]), **self.mean.local_state()}

    def load_local_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.steps = int(tensors.get("steps", torch.tensor([0]))[0])
        self.mean.load_local_state(tensors)


class OneBitMomentum(Exchange):
    """``onebit`` of the momentum (``onebit_target = "momentum"``): the gradients' plain
    all-reduce while the optimizer (teralm.train.optim.OneBitAdam) warms up, then nothing
    here: the optimizer agrees on its momentum through 1-bit messages itself."""

    def __init__(self, world: World, optimizer: torch.optim.Optimizer):
        super().__init__(world)
        self.optimizer, self.traffic = optimizer, optimizer.traffic
        self.plain = AllReduce(world)
        self.plain.traffic = self.traffic

    def exchange(self, params: list[torch.Tensor]) -> None:
        if self.optimizer.warming_up():
            self.plain.exchange(params)

    def local_state(self) -> dict[str, torch.Tensor]:
        return self.optimizer.mean.local_state()

    def load_local_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.optimizer.mean.load_local_state(tensors)


class PowerSGD(Exchange):
    """PyTorch's PowerSGD hook (rank ``rank`` factors, after ``warmup`` steps of plain
    all-reduce) on DistributedDataParallel, which exchanges during the last micro-batch's
    backward. Its bytes are read off the hook's own compression counts.

    The hook keeps its error feedback and warm-start factors per bucket, laid out in the
    bucket's order of parameters, which DDP changes after the first step of every process.
    Here they are re-laid per parameter whenever that order changes (and so saved), so a
    resumed run goes on exactly as an uninterrupted one."""

    def __init__(self, world: World, rank: int, warmup: int):
        super().__init__(world)
        self.state = powersgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=warmup
        )
        self.ddp: DistributedDataParallel | None = None
        self.numbers: dict[int, int] = {}  # a parameter's storage address -> its number
        self.layouts: dict[int, list[tuple[int, torch.Size]]] = {}  # bucket -> its parameters
        self.restored: dict[str, torch.Tensor] = {}  # per-parameter state not yet laid out

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        device = [self.world.local_rank] if self.world.device.startswith("cuda") else None
        # the buffers (rope tables) are the same on every rank: never send them
        newer = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        buffers = {"forward_sync_buffers" if newer else "broadcast_buffers": False}
        # one bucket: gloo may run the hook's chained collectives of two buckets in another
        # order on each rank
        whole = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20 + 1
        self.ddp = DistributedDataParallel(
            model, device_ids=device, bucket_cap_mb=whole, **buffers
        )  # fmt: skip
        self.ddp.register_comm_hook(self.state, self._hook)
        self.numbers = {p.data_ptr(): i for i, p in enumerate(model.parameters())}
        return self.ddp

    def _hook(self, state: powersgd.PowerSGDState, bucket):  # DDP checks any annotation
        index = bucket.index()
        layout = [(self.numbers[p.data_ptr()], p.shape) for p in bucket.parameters()]
        if self.layouts.get(index) != layout:
            by_parameter = {**self.restored, **self._by_parameter()}
            self.restored = {}
            self.layouts[index] = layout
            self._lay_out(index, by_parameter)
        before = state.total_numel_after_compression
        plain = state.iter < state.start_powerSGD_iter
        future = powersgd.powerSGD_hook(state, bucket)
        numel = bucket.buffer().numel() if plain else state.total_numel_after_compression - before
        self.traffic.all_reduced(numel * bucket.buffer().element_size(), self.world.size)
        return future

    def _tables(self) -> dict[str, dict[int, torch.Tensor]]:
        s = self.state
        return {"error": s.error_dict, "p": s.p_memory_dict, "q": s.q_memory_dict}

    def _pieces(self, bucket: int) -> dict[str, list[tuple[str, int]]]:
        """Per table, the per-parameter pieces (name, length) of a bucket's flat tensor: every
        gradient's error, and the factors of those the hook compresses."""
        rank, rate = self.state.matrix_approximation_rank, self.state.min_compression_rate
        pieces: dict[str, list[tuple[str, int]]] = {"error": [], "p": [], "q": []}
        for number, shape in self.layouts[bucket]:
            n, m = shape[0], math.prod(shape[1:])
            pieces["error"].append((f"error.{number}", n * m))
            r = min(n, m, rank)
            if powersgd._should_compress(n, m, r, rate)[0]:
                pieces["p"].append((f"p.{number}", n * r))
                pieces["q"].append((f"q.{number}", m * r))
        return pieces

    def _by_parameter(self) -> dict[str, torch.Tensor]:
        out = {}
        for bucket in self.layouts:
            for table, pieces in self._pieces(bucket).items():
                flat = self._tables()[table].get(bucket)
                if flat is not None and pieces:
                    parts = flat.reshape(-1).split([size for _, size in pieces])
                    out.update({name: part for (name, _), part in zip(pieces, parts)})
        return out

    def _lay_out(self, bucket: int, by_parameter: dict[str, torch.Tensor]) -> None:
        device = torch.device(self.world.device)
        for table, pieces in self._pieces(bucket).items():
            if pieces and all(name in by_parameter for name, _ in pieces):
                parts = [by_parameter[name].reshape(-1).to(device) for name, _ in pieces]
                self._tables()[table][bucket] = torch.cat(parts)
            else:
                self._tables()[table].pop(bucket, None)

    def accumulating(self, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if last else self.ddp.no_sync()

    def local_state(self) -> dict[str, torch.Tensor]:
        s = self.state
        _, keys, position, has_gauss, gauss = s.rng.get_state()
        return {
            "iter": torch.tensor([s.iter, position, has_gauss], dtype=torch.int64),
            "rng": torch.from_numpy(keys.astype(np.int64)),
            "gauss": torch.tensor([gauss], dtype=torch.float64),
            **self.restored,
            **self._by_parameter(),
        }

    def load_local_state(self, tensors: dict[str, torch.Tensor]) -> None:
        if not tensors:
            return
        s = self.state
        s.iter, position, has_gauss = (int(v) for v in tensors["iter"])
        keys = tensors["rng"].numpy().astype(np.uint32)
        s.rng.set_state(("MT19937", keys, position, has_gauss, float(tensors["gauss"][0])))
        names = ("iter", "rng", "gauss")
        self.restored = {k: v for k, v in tensors.items() if k not in names}
        self.layouts = {}
        for table in self._tables().values():
            table.clear()


class Decoupled(Exchange):
    """DeMo: the optimizer exchanges momentum components itself (teralm.train.optim.DeMo);
    its momentum is this rank's own."""

    def __init__(self, world: World, optimizer: torch.optim.Optimizer):
        super().__init__(world)
        self.optimizer, self.traffic = optimizer, optimizer.traffic

    def local_state(self) -> dict[str, torch.Tensor]:
        return self.optimizer.local_state()

    def load_local_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.optimizer.load_local_state(tensors)


def make_exchange(cfg: TrainConfig, world: World, optimizer: torch.optim.Optimizer) -> Exchange:
    """The gradient exchange for ``cfg.comm``."""
    if cfg.comm not in COMMS:
        raise ConfigError(f"unknown comm {cfg.comm!r}; choose from {', '.join(COMMS)}")
    if cfg.comm == "onebit" and cfg.onebit_target == "momentum":
        return OneBitMomentum(world, optimizer)
    if cfg.comm == "onebit":
        return OneBit(world, cfg.onebit_block, cfg.onebit_warmup)
    if cfg.comm == "powersgd":
        return PowerSGD(world, cfg.powersgd_rank, cfg.powersgd_warmup)
    if cfg.comm == "demo":
        return Decoupled(world, optimizer)
    return AllReduce(world)


def gather_local_states(exchange: Exchange, world: World) -> dict[str, torch.Tensor]:
    """Every rank's ``local_state`` as ``rank{r}/{name}`` tensors, on rank 0 (``{}`` on the
    others); a collective that every rank joins."""
    local = exchange.local_state()
    if world.size == 1:
        return {f"rank0/{name}": t.detach().cpu().clone() for name, t in local.items()}
    out = {}
    for name in sorted(local):
        t = local[name].detach().contiguous().to(world.device)
        parts = [torch.empty_like(t) for _ in range(world.size)] if world.main else None
        dist.gather(t, parts, dst=0)
        if world.main:
            out.update({f"rank{r}/{name}": part.cpu() for r, part in enumerate(parts)})
    return out


def local_state_of(tensors: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """This rank's part of what ``gather_local_states`` saved."""
    prefix = f"rank{rank}/"
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
