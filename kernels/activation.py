"""ReLU², forward and backward in one pass each, on the CPU in fp32.

In PyTorch, ``relu(x)²`` and its backward are four passes over the MLP's widest activations
(relu, square; then ``r + r`` and a product), and on 2 cores those passes, bound by memory
bandwidth, took a third of a tiny-preset training step: twice what GELU costs. Here the
forward reads ``x`` and writes ``y`` once; the backward needs only ``y`` (which the next
layer's matmul keeps for its own backward anyway), since ``relu(x) = sqrt(y)``.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from teralm.kernels.threads import match_torch_threads

CHUNK = 1 << 16  # elements a thread takes at a time


@njit(nogil=True, cache=True, fastmath=True, parallel=True)
def _forward(x, y):
    for chunk in prange((len(x) + CHUNK - 1) // CHUNK):
        for i in range(chunk * CHUNK, min(len(x), (chunk + 1) * CHUNK)):
            r = max(x[i], np.float32(0.0))
            y[i] = r * r


@njit(nogil=True, cache=True, fastmath=True, parallel=True)
def _backward(grad, y, grad_x):
    for chunk in prange((len(y) + CHUNK - 1) // CHUNK):
        for i in range(chunk * CHUNK, min(len(y), (chunk + 1) * CHUNK)):
            grad_x[i] = grad[i] * np.float32(2.0) * np.sqrt(y[i])


def fused(x: torch.Tensor) -> bool:
    """Whether these kernels take ``x``: contiguous fp32 on the CPU."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous()


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """``relu(x)²`` of a contiguous fp32 CPU tensor."""
    y = torch.empty_like(x)
    match_torch_threads()
    _forward(x.detach().view(-1).numpy(), y.view(-1).numpy())
    return y


def relu_squared_grad(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gradient at ``x`` of ``y = relu(x)²``, given ``grad``, the gradient at ``y``."""
    grad = grad.contiguous().float()
    grad_x = torch.empty_like(y)
    match_torch_threads()
    _backward(grad.view(-1).numpy(), y.detach().view(-1).numpy(), grad_x.view(-1).numpy())
    return grad_x
