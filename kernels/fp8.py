"""Scaled low-precision matmuls: fp8 (e4m3 / e5m2, one scale per tensor) and int8 (per-row
weight scales, per-token activation scales).

``scaled_mm`` runs ``torch._scaled_mm`` on GPUs that have fp8 tensor cores (compute capability
>= 8.9) and otherwise the emulation: the same quantised operands multiplied exactly in fp32. Both
see identical fp8 values, so CPU tests check the numerics that GPU training uses; only the fp32
summation order differs.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}
INT8_MAX = 127.0
EPS = 1e-12


def quantize_fp8(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` with ``q = fp8(x * scale)``; ``scale`` maps the tensor's largest magnitude
    to the format's largest finite value (round to nearest even, no overflow)."""
    amax = x.detach().abs().amax().float().clamp(min=EPS)
    scale = FP8_MAX[dtype] / amax
    q = (x.float() * scale).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)
    return q, scale


def quantize_int8(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per slice along ``dim`` (per row / per token):
    ``x ~= q * scale``."""
    amax = x.detach().abs().amax(dim=dim, keepdim=True).float().clamp(min=EPS)
    scale = amax / INT8_MAX
    q = torch.round(x.float() / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def has_fp8_matmul(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` runs on ``device`` (CUDA compute capability >= 8.9)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def scaled_mm_reference(
    a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor, out_dtype
) -> torch.Tensor:
    """``(a / scale_a) @ (b / scale_b).T`` from fp8 operands, computed exactly in fp32."""
    out = (a.float() @ b.float().t()) / (scale_a * scale_b)
    return out.to(out_dtype)


def scaled_mm(
    a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor, out_dtype
) -> torch.Tensor:
    """``(a / scale_a) @ (b / scale_b).T`` for fp8 ``a`` [M, K] and ``b`` [N, K]."""
    shapes_ok = a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0
    if not (has_fp8_matmul(a.device) and shapes_ok and not (a.dtype == b.dtype == E5M2)):
        return scaled_mm_reference(a, scale_a, b, scale_b, out_dtype)
    return torch._scaled_mm(
        a.contiguous(),
        b.contiguous().t(),  # column-major right operand, as cuBLASLt wants it
        scale_a=scale_a.reciprocal(),
        scale_b=scale_b.reciprocal(),
        out_dtype=out_dtype,
    )


class Fp8Matmul(torch.autograd.Function):
    """``x @ w.T`` with e4m3 operands forward and e5m2 output gradients backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xq, xs = quantize_fp8(x, E4M3)
        wq, ws = quantize_fp8(w, E4M3)
        ctx.save_for_backward(xq, xs, wq, ws)
        ctx.out_dtype = x.dtype
        return scaled_mm(xq, xs, wq, ws, x.dtype)

    @staticmethod
    @torch.autocast("cpu", enabled=False)
    @torch.autocast("cuda", enabled=False)
    def backward(ctx, grad: torch.Tensor):
        xq, xs, wq, ws = ctx.saved_tensors
        gq, gs = quantize_fp8(grad, E5M2)
        grad_x = scaled_mm(gq, gs, wq.t().contiguous(), ws, ctx.out_dtype)
        grad_w = scaled_mm(gq.t().contiguous(), gs, xq.t().contiguous(), xs, torch.float32)
        return grad_x, grad_w


class Int8Matmul(torch.autograd.Function):
    """``x @ w.T`` with int8 weights (a scale per output row) and int8 activations (a scale per
    token) forward; the backward pass uses the dequantised operands (straight-through)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xq, xs = quantize_int8(x, dim=-1)
        wq, ws = quantize_int8(w, dim=-1)
        x_deq, w_deq = xq.float() * xs, wq.float() * ws
        ctx.save_for_backward(x_deq, w_deq)
        ctx.out_dtype = x.dtype
        out = (xq.float() @ wq.float().t()) * xs * ws.t()  # int8 products are exact in fp32
        return out.to(x.dtype)

    @staticmethod
    @torch.autocast("cpu", enabled=False)
    @torch.autocast("cuda", enabled=False)
    def backward(ctx, grad: torch.Tensor):
        x_deq, w_deq = ctx.saved_tensors
        grad = grad.float()
        return (grad @ w_deq).to(ctx.out_dtype), grad.t() @ x_deq
