"""Optimizers and their state: AdamW (one process or exchanged gradients), GaLore (AdamW in a
low-rank projection of each matrix's gradient, teralm.train.galore), either offloaded to the CPU
(teralm.train.offload), 1-bit Adam and DeMo.

1-bit Adam (Tang et al., 2021) is AdamW whose ranks agree on the momentum instead of the
gradient. For ``warmup`` steps it is AdamW on all-reduced gradients. Then its second moment is
frozen, since 1-bit messages would corrupt it, and every rank adds its own gradient to the
agreed momentum (``m_r = beta1 * m + (1 - beta1) * g_r``). The ranks' mean of those through
1-bit messages with error feedback (teralm.train.distributed.OneBitMean) is the new agreed ``m``.

DeMo (decoupled momentum, Peng, Quesnelle and Kingma, 2024) keeps each rank's momentum local
and sends only what changes fastest in it: every step a rank adds its gradient to its momentum
(``m = beta * m + g``), takes the top-k DCT components of each chunk of ``m``
(teralm.train.compression.DCTTopK), rounds their values to e4m3, subtracts what it sends from
``m`` (it is no longer owed), and all-gathers one message for all parameters
(``DCTMessage``). Every rank sums the components of all ranks, decodes their mean and steps by
its sign (``p -= lr * (sign(q) + weight_decay * p)``), so the ranks stay identical.
"""

from __future__ import annotations

import torch

from teralm.errors import ConfigError
from teralm.train.compression import DCTMessage, DCTTopK
from teralm.train.config import TrainConfig
from teralm.train.distributed import OneBitMean, Traffic, World, all_gather
from teralm.train.galore import GaLoreAdamW
from teralm.train.offload import Offloaded
from teralm.train.per_layer import PerLayer


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Matrices decay, vectors (norm weights, biases) do not."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def galore_rank(rank: float, width: int) -> int:
    """GaLore's rank: ``rank`` itself, or that fraction of the model's ``width`` when below 1."""
    return max(1, round(rank * width)) if rank < 1 else int(rank)


def galore_groups(model: torch.nn.Module, cfg: TrainConfig) -> list[dict]:
    """``parameter_groups`` with the matrices of the transformer blocks apart, projected at
    the configured rank; embeddings, the head, norms and biases stay plain AdamW."""
    decay, rest = parameter_groups(model, cfg.weight_decay)
    inside = {id(p) for name, p in model.named_parameters() if name.startswith("blocks.")}
    projected = [p for p in decay["params"] if p.ndim == 2 and id(p) in inside]
    plain = [p for p in decay["params"] if id(p) not in {id(q) for q in projected}]
    rank = galore_rank(cfg.galore_rank, model.cfg.d_model)
    galore = {"rank": rank, "gap": cfg.galore_gap, "scale": cfg.galore_scale}
    return [
        {"params": projected, "weight_decay": cfg.weight_decay, **galore},
        {"params": plain, "weight_decay": cfg.weight_decay},
        rest,
    ]


def make_optimizer(
    model: torch.nn.Module, cfg: TrainConfig, world: World | None = None
) -> torch.optim.Optimizer | Offloaded | PerLayer:
    """DeMo for ``comm = "demo"``; 1-bit Adam for ``comm = "onebit"`` of the momentum; GaLore
    for ``optimizer = "galore"`` or ``"galore8bit"``; else AdamW, fused (one kernel for all
    parameters, on the CPU too); on CPU copies of the weights with ``offload`` (bf16 working
    weights on a GPU with ``optimizer+master``); stepped parameter by parameter inside the
    backward with ``per_layer_update``."""
    if cfg.comm == "demo":
        compression = DCTTopK(cfg.demo_chunk, cfg.demo_topk)
        groups = parameter_groups(model, cfg.weight_decay)
        return DeMo(groups, cfg.lr, cfg.demo_beta, compression, world or World())
    betas = (cfg.beta1, cfg.beta2)
    if cfg.comm == "onebit" and cfg.onebit_target == "momentum":
        groups = parameter_groups(model, cfg.weight_decay)
        mean = OneBitMean(world or World(), cfg.onebit_block, Traffic())
        return OneBitAdam(groups, cfg.lr, betas, cfg.onebit_warmup, mean)
    if cfg.optimizer == "adamw":
        groups = parameter_groups(model, cfg.weight_decay)

        def make(groups: list[dict]) -> torch.optim.Optimizer:
            return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, fused=True)

    else:
        groups = galore_groups(model, cfg)

        def make(groups: list[dict]) -> torch.optim.Optimizer:
            return GaLoreAdamW(groups, cfg.lr, betas, eight_bit=cfg.optimizer == "galore8bit")

    if cfg.per_layer_update:
        return PerLayer(groups, make)
    if cfg.offload == "none":
        return make(groups)
    on_gpu = next(model.parameters()).is_cuda
    masters = cfg.offload == "optimizer+master"
    return Offloaded(groups, make, masters, torch.bfloat16 if on_gpu else None)


def _parameters(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, dict]]:
    """Every parameter with its group, in the groups' order."""
    return [(p, group) for group in optimizer.param_groups for p in group["params"]]


class OneBitAdam(torch.optim.Optimizer):
    """1-bit Adam: see the module's docstring. During the warm-up its steps are
    ``torch.optim.AdamW``'s; after it, ``p -= lr * (m / (1 - beta1^t)) / (sqrt(v / (1 -
    beta2^warmup)) + eps)`` with the frozen ``v``, and decoupled weight decay as AdamW's. ``traffic``
    counts what it and the warm-up's all-reduce send."""

    def __init__(
        self, params, lr: float, betas: tuple[float, float], warmup: int, mean: OneBitMean,
        eps: float = 1e-8,
    ):  # fmt: skip
        if warmup < 1:
            raise ConfigError("1-bit Adam needs a warm-up of at least one step")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})
        self.warmup, self.mean, self.traffic = warmup, mean, mean.traffic

    def _steps(self) -> int:
        """Steps taken so far (all parameters step together)."""
        state = self.state[self.param_groups[0]["params"][0]]
        return int(state["step"]) if "step" in state else 0

    def warming_up(self) -> bool:
        """Whether the next step is one of the warm-up's (gradients all-reduced, AdamW)."""
        return self._steps() < self.warmup

    @torch.no_grad()
    def step(self, closure=None):
        t = self._steps() + 1
        params = _parameters(self)
        for p, _ in params:
            state = self.state[p]
            if not state:
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            state["step"] = torch.tensor(float(t))
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p, _ in params]
        if t <= self.warmup:
            for (p, group), g in zip(params, grads):
                beta1, beta2 = group["betas"]
                self.state[p]["exp_avg"].lerp_(g.float(), 1 - beta1)
                self.state[p]["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
        else:
            beta1 = params[0][1]["betas"][0]
            local = torch.cat(
                [(beta1 * self.state[p]["exp_avg"] + (1 - beta1) * g).reshape(-1)
                 for (p, _), g in zip(params, grads)]
            )  # fmt: skip
            agreed, offset = self.mean(local), 0
            for p, _ in params:
                self.state[p]["exp_avg"].copy_(agreed[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        for p, group in params:
            beta1, beta2 = group["betas"]
            lr, state = group["lr"], self.state[p]
            second = 1 - beta2 ** min(t, self.warmup)
            denom = (state["exp_avg_sq"].sqrt() / second**0.5).add_(group["eps"])
            p.mul_(1 - lr * group["weight_decay"])
            p.addcdiv_(state["exp_avg"].to(p.dtype), denom.to(p.dtype), value=-lr / (1 - beta1**t))


class DeMo(torch.optim.Optimizer):
    """Decoupled momentum: see the module's docstring. ``traffic`` counts what it sends."""

    def __init__(self, params, lr: float, beta: float, compression: DCTTopK, world: World):
        if not 0 <= beta < 1:
            raise ConfigError("the DeMo momentum beta must be in [0, 1)")
        super().__init__(params, {"lr": lr, "beta": beta, "weight_decay": 0.0})
        self.compression, self.world, self.traffic = compression, world, Traffic()
        self.message: DCTMessage | None = None

    @torch.no_grad()
    def step(self, closure=None):
        params = _parameters(self)
        if self.message is None:
            self.message = DCTMessage(self.compression, [p.shape for p, _ in params])
        parts, totals = [], []
        for p, group in params:
            state = self.state[p]
            if "momentum" not in state:
                state["momentum"] = torch.zeros_like(p, dtype=torch.float32)
            momentum = state["momentum"].mul_(group["beta"])
            if p.grad is not None:
                momentum.add_(p.grad.float())
            index, values = self.compression.encode(momentum)
            q, scale = DCTMessage.quantize(values)
            sent = self.compression.scatter(index, DCTMessage.dequantize(q, scale), p.shape)
            momentum -= self.compression.inverse(sent, p.shape)
            parts.append((index, q, scale))
            totals.append(sent)
        messages = all_gather(self.message.encode(parts), self.world, self.traffic)
        for rank, message in enumerate(messages):
            if rank != self.world.rank:
                totals = [t + c for t, c in zip(totals, self.message.coefficients(message))]
        for (p, group), total in zip(params, totals):
            q = self.compression.inverse(total, p.shape)  # the ranks' sum: its sign is the mean's
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(torch.sign(q).to(p.dtype), alpha=-group["lr"])

    def local_state(self) -> dict[str, torch.Tensor]:
        """This rank's momentum (each rank's differs: it keeps what the rank did not send)."""
        params = _parameters(self)
        return {
            f"momentum.{i}": self.state[p]["momentum"]
            for i, (p, _) in enumerate(params)
            if "momentum" in self.state[p]
        }

    def load_local_state(self, tensors: dict[str, torch.Tensor]) -> None:
        for i, (p, _) in enumerate(_parameters(self)):
            if f"momentum.{i}" in tensors:
                self.state[p]["momentum"] = tensors[f"momentum.{i}"].to(p.device)
