"""RMSNorm, optionally followed by rotary positions, forward and backward in one pass each, on
the CPU in fp32 or bf16.

In PyTorch the chain is a dozen elementwise ops, each one more pass over the activations (and,
in the backward, one more temporary): on 2 cores, QK-norm with rotary positions took a fifth
of a tiny-preset training step in fp32. Here a row is read once and written once.

Rows are the last dimension of ``x`` [A, B, T, D] (rows at any strides, as a transformer's
[batch, heads, positions, head channels] cut from a fused qkv projection; [1, 1, rows, channels]
for a plain RMSNorm), read through a flat view so that numba sees contiguous channels. The
forward gives ``y = rotate(x * scale * weight)`` with ``scale = rsqrt(mean(x^2) + eps)`` per row;
with ``rotate``, channel pairs (``i``, ``i + D/2``) of position ``t`` turn by the angle whose
cosine and sine are ``cos[t, i]`` and ``sin[t, i]`` (teralm.model.transformer.NormRope). The
backward needs only ``x`` and ``scale``.

numba has no bf16, so a bf16 tensor comes in as its 16-bit words (``_row``, ``_out`` and
``_store`` pick the conversion, or none, when a kernel is compiled): a word shifted up 16 bits
is the fp32 of the same value, and results are rounded to the nearest bf16 (ties to even) as
PyTorch rounds. The arithmetic is fp32 either way, and the outputs take the input's dtype.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import overload

from teralm.kernels.threads import match_torch_threads

CHUNK_ROWS = 256  # rows a thread takes at a time


def _row(src, start, bits, values):
    """The fp32 row at ``src[start:]``: a view of it for fp32; for bf16, converted into
    ``bits`` (uint32 scratch of the row's size) and given as ``values``, its fp32 view."""


def _out(dst, start, values):
    """Where to compute the fp32 row that ``_store`` writes to ``dst[start:]``."""


def _store(dst, start, bits):
    """Write the row computed at ``_out(dst, start, values)`` (``bits``: ``values``' uint32
    view) to ``dst[start:]``."""


@overload(_row, inline="always")
def _row_words(src, start, bits, values):
    if src.dtype == types.uint16:  # bf16 words

        def convert(src, start, bits, values):
            words = src[start : start + bits.shape[0]]  # indexed from 0: no wraparound checks
            for d in range(bits.shape[0]):
                bits[d] = np.uint32(words[d]) << np.uint32(16)
            return values

        return convert
    return lambda src, start, bits, values: src[start : start + values.shape[0]]


@overload(_out, inline="always")
def _out_words(dst, start, values):
    if dst.dtype == types.uint16:
        return lambda dst, start, values: values
    return lambda dst, start, values: dst[start : start + values.shape[0]]


@overload(_store, inline="always")
def _store_words(dst, start, bits):
    if dst.dtype == types.uint16:

        def store(dst, start, bits):
            words = dst[start : start + bits.shape[0]]
            for d in range(bits.shape[0]):
                b = bits[d]  # rounded to nearest, ties to even (inputs here are finite)
                words[d] = np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))  # fmt: skip

        return store
    return lambda dst, start, bits: None  # computed in place


@njit(nogil=True, cache=True, fastmath=True, parallel=True)
def norm_rope_forward(x, x_strides, shape, weight, cos, sin, eps, rotate, y, scale):
    """Fill ``y`` (contiguous) and ``scale`` [A * B * T] from ``x``, as the module describes.
    ``x``: a flat array that holds row (a, b, t) at ``a * sa + b * sb + t * st`` for
    ``x_strides`` (sa, sb, st), channels contiguous; ``shape``: (A, B, T, D)."""
    A, B, T, D = shape
    sa, sb, st = x_strides
    half = D // 2
    rows = A * B * T
    chunks = (rows + CHUNK_ROWS - 1) // CHUNK_ROWS
    for chunk in prange(chunks):
        n = np.empty(D, np.float32)
        x_bits, y_bits = np.empty(D, np.uint32), np.empty(D, np.uint32)  # bf16 rows, as fp32
        x_values, y_values = x_bits.view(np.float32), y_bits.view(np.float32)
        for row in range(chunk * CHUNK_ROWS, min(rows, (chunk + 1) * CHUNK_ROWS)):
            t = row % T
            a, b = row // (B * T), row // T % B
            xs = _row(x, a * sa + b * sb + t * st, x_bits, x_values)
            ys = _out(y, row * D, y_values)
            square = np.float32(0.0)
            for d in range(D):
                square += xs[d] * xs[d]
            s = np.float32(1.0) / np.sqrt(square / D + eps)
            scale[row] = s
            for d in range(D):
                n[d] = xs[d] * s * weight[d]
            if rotate:
                for i in range(half):
                    c, si = cos[t, i], sin[t, i]
                    ys[i] = n[i] * c - n[i + half] * si
                    ys[i + half] = n[i] * si + n[i + half] * c
            else:
                for d in range(D):
                    ys[d] = n[d]
            _store(y, row * D, y_bits)


@njit(nogil=True, cache=True, fastmath=True, parallel=True)
def norm_rope_backward(
    grad, grad_strides, x, x_strides, shape, scale, weight, cos, sin, rotate, grad_x, grad_weight
):
    """Fill ``grad_x`` (contiguous) and ``grad_weight`` [D] with the gradients of the forward's
    output at ``x`` and ``weight``, given ``grad`` (its gradient; flat with strides, as ``x``)
    and the forward's ``scale``."""
    A, B, T, D = shape
    sa, sb, st = x_strides
    ga, gb, gt = grad_strides
    half = D // 2
    rows = A * B * T
    chunks = (rows + CHUNK_ROWS - 1) // CHUNK_ROWS
    partial = np.zeros((chunks, D), np.float32)  # each chunk's share of grad_weight
    for chunk in prange(chunks):
        g = np.empty(D, np.float32)  # the gradient at x * scale * weight
        x_bits, g_bits = np.empty(D, np.uint32), np.empty(D, np.uint32)  # bf16 rows, as fp32
        out_bits = np.empty(D, np.uint32)
        x_values, g_values = x_bits.view(np.float32), g_bits.view(np.float32)
        out_values = out_bits.view(np.float32)
        for row in range(chunk * CHUNK_ROWS, min(rows, (chunk + 1) * CHUNK_ROWS)):
            t = row % T
            a, b = row // (B * T), row // T % B
            xs = _row(x, a * sa + b * sb + t * st, x_bits, x_values)
            gs = _row(grad, a * ga + b * gb + t * gt, g_bits, g_values)
            out = _out(grad_x, row * D, out_values)
            if rotate:
                for i in range(half):
                    c, si = cos[t, i], sin[t, i]
                    g[i] = gs[i] * c + gs[i + half] * si
                    g[i + half] = gs[i + half] * c - gs[i] * si
            else:
                for d in range(D):
                    g[d] = gs[d]
            s = scale[row]
            dot = np.float32(0.0)  # sum over channels of g_n * n, with g_n = g * weight
            for d in range(D):
                n = xs[d] * s
                partial[chunk, d] += g[d] * n
                g[d] *= weight[d]
                dot += g[d] * n
            mean = dot / D
            for d in range(D):
                out[d] = s * (g[d] - xs[d] * s * mean)
            _store(grad_x, row * D, out_bits)
    grad_weight[:] = partial.sum(axis=0)


NO_ANGLES = np.zeros((1, 1), np.float32)  # the angle tables a plain RMSNorm passes


_WORDS = {torch.float32: torch.float32, torch.bfloat16: torch.uint16}  # what numba is given


def fused(x: torch.Tensor, cos: torch.Tensor | None = None) -> bool:
    """Whether these kernels take ``x`` (and angles ``cos``): fp32 or bf16 on the CPU, with one
    angle row per position [T, D/2] (training's layout) or none."""
    return x.device.type == "cpu" and x.dtype in _WORDS and (cos is None or cos.dim() == 2)


def _flat(x: torch.Tensor) -> tuple[np.ndarray, tuple[int, int, int]]:
    """``x`` [A, B, T, D] as the kernels read it: a flat array from its first element to its
    last (bf16 as its words), and the strides of its rows (its channels made contiguous when
    they were not)."""
    if x.stride(-1) != 1 or min(x.stride()) < 0:
        x = x.contiguous()
    extent = 1 + sum((size - 1) * stride for size, stride in zip(x.shape, x.stride()))
    flat = x.detach().as_strided((extent,), (1,)).view(_WORDS[x.dtype])
    return flat.numpy(), tuple(x.stride()[:3])


def _angles(cos: torch.Tensor | None, sin: torch.Tensor | None) -> tuple[np.ndarray, ...]:
    if cos is None:
        return NO_ANGLES, NO_ANGLES
    return cos.detach().float().numpy(), sin.detach().float().numpy()


def norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``y`` (contiguous, shaped as ``x`` [A, B, T, D], of its dtype) and each row's ``scale``
    [A, B, T] (fp32); with ``cos`` and ``sin`` [T, D/2], rotated (see the module's docstring)."""
    y = torch.empty(x.shape, dtype=x.dtype)
    scale = torch.empty(x.shape[:-1], dtype=torch.float32)
    cos_, sin_ = _angles(cos, sin)
    match_torch_threads()
    norm_rope_forward(
        *_flat(x), tuple(x.shape), weight.detach().float().numpy(), cos_, sin_, np.float32(eps),
        cos is not None, _flat(y)[0], scale.view(-1).numpy(),
    )  # fmt: skip
    return y, scale


def norm_rope_grads(
    grad: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients at ``x`` and ``weight`` of ``norm_rope``'s output, given ``grad`` (its
    gradient), its input ``x`` and the ``scale`` it gave; the one at ``x`` in ``x``'s dtype."""
    grad_x = torch.empty(x.shape, dtype=x.dtype)
    grad_weight = torch.empty(weight.shape, dtype=torch.float32)
    cos_, sin_ = _angles(cos, sin)
    match_torch_threads()
    norm_rope_backward(
        *_flat(grad.to(x.dtype)), *_flat(x), tuple(x.shape), scale.reshape(-1).numpy(),
        weight.detach().float().numpy(), cos_, sin_, cos is not None, _flat(grad_x)[0],
        grad_weight.numpy(),
    )  # fmt: skip
    return grad_x, grad_weight.to(weight.dtype)
