"""CPU offload: an optimizer whose state, and fp32 master weights, live in CPU memory.

``Offloaded`` keeps an fp32 copy of every parameter on the CPU (pinned when CUDA is present) and
runs the wrapped optimizer on those copies: each step copies the gradients to the CPU, steps
there (vectorised, e.g. fused AdamW), and copies the weights back into the model's parameters.
With ``masters`` the model's own parameters become working copies in ``working_dtype`` (bf16 on a
GPU), so the device holds neither the optimizer state nor fp32 weights; without it they stay as
they are and only the state leaves the device. On a CPU-only machine the same code runs, on CPU
tensors, so that tests cover it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class Offloaded:
    """The optimizer ``make(groups)`` over CPU fp32 copies of ``groups``' parameters; see the
    module. Exposes the optimizer interface the training loop and checkpoints use."""

    def __init__(
        self,
        groups: list[dict],
        make: Callable[[list[dict]], torch.optim.Optimizer],
        masters: bool = False,
        working_dtype: torch.dtype | None = None,
    ):
        pin = torch.cuda.is_available()
        self.pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        cpu_groups = []
        for group in groups:
            copies = []
            for p in group["params"]:
                master = p.detach().to("cpu", torch.float32, copy=True)
                master = torch.nn.Parameter(master.pin_memory() if pin else master)
                self.pairs.append((p, master))
                copies.append(master)
            cpu_groups.append({**group, "params": copies})
        self.masters = masters
        if masters and working_dtype is not None:
            for p, _ in self.pairs:
                p.data = p.data.to(working_dtype)
        self.inner = make(cpu_groups)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @torch.no_grad()
    def step(self) -> None:
        for p, master in self.pairs:
            if p.grad is not None:
                master.grad = p.grad.to("cpu", torch.float32, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the gradients have arrived
        self.inner.step()
        for p, master in self.pairs:
            p.copy_(master, non_blocking=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, master in self.pairs:
            p.grad = master.grad = None

    def state_dict(self) -> dict:
        """The wrapped optimizer's state, with each master weight as its ``master`` (the model's
        working copies may have lost its low bits)."""
        state = self.inner.state_dict()
        if self.masters:
            for i, (_, master) in enumerate(self.pairs):
                state["state"].setdefault(i, {})["master"] = master.detach()
        return state

    def load_state_dict(self, state: dict) -> None:
        for i, (p, master) in enumerate(self.pairs):
            saved = state["state"].get(i, {}).pop("master", None)
            master.data.copy_(saved if saved is not None else p.detach().float())
        self.inner.load_state_dict(state)
