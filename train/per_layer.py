"""Per-layer updates (as GaLore's paper does): each parameter is stepped by its own optimizer in a
hook the backward calls once that parameter's gradient is complete, and its gradient is freed
right away, so the whole model's gradients never exist at once.

The update runs before the rest of the gradient exists, so whatever needs all of it at once is
refused by the config: gradient clipping by global norm, gradient accumulation, and exchanges
between processes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class PerLayer:
    """``make(groups)`` for every parameter of ``groups`` alone, stepped from the backward. The
    loop's ``step`` and ``zero_grad`` then have nothing left to do; ``param_groups`` are all the
    parameters' groups (a learning rate set there reaches every one)."""

    def __init__(self, groups: list[dict], make: Callable[[list[dict]], torch.optim.Optimizer]):
        self.params = [p for group in groups for p in group["params"]]
        self.optimizers = {
            p: make([{**group, "params": [p]}]) for group in groups for p in group["params"]
        }
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._update)

    def _update(self, p: torch.Tensor) -> None:
        self.optimizers[p].step()
        p.grad = None

    @property
    def param_groups(self) -> list[dict]:
        return [group for opt in self.optimizers.values() for group in opt.param_groups]

    def step(self) -> None:
        """Nothing: every parameter was stepped during the backward."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: every gradient was freed once used."""

    def state_dict(self) -> dict:
        """One optimizer's state dict for all parameters, numbered in order."""
        state, groups = {}, []
        for i, p in enumerate(self.params):
            own = self.optimizers[p].state_dict()
            if 0 in own["state"]:  # its one parameter, once stepped
                state[i] = own["state"][0]
            groups += [{**g, "params": [i]} for g in own["param_groups"]]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, saved: dict) -> None:
        for i, p in enumerate(self.params):
            group = {**saved["param_groups"][i], "params": [0]}
            state = {0: saved["state"][i]} if i in saved["state"] else {}
            self.optimizers[p].load_state_dict({"state": state, "param_groups": [group]})
