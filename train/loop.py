"""``teralm train``: the training loop with index features, checkpoints and resume."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from teralm.errors import ConfigError
from teralm.files import write_atomic
from teralm.index import Index
from teralm.infer.precision import PrecisionChoice, autocast, choose_precision, default_device
from teralm.model import ModelConfig, Transformer
from teralm.model.config import AUTO, PRECISIONS
from teralm.model.transformer import index_lm_loss
from teralm.train.config import RunConfig, TrainConfig
from teralm.train.data import FragmentSampler, prefetched
from teralm.train.diloco import WorkerPlace, open_worker, worker_env_problem
from teralm.train.distributed import World, check_world, join_world, leave_world, make_exchange
from teralm.train.metrics import METRICS, MetricsLog
from teralm.train.optim import make_optimizer
from teralm.train.run_folder import (
    RUN_CONFIG,
    Checkpointer,
    Progress,
    open_run_everywhere,
    saved_config,
)
from teralm.train.sync import RoundSync, StepSync


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for reuse (True where it could be set).

    By default it returns large blocks to the system on free and maps them afresh on the next
    allocation, so every step page-faults its activations in anew: 5-10% of a tiny-preset
    step here. Blocks up to 32 MiB now come from the heap, which is trimmed only past 1 GiB
    free."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(mallopt(M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(M_TRIM_THRESHOLD, 1 << 30))


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Warmup, then cosine decay to ``min_lr_ratio`` or warmup-stable-decay (WSD)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "wsd":
        decay_start = int(cfg.max_steps * (1 - cfg.decay_fraction))
        if step < decay_start:
            return cfg.lr
        frac = (step - decay_start) / max(1, cfg.max_steps - decay_start)
        return cfg.lr - (cfg.lr - floor) * min(frac, 1.0)
    frac = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))


@dataclass
class TrainResult:
    steps: int
    final_loss: float
    tokens: int
    wall_s: float
    stopped: str  # "max_steps" or "max_minutes"
    parameters: int
    bytes_sent: int = 0  # by this process to the others, in all
    main: bool = True  # whether this process is the one that writes the run (rank 0)
    rounds: int = 0  # DiLoCo: the rounds this worker took part in
    weights_sha256: str | None = None  # DiLoCo: of the global weights the workers agreed on


def _step_loss(micro_losses: list[torch.Tensor]) -> float:
    """A step's mean loss over its micro-batches, as a float."""
    total = 0.0
    for loss in micro_losses:
        total += loss.item() / len(micro_losses)
    return total


def train(
    ix: Index,
    config: RunConfig,
    run: Path,
    resume: bool = False,
    progress: bool = True,
    device: torch.device | None = None,
    worker: WorkerPlace | None = None,
) -> TrainResult:
    """Train (or continue) the run in folder ``run``: on the processes ``torchrun`` started
    (data-parallel, see teralm.train.distributed), in this one, or as DiLoCo ``worker``
    (``mode = "diloco"``, see teralm.train.diloco)."""
    device = device or default_device()
    if (config.train.mode == "diloco") != (worker is not None):
        raise ConfigError(
            "mode diloco runs as a worker that a lighthouse coordinates (--lighthouse auto, or "
            "its address); --lighthouse belongs to mode diloco"
        )
    if worker is not None and (problem := worker_env_problem()):
        raise ConfigError(problem)
    world = join_world(device.type, group_alone=config.train.comm == "powersgd")
    try:
        if device.type == "cuda" and world.size > 1:
            device = torch.device("cuda", world.local_rank)
            torch.cuda.set_device(device)
        with contextlib.ExitStack() as held:  # the run's lock, on the main process
            trainer = Trainer(ix, config, run, device, world, worker)
            trainer.open(resume, held)
            trainer.announce(progress and world.main)
            result = trainer.fit(progress and world.main)
    except BaseException:
        leave_world(world, together=False)
        raise
    leave_world(world)
    return result


def _agree(value: float, world: World, op: str = "sum") -> float:
    """``value`` summed (or, with ``op="max"``, the largest) over the processes."""
    if world.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=world.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return float(t[0])


def _run_precision(
    model: ModelConfig, device: torch.device, resumed: Path | None, world: World
) -> PrecisionChoice:
    """The precision to train in: as asked; for ``auto``, the ``resumed`` run's own, or the
    main process's choice for this machine (which may time bf16 against fp32) on every one."""
    if model.precision != AUTO:
        return choose_precision(model.precision, device, width=model.d_model)
    if resumed is not None:
        return PrecisionChoice(saved_config(resumed).model.precision, "the resumed run's own")
    choice = choose_precision(AUTO, device, width=model.d_model)
    if world.size > 1:
        pick = torch.tensor([PRECISIONS.index(choice.precision)], device=world.device)
        dist.broadcast(pick, src=0)
        if PRECISIONS[int(pick)] != choice.precision:
            choice = PrecisionChoice(PRECISIONS[int(pick)], "the main process's choice")
    return choice


class Trainer:
    """One process's part of a run: its model, optimizer and step, and the parts it hands the
    rest to: ``sync`` (how it keeps step with the other processes, ``teralm.train.sync``), a
    ``Checkpointer`` and a ``MetricsLog``. ``open`` takes the run folder and builds (or
    resumes) the run; ``fit`` trains until ``max_steps`` or ``max_minutes``."""

    def __init__(
        self,
        ix: Index,
        config: RunConfig,
        run: Path,
        device: torch.device,
        world: World,
        worker: WorkerPlace | None = None,
    ):
        keep_freed_memory()
        self.ix, self.config, self.cfg, self.run = ix, config, config.train, run
        self.device, self.world, self.worker = device, world, worker
        config.model.vocab_size, config.model.max_match = ix.vocab_size, ix.max_match
        config.model.max_seq_len = max(config.model.max_seq_len, self.cfg.seq_len)
        self.identity = ix.identity()
        check_world(self.cfg, world, None)
        self.tokens_per_step = self.cfg.batch_size * self.cfg.seq_len * self.cfg.grad_accum
        self.micro_losses: list[torch.Tensor] = []
        self.batches = None

    def open(self, resume: bool, held: contextlib.ExitStack) -> None:
        """Take the run folder (its lock kept in ``held``), choose the precision, build the
        model, optimizer, exchange and sync, resume from the latest checkpoint (``resume``),
        and write the run's config."""
        cfg, world, worker = self.cfg, self.world, self.worker
        folder = open_run_everywhere(self.run, resume, world, held, worker and worker.replica)
        self.precision = _run_precision(
            self.config.model, self.device, self.run if folder else None, world
        )
        self.config.model.precision = self.precision.precision
        torch.manual_seed(cfg.seed)  # the same initial weights on every process
        self.model = Transformer(self.config.model).to(self.device)
        self.optimizer = make_optimizer(self.model, cfg, world)
        self.exchange = make_exchange(cfg, world, self.optimizer)
        self.sync = StepSync(world, self.exchange)
        if worker is not None:
            outer = held.enter_context(open_worker(worker, self.model, self.optimizer, cfg))
            self.sync = RoundSync(outer, worker.replica, cfg)
        self.checkpointer = Checkpointer(
            self.run, self.config, self.identity, self.model, self.optimizer, self.exchange,
            self.sync,
        )  # fmt: skip
        self.progress = self.checkpointer.resume() if folder is not None else Progress()
        forward = self.exchange.wrap(self.model)
        self.forward = torch.compile(forward) if cfg.compile else forward
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.sampler = self._sampler()
        if self.sync.writes():  # the same file from every DiLoCo worker, written whole
            record = {
                "config": self.config.to_dict(),
                "index": self.identity,
                "precision": self.precision.to_dict(),
            }
            write_atomic(self.run / RUN_CONFIG, json.dumps(record, indent=1).encode())

    def _sampler(self) -> FragmentSampler:
        """This process's share of every batch."""
        data = self.cfg
        if not self.config.model.index_input:  # nothing to drop
            data = dataclasses.replace(data, index_dropout=0.0)
        infgram = self.model.mixture_gate is not None
        share = (self.sync.part, self.sync.parts)
        threads = torch.get_num_threads()
        return FragmentSampler(self.ix, data, infgram, share, threads, self.config.model)

    def announce(self, show: bool) -> None:
        """The precision (and the processes) on stderr; a slow precision's warning."""
        if show:
            print(f"precision {self.precision.precision}: {self.precision.reason}", file=sys.stderr)
            if self.world.size > 1:
                print(f"{self.world.size} processes, gradients by {self.cfg.comm}", file=sys.stderr)
        if self.precision.warning and self.sync.writes():
            print(f"warning: {self.precision.warning}", file=sys.stderr)

    def fit(self, show: bool) -> TrainResult:
        """Train to the end of the run, saving every ``checkpoint_every`` steps and at the end."""
        cfg, progress = self.cfg, self.progress
        bar = tqdm(
            total=cfg.max_steps, initial=progress.step, desc="train", unit="step", disable=not show
        )
        stopped = "max_steps"
        progress.started = self.last_log = time.perf_counter()
        with contextlib.ExitStack() as stack:
            kind = self.sync.metrics_kind
            self.metrics = stack.enter_context(MetricsLog(self.run / METRICS, progress.step, kind))
            stack.callback(self._close_batches)
            self._batches_from(progress.step)
            while progress.step < cfg.max_steps:
                if self._out_of_time():
                    stopped = "max_minutes"
                    break
                self._advance(bar)
        bar.close()
        self.sync.finish()
        loss = self._mean_loss() if self.micro_losses else float("nan")
        if self.checkpointer.saved_step != progress.step:
            self.checkpointer.save(progress)
        return TrainResult(
            progress.step, loss, progress.tokens, progress.wall(), stopped,
            self.model.num_parameters(), self.sync.traffic.sent, self.sync.writes(),
            self.sync.rounds, self.sync.digest(),
        )  # fmt: skip

    def _advance(self, bar: tqdm) -> None:
        """One step, its metrics, the sync's say on where to go on from, and a checkpoint when
        one is due."""
        cfg, progress = self.cfg, self.progress
        self.sync.start_step()
        self.micro_losses = self._step(progress.step)
        progress.step += 1
        progress.tokens += self.tokens_per_step
        if progress.step % cfg.log_every == 0 or progress.step == cfg.max_steps:
            self._log(bar)
        bar.update(1)
        agreed = self.sync.end_step(progress.step, self.metrics)
        if agreed != progress.step:  # redo the round, or go on from where a peer put this worker
            self._batches_from(agreed)
            progress.tokens += (agreed - progress.step) * self.tokens_per_step
            bar.update(agreed - progress.step)
            progress.step = agreed
        step = progress.step
        due = step % cfg.checkpoint_every == 0 and self.sync.agreed_at(step)
        if due and self.checkpointer.saved_step != step:
            self.checkpointer.save(progress)

    def _step(self, step: int) -> list[torch.Tensor]:
        """One optimizer step (``grad_accum`` micro-batches, the exchange, clipping): the
        micro-batches' mixed losses, not yet read back (no device sync per step)."""
        cfg, device = self.cfg, self.device
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(cfg, step)
        micro_losses = []
        for micro in range(cfg.grad_accum):
            batch = next(self.batches).to(device)
            with self.exchange.accumulating(last=micro == cfg.grad_accum - 1):
                with autocast(device, self.precision.precision):
                    logits, gate = self.forward(
                        batch.tokens, batch.next_token, batch.match_len, with_gate=True,
                        infgram_total=batch.infgram_total, followers=batch.followers(),
                    )  # fmt: skip
                mixed, own = index_lm_loss(
                    logits, gate, batch.targets, batch.infgram_total, batch.infgram_hits
                )
                loss = mixed + cfg.own_loss_weight * own if gate is not None else mixed
                (loss / cfg.grad_accum).backward()
            micro_losses.append(mixed.detach())
        self.exchange.exchange(self.params)
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return micro_losses

    def _log(self, bar: tqdm) -> None:
        """The metrics record of the step just taken, and the progress bar's loss and speed."""
        cfg, progress, traffic = self.cfg, self.progress, self.sync.traffic
        now = time.perf_counter()
        loss = self._mean_loss()
        rate = self.tokens_per_step * cfg.log_every / max(now - self.last_log, 1e-9)
        self.last_log = now
        self.metrics.add({
            "step": progress.step,
            "loss": loss,
            "lr": learning_rate(cfg, progress.step - 1),
            "tokens": progress.tokens,
            "tok_per_s": rate,
            "elapsed_s": progress.wall(),
            "sent_bytes": traffic.step_sent,
            "received_bytes": traffic.step_sent,  # a ring receives what it sends
        })  # fmt: skip
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rate:,.0f}")

    def _mean_loss(self) -> float:
        """The last step's loss, averaged over the processes."""
        return _agree(_step_loss(self.micro_losses), self.world) / self.world.size

    def _out_of_time(self) -> bool:
        """Whether ``max_minutes`` have passed, by any process's clock (checked where the
        processes agree: every step, or between DiLoCo rounds)."""
        if not self.cfg.max_minutes or not self.sync.agreed_at(self.progress.step):
            return False
        late = self.progress.wall() > 60 * self.cfg.max_minutes
        return bool(_agree(float(late), self.world, "max"))

    def _batches_from(self, step: int) -> None:
        """Draw batches from step ``step`` on (closing the stream drawn so far)."""
        self._close_batches()
        cfg = self.cfg
        keys = [(s, micro) for s in range(step, cfg.max_steps) for micro in range(cfg.grad_accum)]
        self.batches = prefetched(self.sampler, keys, background=self.device.type != "cpu")

    def _close_batches(self) -> None:
        if self.batches is not None:
            self.batches.close()
            self.batches = None
