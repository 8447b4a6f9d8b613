"""A run's folder: taking it (new, or resumed), its saved config, and its checkpoints."""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from teralm.errors import ConfigError
from teralm.model import checkpoint
from teralm.train.config import RunConfig, resumable_settings
from teralm.train.distributed import (
    Exchange,
    World,
    check_world,
    gather_local_states,
    local_state_of,
)
from teralm.train.sync import StepSync

RUN_CONFIG = "config.json"


def check_resumable(saved: dict, config: RunConfig, identity: dict) -> None:
    """Refuse to resume a run whose model, training settings or index differ."""
    old = RunConfig.from_saved(saved["config"])
    if old.model != config.model:
        diff = [
            f"{k}: {v!r} -> {config.model.to_dict()[k]!r}"
            for k, v in old.model.to_dict().items()
            if config.model.to_dict()[k] != v
        ]
        raise ConfigError("the run was trained with another model config (" + ", ".join(diff) + ")")
    new_train = asdict(config.train)
    changed = {k for k, v in asdict(old.train).items() if new_train[k] != v}
    refused = changed - resumable_settings()
    if refused:
        raise ConfigError("the run was trained with other settings: " + ", ".join(sorted(refused)))
    for key in ("tokenizer", "tokenizer_sha256", "vocab_size", "num_tokens", "tokens_sha256"):
        if saved["index"].get(key, identity[key]) != identity[key]:  # older runs lack some
            raise ConfigError(f"the run was trained on another index ({key} differs)")


def saved_config(run: Path) -> RunConfig:
    """The config a run was started with (``RUN/config.json``); ConfigError naming the file."""
    path = run / RUN_CONFIG
    advice = "pass --preset or --config with the run's settings to resume"
    record = checkpoint.read_json(path, advice)
    try:
        return RunConfig.from_saved(record.get("config"))
    except ValueError as e:
        raise ConfigError(f"{path} is not a teralm run config ({e}); {advice}") from None


def holds_run(run: Path) -> bool:
    """Whether folder ``run`` is a teralm run: it has a checkpoint pointer, or a run config."""
    if (run / checkpoint.LATEST).exists():
        return True
    try:
        record = json.loads((run / RUN_CONFIG).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and {"config", "index"} <= record.keys()


def open_run(run: Path, resume: bool) -> Path | None:
    """Create or check the run folder; the checkpoint to resume from (None: start afresh).

    A folder that holds anything but a run is refused, so no file of it is overwritten."""
    if run.exists() and not run.is_dir():
        raise ConfigError(f"--out {run} is a file, not a folder; choose another --out")
    if (
        run.exists()
        and any(not p.name.startswith(checkpoint.LOCK) for p in run.iterdir())
        and not holds_run(run)
    ):
        raise ConfigError(
            f"--out {run} is not empty and holds no teralm run; choose another --out "
            "(a new or empty folder)"
        )
    run.mkdir(parents=True, exist_ok=True)
    folder = checkpoint.latest(run)
    if folder is not None and not resume:
        raise ConfigError(
            f"{run} already holds a run: pass --resume to continue it, or another --out"
        )
    return folder


def open_run_everywhere(
    run: Path, resume: bool, world: World, held: contextlib.ExitStack, worker: int | None
) -> Path | None:
    """``open_run`` and the run's lock (kept in ``held``; a DiLoCo ``worker`` holds one of its
    own) on the main process, then the checkpoint to resume from, on every one."""
    error = None
    if world.main:
        try:
            open_run(run, resume)
            held.enter_context(checkpoint.lock_run(run, worker))
        except ValueError as e:
            error = e
    if world.size > 1:
        failed = torch.tensor([error is not None], dtype=torch.int32, device=world.device)
        dist.broadcast(failed, src=0)
        if failed.item() and error is None:
            raise ConfigError("the main process (rank 0) refused the run folder: see its error")
    if error is not None:
        raise error
    return checkpoint.latest(run) if resume else None


@dataclass
class Progress:
    """How far a run is: steps and tokens trained, and seconds, counting those of the
    processes before this one (``wall_before``); ``started`` is when this one began."""

    step: int = 0
    tokens: int = 0
    wall_before: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    def wall(self) -> float:
        return self.wall_before + time.perf_counter() - self.started


def _take(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Remove the tensors whose names begin with ``prefix`` from ``tensors``, and return them."""
    return {k: tensors.pop(k) for k in list(tensors) if k.startswith(prefix)}


class Checkpointer:
    """Saves a run's model, optimizer and every process's own state (the exchange's, the
    ``sync``'s) in ``RUN/ckpt-*`` (teralm.model.checkpoint), and resumes from the latest."""

    def __init__(
        self,
        run: Path,
        config: RunConfig,
        identity: dict,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        exchange: Exchange,
        sync: StepSync,
    ):
        self.run, self.config, self.identity = run, config, identity
        self.model, self.optimizer, self.exchange, self.sync = model, optimizer, exchange, sync
        self.world = exchange.world
        self.saved_step: int | None = None

    def resume(self) -> Progress:
        """Load the latest checkpoint (ConfigError if the run differs), and where it stood."""
        _, (weights, tensors, state) = checkpoint.load_latest(self.run)
        check_resumable(state, self.config, self.identity)
        check_world(self.config.train, self.world, state)
        self.model.load_state_dict(weights)
        torch.set_rng_state(tensors.pop("torch_rng"))
        ranks, rounds = _take(tensors, "rank"), _take(tensors, "outer/")
        checkpoint.restore_optimizer(self.optimizer, tensors, state["optimizer"])
        self.exchange.load_local_state(local_state_of(ranks, self.world.rank))
        progress = Progress(state["step"], state["tokens"], state["wall_s"])
        self.sync.restore(rounds, state, progress.step)
        self.saved_step = progress.step
        return progress

    def save(self, progress: Progress) -> None:
        """A checkpoint at ``progress.step``: every process takes part; one writes it."""
        self.saved_step = progress.step
        local_states = gather_local_states(self.exchange, self.world)
        if not self.sync.writes():
            return
        state = {
            "config": self.config.to_dict(),
            "index": self.identity,
            "tokens": progress.tokens,
            "wall_s": progress.wall(),
            "world_size": self.world.size,
        }
        sync_state, sync_tensors = self.sync.checkpoint()
        state.update(sync_state)
        local_states.update(sync_tensors)
        checkpoint.save(self.run, progress.step, self.model, self.optimizer, state, local_states)
