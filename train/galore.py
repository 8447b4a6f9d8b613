"""GaLore (Zhao et al., 2024): AdamW whose moments live in a low-rank projection of each chosen
matrix's gradient, optionally with 8-bit moments.

For a matrix ``W`` [m, n] with gradient ``G``, every ``gap`` steps (from step 0) the projection
is recomputed from ``G``'s SVD: its top ``rank`` left singular vectors ``P`` [m, r] when
``m <= n`` (the gradient becomes ``P^T G`` [r, n]), else its top right singular vectors ``Q``
[n, r] (``G Q`` [m, r]). Adam's moments are kept in that space; the normalised update is
projected back, scaled by ``scale``, and applied with decoupled weight decay, as AdamW does. When
the projection changes, the moments are kept as they are and not re-projected, as the paper's
own implementation does: the next steps' gradients quickly pull them into the new subspace.

Parameters of a group without ``rank`` (norms, biases, embeddings unless chosen) get plain
AdamW. With ``eight_bit``, both moments are stored as e4m3 with one fp32 scale per block of
``BLOCK`` values (``Blockwise8bit``) and dequantised for each update.
"""

from __future__ import annotations

import math

import torch

from teralm.errors import ConfigError
from teralm.kernels.fp8 import E4M3, FP8_MAX

BLOCK = 256  # values sharing one scale in an 8-bit moment


class Blockwise8bit:
    """A tensor stored as e4m3 bytes with one fp32 scale per block of ``BLOCK`` values.

    Round trip bound, per value ``x`` of a block whose largest magnitude is ``a``: ``|x' - x| <=
    max(|x| / 16, a / 458752)``: e4m3 keeps 3 mantissa bits (half a step is 1/16 of the value),
    and below its smallest normal number (2^-6 of 448 after scaling) its steps are 2^-9 wide.
    """

    @staticmethod
    def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(bytes [n] uint8, scales [ceil(n / BLOCK)] fp32)`` of ``x`` (any shape)."""
        flat = x.detach().float().reshape(-1)
        blocks = math.ceil(flat.numel() / BLOCK)
        padded = torch.zeros(blocks * BLOCK, device=x.device)
        padded[: flat.numel()] = flat
        amax = padded.view(blocks, BLOCK).abs().amax(1).clamp(min=1e-30)
        scales = FP8_MAX[E4M3] / amax
        q = (padded.view(blocks, BLOCK) * scales[:, None]).to(E4M3)
        return q.view(torch.uint8).reshape(-1)[: flat.numel()], scales

    @staticmethod
    def dequantize(q: torch.Tensor, scales: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        n = q.numel()
        padded = torch.zeros(scales.numel() * BLOCK, dtype=torch.uint8, device=q.device)
        padded[:n] = q
        values = padded.view(E4M3).float().view(-1, BLOCK) / scales[:, None]
        return values.reshape(-1)[:n].view(shape)


def subspace(grad: torch.Tensor, rank: int) -> torch.Tensor:
    """The projection of ``grad`` [m, n]: its top ``rank`` left singular vectors [m, r] when
    ``m <= n``, else its top right ones [n, r]."""
    u, _, vh = torch.linalg.svd(grad.float(), full_matrices=False)
    return u[:, :rank] if grad.shape[0] <= grad.shape[1] else vh[:rank].T


class GaLoreAdamW(torch.optim.Optimizer):
    """AdamW with GaLore's projected moments for groups that have ``rank``; see the module."""

    def __init__(
        self,
        params,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eight_bit: bool = False,
    ):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})
        self.eight_bit = eight_bit
        for group in self.param_groups:
            if "rank" in group and (group["rank"] < 1 or group["gap"] < 1):
                raise ConfigError("the GaLore rank and gap must be at least 1")

    def _moment(self, state: dict, name: str, like: torch.Tensor) -> torch.Tensor:
        if name not in state:
            return torch.zeros_like(like, dtype=torch.float32)
        if not self.eight_bit:
            return state[name]
        return Blockwise8bit.dequantize(state[name], state[f"{name}_scale"], like.shape)

    def _keep(self, state: dict, name: str, value: torch.Tensor) -> None:
        if self.eight_bit:
            state[name], state[f"{name}_scale"] = Blockwise8bit.quantize(value)
        else:
            state[name] = value

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                step = int(state.get("step", torch.zeros(())).item())
                grad = p.grad.float()
                if "rank" in group:
                    if step % group["gap"] == 0:
                        state["projection"] = subspace(grad, min(group["rank"], *grad.shape))
                    grad = self.project(grad, state["projection"])
                exp_avg = self._moment(state, "exp_avg", grad)
                exp_avg_sq = self._moment(state, "exp_avg_sq", grad)
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step += 1
                state["step"] = torch.tensor(float(step))
                self._keep(state, "exp_avg", exp_avg)
                self._keep(state, "exp_avg_sq", exp_avg_sq)
                bias1, bias2 = 1 - beta1**step, 1 - beta2**step
                update = (exp_avg / bias1) / ((exp_avg_sq / bias2).sqrt() + group["eps"])
                if "rank" in group:
                    update = group["scale"] * self.project_back(update, state["projection"], p)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update.to(p.dtype), alpha=-group["lr"])

    @staticmethod
    def project(grad: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
        """The gradient in the subspace: ``P^T G`` [r, n] or ``G Q`` [m, r]."""
        if grad.shape[0] <= grad.shape[1]:
            return projection.T @ grad
        return grad @ projection

    @staticmethod
    def project_back(low: torch.Tensor, projection: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """A projected update as a full [m, n] one."""
        if p.shape[0] <= p.shape[1]:
            return projection @ low
        return low @ projection.T
