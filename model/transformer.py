"""A decoder-only transformer fed, at every position, by the index's answer for its context.

RMSNorm, rotary positions, QK-norm, a ReLU² or SwiGLU MLP, tied embeddings, zero-initialised output
projections. The index input: the looked-up next token and the bucketed match length, each through
its own embedding, added to the token embedding through a learned per-channel gate that sees the
token and how long the match was (how far to trust it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from teralm.errors import InputError
from teralm.kernels import activation as activation_kernels
from teralm.kernels import norm as norm_kernels
from teralm.kernels.fp8 import Fp8Matmul, Int8Matmul
from teralm.model.config import PRECISIONS, ModelConfig
from teralm.model.kv_cache import KVCache, LayerCache


class Linear(nn.Module):
    """A bias-free linear layer whose matmul runs in the configured precision (fp32 master
    weights; ``fp8`` and ``int8`` quantise both operands, see teralm.kernels.fp8)."""

    def __init__(self, d_in: int, d_out: int, precision: str):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        nn.init.normal_(self.weight, std=d_in**-0.5)
        self.precision = precision

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.precision in ("fp32", "bf16"):
            return F.linear(x, self.weight)
        matmul = Fp8Matmul if self.precision == "fp8" else Int8Matmul
        device = x.device.type
        if torch.is_autocast_enabled(device):
            x = x.to(torch.get_autocast_dtype(device))
        with torch.autocast(device, enabled=False):  # the quantised matmul sets its own precision
            flat = matmul.apply(x.reshape(-1, x.shape[-1]), self.weight)
        return flat.reshape(*x.shape[:-1], -1)


MAX_COUNT = 1 << 24  # ∞-gram counts above this share the last bucket


def _normalised(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` over the RMS of its last dimension (accumulated in fp32 at least), and that scale."""
    wide = torch.promote_types(x.dtype, torch.float32)
    square = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=wide) ** 2
    scale = torch.rsqrt(square / x.shape[-1] + eps).to(x.dtype)
    return x * scale, scale


def _normalised_backward(g_scaled, n, scale, weight) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients at ``x`` and ``weight`` of ``_normalised(x) * weight``, from the one at
    its output (``n``, ``scale``: what ``_normalised`` gave)."""
    wide = torch.promote_types(n.dtype, torch.float32)
    g_weight = torch.sum(g_scaled * n, dim=tuple(range(n.dim() - 1)), dtype=wide)
    g_n = g_scaled * weight.to(n.dtype)
    g_x = scale * (g_n - n * (g_n * n).mean(-1, keepdim=True))
    return g_x, g_weight.to(weight.dtype)


class _RMSNormFunction(torch.autograd.Function):
    """``rms_norm(x) * weight`` with a written-out backward that saves the normalised input and
    its scale (PyTorch's CPU rms_norm is a chain of elementwise ops, each saved for autograd);
    fp32 on the CPU, one fused pass each way (teralm.kernels.norm)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        ctx.fused = norm_kernels.fused(x)
        if ctx.fused:
            rows = x.reshape(1, 1, -1, x.shape[-1])
            y, scale = norm_kernels.norm_rope(rows, weight, eps)
            ctx.save_for_backward(rows, scale, weight)
            return y.view(x.shape)
        n, scale = _normalised(x, eps)
        ctx.save_for_backward(n, scale, weight)
        return n * weight.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.fused:
            return (*_normalised_backward(grad, *ctx.saved_tensors), None)
        rows = ctx.saved_tensors[0]
        grad_x, grad_weight = norm_kernels.norm_rope_grads(
            grad.reshape(rows.shape), *ctx.saved_tensors
        )
        return grad_x.view(grad.shape), grad_weight, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps)


def length_bucket(length: torch.Tensor) -> torch.Tensor:
    """Match lengths to buckets: 0, 1, 2, 3 exactly, then two buckets per power of two
    (4-5, 6-7, 8-11, 12-15, 16-23, ...)."""
    length = length.long().clamp(min=0)
    msb = torch.floor(torch.log2(length.clamp(min=1).double())).long()
    half = (length >> (msb - 1).clamp(min=0)) & 1
    return torch.where(length < 4, length, 2 * msb + half)


@dataclass
class FollowerInput:
    """Counted answers at each position (``ModelConfig.index_followers``), from S sources: the
    index's most frequent followers of the context's last ``follower_cap`` tokens (and with
    ``follower_backoff``, of its last ``follower_backoff``), then with ``window_order`` the
    short window's: ``tokens`` [B, T, S, k] (``vocab_size`` where there are fewer) with their
    ``shares`` of the suffix's occurrences [B, T, S, k], the suffix's ``length`` [B, T, S] (0:
    none occurs) and occurrence count ``total`` [B, T, S]."""

    tokens: torch.Tensor
    shares: torch.Tensor
    length: torch.Tensor
    total: torch.Tensor


class IndexInput(nn.Module):
    """Adds the index's features to the token embedding through a learned gate: the stored
    follower and match length, and with ``index_followers`` the followers' embeddings weighted
    by their shares, beside their suffix's length and count."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        buckets = int(length_bucket(torch.tensor(cfg.max_match))) + 1
        self.next_embed = nn.Embedding(cfg.vocab_size + 1, cfg.d_model)  # + "nothing follows"
        self.length_embed = nn.Embedding(buckets, cfg.d_model)
        self.gate = nn.Linear(cfg.d_model, cfg.d_model)
        tables = [self.next_embed, self.length_embed]
        count_buckets = int(length_bucket(torch.tensor(MAX_COUNT))) + 1
        self.sources: list[tuple[nn.Embedding, nn.Embedding, nn.Embedding]] = []
        names = ["follower", "backoff"][: len(cfg.follower_caps)]
        if cfg.window_order:
            names.append("window")
        for name in names if cfg.index_followers else []:
            source = (
                nn.Embedding(cfg.vocab_size + 1, cfg.d_model),
                nn.Embedding(buckets, cfg.d_model),
                nn.Embedding(count_buckets, cfg.d_model),
            )
            for part, table in zip(("embed", "length", "count"), source):
                self.add_module(f"{name}_{part}", table)
            self.sources.append(source)
            tables += source
        for table in tables:
            nn.init.normal_(table.weight, std=0.02)
        nn.init.zeros_(self.gate.bias)
        nn.init.normal_(self.gate.weight, std=0.02)

    def forward(
        self,
        x: torch.Tensor,
        next_token: torch.Tensor,
        match_len: torch.Tensor,
        followers: FollowerInput | None = None,
    ):
        lengths = self.length_embed(length_bucket(match_len))
        features = self.next_embed(next_token) + lengths
        if followers is not None:
            summary, weighted = self.follower_parts(followers, x.dtype)
            features = features + weighted + summary
            lengths = lengths + summary
        gate = torch.sigmoid(self.gate(x + lengths))
        return x + gate * features

    def follower_parts(
        self, followers: FollowerInput, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What the followers add [..., d_model], summed over their sources: each suffix's
        length and count embedded (``summary``, which the gate also reads) and the followers'
        embeddings weighted by their shares (``weighted``)."""
        summary = weighted = 0
        for s, (embed, length_table, count_table) in enumerate(self.sources):
            counts = length_bucket(followers.total[..., s].clamp(max=MAX_COUNT))
            lengths = length_bucket(followers.length[..., s])
            summary = summary + length_table(lengths) + count_table(counts)
            shares = followers.shares[..., s, :].unsqueeze(-1).to(dtype)
            weighted = weighted + (shares * embed(followers.tokens[..., s, :])).sum(-2)
        return summary, weighted


def rope_tables(head_dim: int, length: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float64), inv)
    return angles.cos().float(), angles.sin().float()


class NormRope(torch.autograd.Function):
    """QK-norm then rotary positions, fused: ``x`` [B, H, T, D] RMS-normalised over its head
    vectors and scaled by ``weight`` [D], then each channel pair (``i``, ``i + D/2``) rotated by
    its position's angle (``cos``/``sin`` broadcast to [..., T, D/2]).

    The weight is folded into the rotation, the mean square is accumulated in fp32, and the
    backward is written out (the rotation's transpose, then RMSNorm's), saving only the
    normalised input and its scale: a third of the passes autograd makes over the chain."""

    @staticmethod
    def forward(ctx, x, weight, cos, sin, eps: float):
        ctx.fused = norm_kernels.fused(x, cos)
        if ctx.fused:  # fp32 on the CPU: one pass each way (teralm.kernels.norm)
            y, scale = norm_kernels.norm_rope(x, weight, eps, cos, sin)
            ctx.save_for_backward(x, scale, weight, cos, sin)
            return y
        half = x.shape[-1] // 2
        n, scale = _normalised(x, eps)
        w, cos, sin = weight.to(x.dtype), cos.to(x.dtype), sin.to(x.dtype)
        a, b = n[..., :half], n[..., half:]
        y = torch.empty_like(n)
        first, second = y[..., :half], y[..., half:]
        torch.mul(a, cos * w[:half], out=first).addcmul_(b, sin * w[half:], value=-1)
        torch.mul(a, sin * w[:half], out=second).addcmul_(b, cos * w[half:])
        ctx.save_for_backward(n, scale, weight, cos, sin)
        return y

    @staticmethod
    def backward(ctx, grad):
        if ctx.fused:
            return (*norm_kernels.norm_rope_grads(grad, *ctx.saved_tensors), None, None, None)
        n, scale, weight, cos, sin = ctx.saved_tensors
        half = n.shape[-1] // 2
        g1, g2 = grad[..., :half], grad[..., half:]
        g_scaled = torch.empty_like(n)  # the gradient at rms_norm(x) * weight
        torch.mul(g1, cos, out=g_scaled[..., :half]).addcmul_(g2, sin)
        torch.mul(g2, cos, out=g_scaled[..., half:]).addcmul_(g1, sin, value=-1)
        return (*_normalised_backward(g_scaled, n, scale, weight), None, None, None)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.d_model // cfg.n_head
        self.qkv = Linear(cfg.d_model, 3 * cfg.d_model, cfg.precision)
        self.proj = Linear(cfg.d_model, cfg.d_model, cfg.precision)
        nn.init.zeros_(self.proj.weight)
        self.q_norm = RMSNorm(self.head_dim)
        self.k_norm = RMSNorm(self.head_dim)
        self.window = cfg.window if cfg.windowed(layer) else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerCache | None = None
    ) -> torch.Tensor:
        """Causal self-attention over ``x`` [B, T, C], one sequence per row (training); with a
        ``cache``, the rows continue cached sequences (generation, see teralm.model.kv_cache)."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        q = NormRope.apply(q, self.q_norm.weight, cos, sin, self.q_norm.eps)
        k = NormRope.apply(k, self.k_norm.weight, cos, sin, self.k_norm.eps)
        if cache is not None:
            y = cache.attend(q, k, v, self.window)
        elif self.window is None or self.window >= T:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            i = torch.arange(T, device=x.device)
            band = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < self.window)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=band)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class ReLUSquared(torch.autograd.Function):
    """``relu(x)²`` whose backward is two products (autograd's own, through ``square``, runs a
    power and more passes over the MLP's widest activations); fp32 on the CPU, one fused pass
    each way that saves only the output (teralm.kernels.activation)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.fused = activation_kernels.fused(x)
        if ctx.fused:
            y = activation_kernels.relu_squared(x)
            ctx.save_for_backward(y)
            return y
        r = F.relu(x)
        ctx.save_for_backward(r)
        return r * r

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if ctx.fused:
            return activation_kernels.relu_squared_grad(grad, *ctx.saved_tensors)
        (r,) = ctx.saved_tensors
        return grad * (r + r)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden = int(cfg.mlp_ratio * cfg.d_model)
        if cfg.mlp == "swiglu":
            hidden = 2 * hidden // 3
        self.swiglu = cfg.mlp == "swiglu"
        self.up = Linear(cfg.d_model, 2 * hidden if self.swiglu else hidden, cfg.precision)
        self.down = Linear(hidden, cfg.d_model, cfg.precision)
        nn.init.zeros_(self.down.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.swiglu:
            gate, value = h.chunk(2, dim=-1)
            return self.down(F.silu(gate) * value)
        return self.down(ReLUSquared.apply(h))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerCache | None = None
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, cache)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """``forward(tokens, next_token, match_len)`` -> logits [B, T, vocab]; the features are the
    index's causal features at the same positions (ignored when ``index_input`` is off)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.precision not in PRECISIONS:
            raise ValueError(f"precision {cfg.precision!r}: resolve it first (choose_precision)")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.index_input = IndexInput(cfg) if cfg.index_input else None
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model)
        self.mixture_gate = self.count_bias = None
        if cfg.index_input and cfg.index_mixture:
            self.mixture_gate = nn.Linear(cfg.d_model, 1)  # logit of the model's own share
            self.count_bias = nn.Embedding(int(length_bucket(torch.tensor(MAX_COUNT))) + 1, 1)
            for p in (self.mixture_gate.weight, self.mixture_gate.bias, self.count_bias.weight):
                nn.init.zeros_(p)
        cos, sin = rope_tables(cfg.d_model // cfg.n_head, cfg.max_seq_len, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(
        self,
        tokens: torch.Tensor,
        next_token: torch.Tensor | None = None,
        match_len: torch.Tensor | None = None,
        with_gate: bool = False,
        infgram_total: torch.Tensor | None = None,
        followers: FollowerInput | None = None,
    ):
        """Logits [B, T, vocab]; with ``with_gate`` also the mixture gate's logits [B, T] (None
        when the model has no ∞-gram mixture), from the hidden state alone or, given the
        ∞-gram's ``infgram_total`` counts, whole (``gate_logit``). ``followers``: the index's
        fuller answer, for a model with ``index_followers``."""
        logits, gate = self.head(self.hidden(tokens, next_token, match_len, followers))
        if gate is not None and infgram_total is not None:
            gate = self.gate_logit(gate, infgram_total)
        return (logits, gate) if with_gate else logits

    def hidden(
        self,
        tokens: torch.Tensor,
        next_token: torch.Tensor | None = None,
        match_len: torch.Tensor | None = None,
        followers: FollowerInput | None = None,
    ) -> torch.Tensor:
        """The last block's output [B, T, d_model] (the final norm's input): what ``head``
        turns into logits, and the kNN datastore's key (teralm.index.knn)."""
        T = tokens.shape[1]
        if self.cfg.max_seq_len < T:
            raise InputError(
                f"sequence of {T} tokens is longer than max_seq_len {self.cfg.max_seq_len}"
            )
        x = self._embed(tokens, next_token, match_len, followers)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        for block in self.blocks:
            x = block(x, cos, sin)
        return x

    def decode(
        self,
        tokens: torch.Tensor,
        next_token: torch.Tensor,
        match_len: torch.Tensor,
        cache: KVCache,
        first: int = 0,
        followers: FollowerInput | None = None,
    ) -> torch.Tensor:
        """The hidden states [B, T, d_model] (see ``hidden``; ``head`` gives their logits) of
        ``tokens`` [B, T] that continue the sequences cached in slots ``first .. first + B - 1``;
        their keys and values are added to the cache."""
        B, T = tokens.shape
        layers = cache.layers(first, T, B)
        positions = layers[0].positions
        cos, sin = self.rope_cos[positions][:, None], self.rope_sin[positions][:, None]
        x = self._embed(tokens, next_token, match_len, followers)
        for block, layer in zip(self.blocks, layers):
            x = block(x, cos, sin, layer)
        cache.lengths[first : first + B] += T
        return x

    def gate_logit(self, gate: torch.Tensor, infgram_total: torch.Tensor) -> torch.Tensor:
        """The mixture gate's logit from the hidden state's part (``gate``, from ``forward``)
        and how many occurrences the ∞-gram counted (bucketed like match lengths)."""
        buckets = length_bucket(infgram_total.clamp(max=MAX_COUNT))
        return gate + self.count_bias(buckets).squeeze(-1).float()

    def _embed(self, tokens, next_token, match_len, followers=None) -> torch.Tensor:
        x = self.embed(tokens)
        if self.index_input is not None:
            if next_token is None or match_len is None:
                raise ValueError(
                    "this model was built with index input: pass next_token and match_len"
                )
            if (followers is None) != (self.cfg.index_followers == 0):
                raise ValueError(
                    "pass the index's followers exactly when the model has index_followers"
                )
            x = self.index_input(x, next_token, match_len, followers)
        return x

    def head(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits and the mixture gate's logits from the hidden state (None without a
        mixture)."""
        h = self.norm(x)
        gate = None if self.mixture_gate is None else self.mixture_gate(h).squeeze(-1).float()
        return F.linear(h, self.embed.weight), gate

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def mixture_logp(
    model_logp: torch.Tensor,
    gate: torch.Tensor | None,
    infgram_p: torch.Tensor,
    infgram_seen: torch.Tensor,
) -> torch.Tensor:
    """Log of ``sigmoid(gate) * p_model + sigmoid(-gate) * p_infgram``.

    ``model_logp`` and ``infgram_p`` are either whole distributions [..., vocab] or already
    gathered at the scored tokens [...]; ``gate`` and ``infgram_seen`` are [...]. Where there is
    no ∞-gram estimate (``infgram_seen`` false) or no gate, ``model_logp`` comes back."""
    if gate is None:
        return model_logp
    if model_logp.dim() > gate.dim():
        gate, infgram_seen = gate.unsqueeze(-1), infgram_seen.unsqueeze(-1)
    mixed = torch.logaddexp(
        F.logsigmoid(gate) + model_logp, F.logsigmoid(-gate) + torch.log(infgram_p)
    )
    return torch.where(infgram_seen, mixed, model_logp)


def index_lm_loss(
    logits: torch.Tensor,
    gate: torch.Tensor | None,
    targets: torch.Tensor,
    infgram_total: torch.Tensor,
    infgram_hits: torch.Tensor,
    reduce: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token negative log-likelihoods in nats (means, or per token without ``reduce``):
    of the model mixed with the ∞-gram (``hits / total`` for each target; the model alone
    without a gate), and of the model alone."""
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None])[..., 0]
    seen = infgram_total > 0
    p = infgram_hits.float() / infgram_total.clamp(min=1).float()
    mixed = -mixture_logp(logp, gate, p, seen)
    return (mixed.mean(), -logp.mean()) if reduce else (mixed, -logp)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy in nats, computed in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
