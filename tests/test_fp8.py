"""Low-precision matmuls against fp64 references, within error bounds derived from the formats."""

from __future__ import annotations

import itertools

import pytest
import torch

from teralm.kernels.fp8 import (
    E4M3,
    E5M2,
    FP8_MAX,
    Fp8Matmul,
    Int8Matmul,
    has_fp8_matmul,
    quantize_fp8,
    quantize_int8,
    scaled_mm,
    scaled_mm_reference,
)

# (mantissa bits, exponent bits, exponent bias) of the two formats
FORMATS = {E4M3: (3, 4, 7), E5M2: (2, 5, 15)}


def fp8_magnitudes(dtype) -> torch.Tensor:
    """Every finite non-negative value of the format, from its definition (not torch's casts),
    ascending: consecutive values alternate between even and odd mantissas."""
    mant, exp, bias = FORMATS[dtype]
    values = set()
    for e, m in itertools.product(range(2**exp), range(2**mant)):
        scale = 2.0 ** (1 - bias) if e == 0 else 2.0 ** (e - bias)
        values.add((m / 2**mant + (e > 0)) * scale)
    return torch.tensor(sorted(v for v in values if v <= FP8_MAX[dtype]), dtype=torch.float64)


def round_reference(x: torch.Tensor, dtype) -> torch.Tensor:
    """Nearest representable value, ties to the even mantissa, saturating at the largest."""
    grid = fp8_magnitudes(dtype)
    mag = x.double().abs().clamp(max=grid[-1])
    idx = torch.searchsorted(grid, mag).clamp(1, len(grid) - 1)
    lo, hi = grid[idx - 1], grid[idx]
    up = (hi - mag < mag - lo) | ((hi - mag == mag - lo) & (idx % 2 == 0))
    return torch.where(up, hi, lo) * torch.sign(x.double())


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_fp8_rounding_equals_the_format_definition(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(20000, generator=gen, dtype=torch.float64) * torch.exp(
        torch.randn(20000, generator=gen, dtype=torch.float64) * 3
    )
    q, scale = quantize_fp8(x, dtype)
    scaled = (x.float() * scale).double()
    expected = round_reference(scaled, dtype)
    torch.testing.assert_close(q.double(), expected, rtol=0, atol=0)
    assert q.double().abs().max() == FP8_MAX[dtype]  # the largest magnitude maps to the top


def bound(x: torch.Tensor, w: torch.Tensor, ux: float, ax: float, uw: float, aw: float):
    """Worst-case |fl(x) fl(w)^T - x w^T| for elementwise errors |dx| <= ux|x| + ax, likewise w,
    plus fp32 accumulation."""
    ex, ew = ux * x.abs() + ax, uw * w.abs() + aw
    k = x.shape[1]
    return ex @ w.abs().T + x.abs() @ ew.T + ex @ ew.T + k * 2**-23 * (x.abs() @ w.abs().T) * 2


def fp8_error(dtype, scale: torch.Tensor) -> tuple[float, float]:
    """(relative, absolute) rounding error of quantize_fp8 in the original units."""
    mant, _, bias = FORMATS[dtype]
    return 2.0 ** -(mant + 1), 2.0 ** (1 - bias - mant) / 2 / float(scale)


@pytest.mark.parametrize("shape", [(7, 48, 32), (33, 64, 80)])
def test_fp8_matmul_forward_and_backward_within_bounds(shape):
    m, k, n = shape
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(m, k, generator=gen) * 3).double().requires_grad_()
    w = (torch.randn(n, k, generator=gen) * 0.1).double().requires_grad_()
    y = Fp8Matmul.apply(x.float(), w.float())
    x64, w64 = x.detach(), w.detach()
    _, xs = quantize_fp8(x64, E4M3)
    _, ws = quantize_fp8(w64, E4M3)
    ux, ax = fp8_error(E4M3, xs)
    uw, aw = fp8_error(E4M3, ws)
    err = (y.double() - x64 @ w64.T).abs()
    assert (err <= bound(x64, w64, ux, ax, uw, aw)).all()
    assert err.max() > 0  # it really is quantised

    g = torch.randn(m, n, generator=gen).double()
    gx, gw = torch.autograd.grad(y, (x, w), g.float())
    _, gs = quantize_fp8(g, E5M2)
    ug, ag = fp8_error(E5M2, gs)
    assert ((gx.double() - g @ w64).abs() <= bound(g, w64.T.contiguous(), ug, ag, uw, aw)).all()
    assert (
        (gw.double() - g.T @ x64).abs()
        <= bound(g.T.contiguous(), x64.T.contiguous(), ug, ag, ux, ax)
    ).all()


def test_int8_matmul_per_row_and_per_token_scales():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(9, 40, generator=gen, dtype=torch.float64)
    x[3] *= 100  # one loud token must not cost the others their precision
    w = torch.randn(24, 40, generator=gen, dtype=torch.float64) * 0.05
    y = Int8Matmul.apply(x.float(), w.float()).double()
    _, xs = quantize_int8(x)
    _, ws = quantize_int8(w)
    xs, ws = xs.double(), ws.double()
    ex = (xs / 2).expand_as(x)  # rounding error at most half a step, per token
    ew = (ws / 2).expand_as(w)  # per output row
    limit = ex @ w.abs().T + x.abs() @ ew.T + ex @ ew.T + 40 * 2**-22 * (x.abs() @ w.abs().T)
    assert ((y - x @ w.T).abs() <= limit).all()
    quiet = [i for i in range(9) if i != 3]
    assert (xs[quiet] < xs[3] / 20).all()


def test_scaled_mm_reference_is_exact_products():
    a = torch.tensor([[1.5, -2.0], [0.25, 448.0]]).to(E4M3)
    b = torch.tensor([[2.0, 0.5]]).to(E4M3)
    out = scaled_mm(a, torch.tensor(2.0), b, torch.tensor(4.0), torch.float32)
    torch.testing.assert_close(out, torch.tensor([[2.0 / 8], [(0.5 + 224.0) / 8]]))


@pytest.mark.skipif(
    not torch.cuda.is_available() or not has_fp8_matmul(torch.device("cuda")),
    reason="needs a GPU with fp8 tensor cores (compute capability >= 8.9)",
)
def test_gpu_scaled_mm_equals_emulation():
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(64, 128, device="cuda", generator=gen)
    b = torch.randn(96, 128, device="cuda", generator=gen)
    (aq, sa), (bq, sb) = quantize_fp8(a, E4M3), quantize_fp8(b, E4M3)
    fast = scaled_mm(aq, sa, bq, sb, torch.float32)
    slow = scaled_mm_reference(aq, sa, bq, sb, torch.float32)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-4)
