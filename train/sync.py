"""How a training process keeps step with the others, behind one interface for the loop:
every step (``StepSync``: data-parallel under torchrun, or one process alone) or every round
(``RoundSync``: a DiLoCo worker)."""

from __future__ import annotations

import torch

from teralm.train.config import TrainConfig
from teralm.train.diloco import Outer, is_round_end
from teralm.train.distributed import Exchange, World
from teralm.train.metrics import MetricsLog


class StepSync:
    """The processes agree on every step's gradients through ``exchange``
    (teralm.train.distributed); rank 0 writes the run and its metrics as they come."""

    rounds = 0

    def __init__(self, world: World, exchange: Exchange):
        self.world, self.traffic = world, exchange.traffic
        self.parts, self.part = world.size, world.rank  # the batch's split, and this one's share
        self.metrics_kind = "steps" if world.main else "none"

    def writes(self) -> bool:
        """Whether this process writes the run (its config, checkpoints and metrics)."""
        return self.world.main

    def agreed_at(self, step: int) -> bool:
        """Whether the processes agree at ``step``, so the run may stop or be saved there."""
        return True

    def start_step(self) -> None:
        self.traffic.new_step()

    def end_step(self, step: int, metrics: MetricsLog) -> int:
        """After ``step`` steps: the step to go on from."""
        return step

    def checkpoint(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """What a checkpoint adds to its state and tensors."""
        return {}, {}

    def restore(self, tensors: dict[str, torch.Tensor], state: dict, step: int) -> None:
        """Take back what ``checkpoint`` saved, resuming at ``step``."""

    def finish(self) -> None:
        """Settle what is in flight once the last step is taken."""

    def digest(self) -> str | None:
        """The sha256 of the weights every process agreed on, where they agree on weights."""
        return None


class RoundSync(StepSync):
    """DiLoCo worker ``replica``: it trains apart and meets the others through ``outer``
    (teralm.train.diloco) at the end of each round; the quorum's first writes the run, and
    a round's metrics once the round is agreed."""

    metrics_kind = "rounds"

    def __init__(self, outer: Outer, replica: int, cfg: TrainConfig):
        self.outer, self.replica, self.cfg = outer, replica, cfg
        self.traffic = outer.traffic
        self.parts, self.part = cfg.replicas, replica
        self.round_start = 0  # where this worker's current round began

    @property
    def rounds(self) -> int:
        return self.outer.rounds

    def writes(self) -> bool:
        """The first worker of the last round's quorum (before the first round, worker 0)."""
        return self.outer.main if self.outer.rounds else self.replica == 0

    def agreed_at(self, step: int) -> bool:
        return step == self.round_start

    def start_step(self) -> None:
        pass  # DiLoCo counts its traffic by round

    def end_step(self, step: int, metrics: MetricsLog) -> int:
        """At a round's end, the round: the same step, the round's start when it is to be
        redone, or where a peer put this worker."""
        if not is_round_end(self.cfg, step):
            return step
        agreed = self.outer.round(step, float(step - self.round_start))
        metrics.end_round(self.round_start, agreed == step and self.writes(), self.outer)
        self.round_start = agreed
        return agreed

    def checkpoint(self) -> tuple[dict, dict[str, torch.Tensor]]:
        return {"outer": self.outer.checkpoint_state()}, self.outer.checkpoint_tensors()

    def restore(self, tensors: dict[str, torch.Tensor], state: dict, step: int) -> None:
        self.outer.restore(tensors, state["outer"], step)
        self.round_start = step

    def finish(self) -> None:
        self.outer.finish()

    def digest(self) -> str | None:
        return self.outer.digest()
