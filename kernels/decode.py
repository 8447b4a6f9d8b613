"""A fused fp32 forward for a few new tokens against the KV cache, on the CPU.

Generating one token of a small model runs hundreds of tiny PyTorch ops, and on a CPU each
costs microseconds of dispatch: far more than their arithmetic. ``forward_rows`` does the whole
model for a handful of rows in one call, with no dispatch and without the GIL. The rows are
flattened over sequences: row ``r`` is token ``tokens[r]`` at position ``positions[r]`` of the
sequence cached in slot ``slots[r]``, so one call serves a batch of single-token steps, several
tokens of one sequence, or any mix. Each layer stores every row's key and value first, then
attends each row to the keys of its own slot up to its position, so the new tokens of one
sequence see each other causally (as in ``Transformer.decode``).

The arithmetic is the model's (teralm.model.transformer), in fp32: RMSNorm, QK-norm, rotary
positions over (first half, second half) channel pairs, windowed or full attention, ReLU² or
SwiGLU, the index input and the mixture gate. Matrices are read in PyTorch's [out, in] layout.
For a few rows, loops read each row of a weight once for all rows (the order that keeps a small
step bandwidth-bound rather than dispatch-bound); from ``BLAS_ROWS`` rows on (a prompt), the
products go to BLAS (scipy's, which numba calls for ``np.dot``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

EPS = np.float32(1e-6)  # teralm.model.transformer.RMSNorm's
BLAS_ROWS = 16  # from this many rows on, BLAS's blocked products beat the loops below
WEIGHT_LEFT_ROWS = 64  # below this many rows, BLAS is faster given the weight as left operand
WIDE_WEIGHT_LEFT_ROWS = 192  # the same for a matrix with more inputs than outputs


@njit(nogil=True, cache=True, fastmath=True, inline="always")
def _dot(u, v):
    acc = np.float32(0.0)
    for i in range(v.shape[0]):
        acc += u[i] * v[i]
    return acc


@njit(nogil=True, cache=True, fastmath=True, inline="always")
def _dot4(a, b, c, d, v):
    """The dot products of ``a``, ``b``, ``c`` and ``d`` with ``v``, reading ``v`` once."""
    s0 = s1 = s2 = s3 = np.float32(0.0)
    for i in range(v.shape[0]):
        s0 += a[i] * v[i]
        s1 += b[i] * v[i]
        s2 += c[i] * v[i]
        s3 += d[i] * v[i]
    return s0, s1, s2, s3


@njit(nogil=True, cache=True, fastmath=True)
def _matmul(x, w, out):
    """``out[r] = w @ x[r]`` for ``x`` [N, in], ``w`` [out, in]. Under four rows, four weight
    rows at a time share each row of ``x``; from four, four rows of ``x`` share each read of a
    weight row; from ``BLAS_ROWS``, BLAS: as ``(w @ x.T).T`` below ``WEIGHT_LEFT_ROWS`` rows
    (``WIDE_WEIGHT_LEFT_ROWS`` for a matrix with more inputs than outputs, as the MLP's down
    projection: there a third faster for a few dozen rows), then as ``x @ w.T``."""
    n_rows, n_out = x.shape[0], w.shape[0]
    left_below = WIDE_WEIGHT_LEFT_ROWS if w.shape[1] > n_out else WEIGHT_LEFT_ROWS
    if BLAS_ROWS <= n_rows < left_below:
        transposed = np.empty((n_out, n_rows), dtype=np.float32)
        np.dot(w, x.T, transposed)
        out[:] = transposed.T
        return
    if n_rows >= BLAS_ROWS:
        np.dot(x, w.T, out)
        return
    if n_rows < 4:
        for o in range(0, n_out - 3, 4):
            for r in range(n_rows):
                dots = _dot4(w[o], w[o + 1], w[o + 2], w[o + 3], x[r])
                out[r, o], out[r, o + 1], out[r, o + 2], out[r, o + 3] = dots
        for o in range(n_out - n_out % 4, n_out):
            for r in range(n_rows):
                out[r, o] = _dot(w[o], x[r])
        return
    for o in range(n_out):
        for r in range(0, n_rows - 3, 4):
            dots = _dot4(x[r], x[r + 1], x[r + 2], x[r + 3], w[o])
            out[r, o], out[r + 1, o], out[r + 2, o], out[r + 3, o] = dots
        for r in range(n_rows - n_rows % 4, n_rows):
            out[r, o] = _dot(w[o], x[r])


@njit(nogil=True, cache=True, fastmath=True, inline="always")
def _inverse_rms(v):
    return np.float32(1.0) / np.sqrt(_dot(v, v) / v.shape[0] + EPS)


@njit(nogil=True, cache=True, fastmath=True)
def _rms_norm(x, weight, out):
    for r in range(x.shape[0]):
        inv = _inverse_rms(x[r])
        for i in range(x.shape[1]):
            out[r, i] = x[r, i] * inv * weight[i]


@njit(nogil=True, cache=True, fastmath=True)
def _norm_rope(v, weight, cos, sin):
    """RMS-normalise one head vector ``v`` [D] in place, then rotate its channel pairs."""
    half = v.shape[0] // 2
    inv = _inverse_rms(v)
    for i in range(v.shape[0]):
        v[i] = v[i] * inv * weight[i]
    for i in range(half):
        a, b = v[i], v[i + half]
        v[i] = a * cos[i] - b * sin[i]
        v[i + half] = a * sin[i] + b * cos[i]


@njit(nogil=True, cache=True)
def length_bucket(n):
    """teralm.model.transformer.length_bucket for one length."""
    if n < 4:
        return max(n, 0)
    msb = 0
    while (n >> (msb + 1)) > 0:
        msb += 1
    return 2 * msb + ((n >> (msb - 1)) & 1)


@njit(nogil=True, cache=True, fastmath=True)
def _attend(qkv, keys, values, slots, positions, window, n_head, out):
    """Store every row's key and value, then attend each row's queries (``qkv`` [N, 3, H, D])
    to its slot's keys at positions ``pos - window < j <= pos`` (``window`` 0: all)."""
    head_dim = keys.shape[3]
    scale = np.float32(head_dim**-0.5)
    for r in range(qkv.shape[0]):
        for h in range(n_head):
            keys[slots[r], h, positions[r]] = qkv[r, 1, h]
            values[slots[r], h, positions[r]] = qkv[r, 2, h]
    scores = np.empty(keys.shape[2], dtype=np.float32)
    acc = np.empty(head_dim, dtype=np.float32)
    for r in range(qkv.shape[0]):
        pos = positions[r]
        first = 0 if window == 0 else max(0, pos - window + 1)
        for h in range(n_head):
            q, k, v = qkv[r, 0, h], keys[slots[r], h], values[slots[r], h]
            best = -np.inf
            for j in range(first, pos + 1):
                scores[j] = _dot(q, k[j]) * scale
                best = max(best, scores[j])
            total = np.float32(0.0)
            for j in range(first, pos + 1):
                scores[j] = np.exp(scores[j] - best)
                total += scores[j]
            acc[:] = 0.0
            for j in range(first, pos + 1):
                p = scores[j] / total
                for i in range(head_dim):
                    acc[i] += p * v[j, i]
            out[r, h * head_dim : (h + 1) * head_dim] = acc


@njit(nogil=True, cache=True, fastmath=True)
def forward_rows(
    tokens, next_token, match_len, slots, positions,  # [N] each, int64
    follower_summary, follower_weighted,  # [N, d] each: the followers' part; empty when off
    embed, next_embed, length_embed, gate_w, gate_b,  # index input: empty arrays when off
    attn_norm, qkv_w, q_norm, k_norm, proj_w, mlp_norm, up_w, down_w, windows,  # per layer
    norm, mix_w, mix_b, cos, sin, keys, values, swiglu, logits, gate, hidden_out,
):  # fmt: skip
    """The model's logits [N, vocab] and mixture gate logits [N] (left alone when ``mix_w`` is
    empty) for the rows, with their keys and values added to ``keys``/``values`` (per layer
    [slots, H, max_seq_len, D]), and the last block's outputs in ``hidden_out`` [N, d] unless
    it is empty. Per-layer weights come as typed lists."""
    n, d = tokens.shape[0], embed.shape[1]
    n_head = keys[0].shape[1]
    head_dim = d // n_head
    x = np.empty((n, d), dtype=np.float32)
    for r in range(n):
        x[r] = embed[tokens[r]]
    h = np.empty((n, d), dtype=np.float32)
    if next_embed.shape[0]:
        lengths = np.empty((n, d), dtype=np.float32)
        for r in range(n):
            lengths[r] = length_embed[length_bucket(match_len[r])]
        if follower_summary.shape[0]:
            lengths += follower_summary
        _matmul(x + lengths, gate_w, h)
        for r in range(n):
            g = np.float32(1.0) / (np.float32(1.0) + np.exp(-(h[r] + gate_b)))
            x[r] += g * (next_embed[next_token[r]] + lengths[r])
            if follower_weighted.shape[0]:
                x[r] += g * follower_weighted[r]
    qkv = np.empty((n, 3, n_head, head_dim), dtype=np.float32)
    y = np.empty((n, d), dtype=np.float32)
    hidden = down_w[0].shape[1]
    up = np.empty((n, up_w[0].shape[0]), dtype=np.float32)
    act = np.empty((n, hidden), dtype=np.float32)
    for layer in range(len(qkv_w)):
        _rms_norm(x, attn_norm[layer], h)
        _matmul(h, qkv_w[layer], qkv.reshape(n, 3 * d))
        for r in range(n):
            c, s = cos[positions[r]], sin[positions[r]]
            for hd in range(n_head):
                _norm_rope(qkv[r, 0, hd], q_norm[layer], c, s)
                _norm_rope(qkv[r, 1, hd], k_norm[layer], c, s)
        _attend(qkv, keys[layer], values[layer], slots, positions, windows[layer], n_head, h)
        _matmul(h, proj_w[layer], y)
        x += y
        _rms_norm(x, mlp_norm[layer], h)
        _matmul(h, up_w[layer], up)
        for r in range(n):
            for i in range(hidden):
                if swiglu:
                    g = up[r, i]
                    act[r, i] = g / (np.float32(1.0) + np.exp(-g)) * up[r, hidden + i]
                else:
                    act[r, i] = max(up[r, i], np.float32(0.0)) ** 2
        _matmul(act, down_w[layer], y)
        x += y
    if hidden_out.shape[0]:
        hidden_out[:] = x
    _rms_norm(x, norm, h)
    _matmul(h, embed, logits)
    if mix_w.shape[0]:
        for r in range(n):
            gate[r] = mix_b[0] + _dot(mix_w[0], h[r])
