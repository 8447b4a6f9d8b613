"""Optimizers and their state: AdamW (one process or all-reduced gradients) and DeMo.

DeMo (decoupled momentum, Peng, Quesnelle and Kingma, 2024) keeps each rank's momentum local
and sends only what changes fastest in it: every step a rank adds its gradient to its momentum
(``m = beta * m + g``), takes the top-k DCT components of each chunk of ``m``
(teralm.train.distributed.DCTTopK), subtracts them from ``m`` (what was sent is no longer owed),
and all-gathers them. Every rank decodes the mean of all ranks' components and steps by its sign
(``p -= lr * (sign(q) + weight_decay * p)``), so the ranks stay identical.
"""

from __future__ import annotations

import torch

from teralm.train.config import TrainConfig
from teralm.train.distributed import DCTTopK, Traffic, World, all_gather


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Matrices decay, vectors (norm weights, biases) do not."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def make_optimizer(
    model: torch.nn.Module, cfg: TrainConfig, world: World | None = None
) -> torch.optim.Optimizer:
    """DeMo for ``comm = "demo"``, else AdamW, fused (one kernel for all parameters, on the CPU
    too)."""
    groups = parameter_groups(model, cfg.weight_decay)
    if cfg.comm == "demo":
        compression = DCTTopK(cfg.demo_chunk, cfg.demo_topk)
        return DeMo(groups, cfg.lr, cfg.demo_beta, compression, world or World())
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=True)


class DeMo(torch.optim.Optimizer):
    """Decoupled momentum: see the module's docstring. ``traffic`` counts what it sends."""

    def __init__(self, params, lr: float, beta: float, compression: DCTTopK, world: World):
        if not 0 <= beta < 1:
            raise ValueError("the DeMo momentum beta must be in [0, 1)")
        super().__init__(params, {"lr": lr, "beta": beta, "weight_decay": 0.0})
        self.compression, self.world, self.traffic = compression, world, Traffic()

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(p, dtype=torch.float32)
                momentum = state["momentum"]
                momentum.mul_(group["beta"]).add_(p.grad.float())
                index, values = self.compression.encode(momentum)
                own = self.compression.decode(index, values, momentum.shape)
                momentum -= own
                indices = all_gather(index, self.world, self.traffic)
                all_values = all_gather(values, self.world, self.traffic)
                q = sum(
                    own if r == self.world.rank else self.compression.decode(i, v, p.shape)
                    for r, (i, v) in enumerate(zip(indices, all_values))
                )
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(q / self.world.size).to(p.dtype), alpha=-group["lr"])
