"""The transformer: causality, windows, the gated index input, and that it learns."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from teralm.kernels import activation as kernel_activation
from teralm.kernels import norm as kernel_norm
from teralm.model import ModelConfig, Transformer
from teralm.model.transformer import (
    IndexInput,
    NormRope,
    ReLUSquared,
    RMSNorm,
    length_bucket,
    lm_loss,
    rope_tables,
)


def small(**overrides) -> ModelConfig:
    base = dict(vocab_size=32, n_layer=2, n_head=2, d_model=32, max_seq_len=64, max_match=40)
    return ModelConfig(**{**base, **overrides})


def features(tokens: torch.Tensor, gen: torch.Generator):
    nxt = torch.randint(0, 33, tokens.shape, generator=gen)
    length = torch.randint(0, 41, tokens.shape, generator=gen)
    return nxt, length


def test_length_buckets():
    def reference(n: int) -> int:
        if n < 4:
            return n
        top = n.bit_length() - 1
        return 2 * top + ((n >> (top - 1)) & 1)

    lengths = torch.arange(0, 300)
    assert length_bucket(lengths).tolist() == [reference(n) for n in range(300)]


# fp8's per-tensor activation scale sees the whole sequence, so it is causal only up to rounding;
# int8's per-token scales keep it exactly causal
@pytest.mark.parametrize("precision", ["fp32", "int8"])
@pytest.mark.parametrize("attention", ["full", "tscale"])
def test_causal(precision, attention):
    torch.manual_seed(0)
    model = Transformer(small(precision=precision, attention=attention, window=8)).eval()
    for p in model.parameters():  # zero-initialised projections would hide leaks
        torch.nn.init.normal_(p, std=0.2)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 32, (1, 40), generator=gen)
    nxt, length = features(tokens, gen)
    base = model(tokens, nxt, length)
    changed = tokens.clone()
    changed[0, 25:] = (changed[0, 25:] + 1) % 32
    after = model(changed, nxt, length)
    torch.testing.assert_close(base[0, :25], after[0, :25])
    assert not torch.allclose(base[0, 25:], after[0, 25:])


def test_window_limits_what_one_layer_sees():
    torch.manual_seed(0)
    model = Transformer(small(n_layer=1, attention="tscale", window=6)).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    assert model.blocks[0].attn.window == 6
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 32, (1, 30), generator=gen)
    nxt, length = features(tokens, gen)
    base = model(tokens, nxt, length)
    changed = tokens.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 32
    after = model(changed, nxt, length)
    torch.testing.assert_close(base[0, 16:], after[0, 16:])  # 10 is out of their window
    assert not torch.allclose(base[0, 10:16], after[0, 10:16])


def test_tscale_layer_pattern():
    cfg = small(n_layer=12, attention="tscale")
    assert [cfg.windowed(i) for i in range(12)] == [True, True] + [True, False] * 5


def test_gated_index_input_gradients_by_finite_differences():
    torch.manual_seed(0)
    layer = IndexInput(small()).double()
    x = torch.randn(2, 5, 32, dtype=torch.float64, requires_grad=True)
    gen = torch.Generator().manual_seed(3)
    nxt, length = features(torch.zeros(2, 5), gen)
    params = [
        x,
        layer.gate.weight,
        layer.gate.bias,
        layer.next_embed.weight,
        layer.length_embed.weight,
    ]

    def fn(x, gw, gb, ne, le):
        layer.gate.weight.data, layer.gate.bias.data = gw, gb
        layer.next_embed.weight.data, layer.length_embed.weight.data = ne, le
        lengths = torch.nn.functional.embedding(length_bucket(length), le)
        gate = torch.sigmoid(torch.nn.functional.linear(x + lengths, gw, gb))
        return x + gate * (torch.nn.functional.embedding(nxt, ne) + lengths)

    inputs = [p.detach().clone().requires_grad_() for p in params]
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-5)
    # the module computes the same function
    torch.testing.assert_close(layer(x, nxt, length), fn(*[p.detach() for p in params]))
    y = layer(x, nxt, length).sum()
    y.backward()
    assert layer.gate.weight.grad is not None and layer.next_embed.weight.grad.abs().sum() > 0


def test_relu_squared_gradient_by_finite_differences():
    """Its hand-written backward, against fp64 finite differences and autograd's own."""
    x = torch.randn(40, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x = torch.cat([x, torch.zeros(2, dtype=torch.float64)]).requires_grad_()
    assert torch.autograd.gradcheck(ReLUSquared.apply, (x,), eps=1e-6, atol=1e-6)
    grad = torch.randn_like(x)
    (want,) = torch.autograd.grad(torch.relu(x).square(), x, grad)
    (got,) = torch.autograd.grad(ReLUSquared.apply(x), x, grad)
    torch.testing.assert_close(got, want)


def test_fp32_cpu_relu_squared_kernel_equals_fp64():
    """fp32 on the CPU runs teralm.kernels.activation (several chunks, an incoming gradient
    that is not contiguous): values and gradients within fp32 rounding of fp64 autograd."""
    gen = torch.Generator().manual_seed(4)
    x64 = (3 * torch.randn(3, 70_001, dtype=torch.float64, generator=gen)).requires_grad_()
    x32 = x64.detach().float().requires_grad_()
    assert kernel_activation.fused(x32)
    grad = torch.randn(70_001, 3, dtype=torch.float64, generator=gen).T
    got, want = ReLUSquared.apply(x32), torch.relu(x64).square()
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    (got_grad,) = torch.autograd.grad(got, x32, grad.float())
    (want_grad,) = torch.autograd.grad(want, x64, grad)
    torch.testing.assert_close(got_grad.double(), want_grad, rtol=1e-5, atol=1e-5)


def test_index_input_off_ignores_features():
    torch.manual_seed(0)
    model = Transformer(small(index_input=False)).eval()
    tokens = torch.randint(0, 32, (1, 10))
    torch.testing.assert_close(model(tokens), model(tokens, tokens, tokens))
    with pytest.raises(ValueError, match="index input"):
        Transformer(small())(tokens)


def test_loss_falls_and_the_index_input_is_used():
    """A copy task: the feature names the next token half of the time; the model must learn
    to trust it when the match is long, so it beats the same model without the input."""
    gen = torch.Generator().manual_seed(4)

    def batch():
        targets = torch.randint(0, 32, (8, 32), generator=gen)
        tokens = torch.roll(targets, 1, dims=1)
        good = torch.rand(targets.shape, generator=gen) < 0.5
        nxt = torch.where(good, targets, torch.randint(0, 32, targets.shape, generator=gen))
        length = torch.where(good, 20, 1)
        return tokens, nxt, length, targets

    losses = {}
    for use in (True, False):
        torch.manual_seed(0)
        model = Transformer(small(index_input=use))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        history = []
        for _ in range(150):
            tokens, nxt, length, targets = batch()
            loss = lm_loss(model(tokens, nxt, length), targets)
            opt.zero_grad()
            loss.backward()
            opt.step()
            history.append(loss.item())
        losses[use] = sum(history[-20:]) / 20
        assert losses[use] < history[0]
    # random targets: 3.47 nats without help; trusting the long matches halves it
    assert losses[True] < 0.75 * losses[False]


def test_infgram_mixture_is_a_distribution_and_its_loss_matches():
    from teralm.model.transformer import index_lm_loss, mixture_logp

    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 4, 10, generator=gen, dtype=torch.float64)
    gate = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    counts = torch.randint(0, 3, (3, 4, 10), generator=gen).double()
    seen = counts.sum(-1) > 0
    p_inf = counts / counts.sum(-1, keepdim=True).clamp(min=1)
    logp = mixture_logp(torch.log_softmax(logits, -1), gate, p_inf, seen)
    torch.testing.assert_close(logp.exp().sum(-1), torch.ones(3, 4, dtype=torch.float64))
    g = torch.sigmoid(gate)[..., None]
    manual = torch.where(
        seen[..., None], g * torch.softmax(logits, -1) + (1 - g) * p_inf, torch.softmax(logits, -1)
    )
    torch.testing.assert_close(logp.exp(), manual)
    targets = torch.randint(0, 10, (3, 4), generator=gen)
    total = counts.sum(-1).long()
    hits = counts.gather(-1, targets[..., None])[..., 0].long()
    loss, own = index_lm_loss(logits, gate, targets, total, hits)
    want = -manual.gather(-1, targets[..., None])[..., 0].log().mean()
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)
    plain = torch.nn.functional.cross_entropy(logits.reshape(-1, 10), targets.reshape(-1))
    torch.testing.assert_close(own.double(), plain, rtol=1e-5, atol=1e-6)
    assert torch.autograd.gradcheck(
        lambda gt: index_lm_loss(logits, gt, targets, total, hits)[0],
        (gate.clone().requires_grad_(),),
    )


def norm_then_rope(x, weight, cos, sin, eps):
    """The unfused reference: RMSNorm with ``weight``, then the rotation of channel pairs."""
    u = F.rms_norm(x, (x.shape[-1],), weight, eps)
    a, b = u.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


@pytest.mark.parametrize("decoding", [False, True], ids=["training", "decode"])
def test_fused_norm_rope_equals_norm_then_rope(decoding):
    """Values and gradients (fp64 finite differences, and autograd of the unfused chain) with
    the training tables [T, D/2] and the decode ones [B, 1, T, D/2]; bf16 within its rounding."""
    torch.manual_seed(0)
    B, H, T, D = 2, 3, 5, 8
    cos, sin = (t.double() for t in rope_tables(D, 16, 10_000.0))
    if decoding:
        positions = torch.tensor([[3, 4, 5, 6, 7], [0, 1, 2, 9, 11]])
        cos, sin = cos[positions][:, None], sin[positions][:, None]
    else:
        cos, sin = cos[:T], sin[:T]
    x = torch.randn(B, H, T, D, dtype=torch.float64, requires_grad=True)
    w = (1 + 0.3 * torch.randn(D, dtype=torch.float64)).requires_grad_()
    fused = lambda x, w: NormRope.apply(x, w, cos, sin, 1e-6)  # noqa: E731
    assert torch.allclose(fused(x, w), norm_then_rope(x, w, cos, sin, 1e-6), atol=1e-12)
    assert torch.autograd.gradcheck(fused, (x, w), eps=1e-6, atol=1e-7)
    grad = torch.randn(B, H, T, D, dtype=torch.float64)
    got = torch.autograd.grad(fused(x, w), (x, w), grad)
    want = torch.autograd.grad(norm_then_rope(x, w, cos, sin, 1e-6), (x, w), grad)
    assert all(torch.allclose(g, r, atol=1e-10) for g, r in zip(got, want))
    half = NormRope.apply(x.bfloat16(), w.float(), cos.float(), sin.float(), 1e-6)
    assert (half.double() - fused(x, w)).abs().max() < 0.05


def test_rms_norm_equals_pytorchs():
    """Values and gradients against ``F.rms_norm`` (fp64 autograd and finite differences)."""
    torch.manual_seed(1)
    norm = RMSNorm(8).double()
    with torch.no_grad():
        norm.weight.mul_(1 + 0.3 * torch.randn(8, dtype=torch.float64))
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    want = F.rms_norm(x, (8,), norm.weight, norm.eps)
    assert torch.allclose(norm(x), want, atol=1e-12)
    grad = torch.randn_like(x)
    got = torch.autograd.grad(norm(x), (x, norm.weight), grad)
    ref = torch.autograd.grad(want, (x, norm.weight), grad)
    assert all(torch.allclose(g, r, atol=1e-10) for g, r in zip(got, ref))
    assert torch.autograd.gradcheck(norm, (x,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rotate", [True, False], ids=["qk-norm-rope", "rms-norm"])
def test_cpu_kernels_equal_the_fp64_chain(rotate, dtype):
    """fp32 and bf16 on the CPU run teralm.kernels.norm: values and gradients within their
    rounding of the fp64 reference on the same (rounded) inputs, for a strided input (q of a
    fused qkv projection, as attention makes it) and a strided incoming gradient."""
    torch.manual_seed(2)
    B, H, T, D = 3, 4, 7, 16
    qkv = (torch.randn(B, T, 3 * H * D, dtype=torch.float64) * 3).to(dtype).double()
    x64 = qkv.view(B, T, 3, H, D).permute(2, 0, 3, 1, 4)[0].detach().requires_grad_()
    w64 = (1 + 0.3 * torch.randn(D, dtype=torch.float64)).float().double().requires_grad_()
    cos, sin = rope_tables(D, T, 10_000.0)
    x = x64.detach().to(dtype).permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    x.requires_grad_()
    w32 = w64.detach().float().requires_grad_()
    assert kernel_norm.fused(x, cos) and not x.is_contiguous()
    if rotate:
        got = NormRope.apply(x, w32, cos, sin, 1e-6)
        want = norm_then_rope(x64, w64, cos.double(), sin.double(), 1e-6)
    else:
        norm = RMSNorm(D)
        norm.weight.data.copy_(w32)
        w32 = norm.weight
        got, want = norm(x), F.rms_norm(x64, (D,), w64, 1e-6)
    assert got.dtype == dtype
    grad = torch.randn(B, H, D, T, dtype=torch.float64).to(dtype).double().transpose(-1, -2)
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7  # two of bf16's steps
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)
    got_grads = torch.autograd.grad(got, (x, w32), grad.to(dtype))
    want_grads = torch.autograd.grad(want, (x64, w64), grad)
    for g, r in zip(got_grads, want_grads):
        torch.testing.assert_close(g.double(), r, rtol=10 * tolerance, atol=10 * tolerance)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores to tell 1 thread from all")
def test_parallel_kernels_keep_torchs_thread_count():
    """A process told to use 1 thread (torchrun's OMP_NUM_THREADS=1) keeps 1 for torch and for
    the kernels' parallel loops once they have run: numba's OpenMP pool, when it starts, would
    set the shared runtime to one thread per core."""
    probe = (
        "import numba, torch\n"
        "from teralm.kernels.activation import relu_squared\n"
        "from teralm.kernels.norm import norm_rope\n"
        "relu_squared(torch.randn(1000))\n"
        "norm_rope(torch.randn(1, 2, 8, 16), torch.ones(16), 1e-6)\n"
        "print(torch.get_num_threads(), numba.get_num_threads())\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1"]
