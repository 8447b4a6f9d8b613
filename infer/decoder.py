"""New tokens of cached sequences through the model: the fused CPU kernel (teralm.kernels.decode)
for small steps when it computes what the model does, else ``Transformer.decode``."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch
from numba.typed import List
from threadpoolctl import threadpool_limits

from teralm.errors import ConfigError, InputError
from teralm.infer.fp8 import Fp8Embedding, Fp8Linear
from teralm.infer.precision import cores
from teralm.kernels.decode import forward_rows
from teralm.model import Transformer
from teralm.model.kv_cache import KVCache
from teralm.model.transformer import FollowerInput

MAX_ROWS = 256  # past this many new tokens per call, the kernel's plain attention loops lose
PART_ROWS = 8  # the fewest rows worth a thread of their own
ROW_POSITIONS = 96  # a row's matrix products cost about as much as attending to this many keys
SHARE_STEP = 0.25  # how far one call's imbalance moves the calling thread's share


def fused_decode_fits(model: Transformer) -> bool:
    """Whether the kernel computes what ``model`` does: fp32 arithmetic on the CPU, with plain
    (not fp8-export) matrices."""
    return (
        model.cfg.precision == "fp32"
        and next(model.buffers()).device.type == "cpu"
        and not any(isinstance(m, (Fp8Linear, Fp8Embedding)) for m in model.modules())
    )


def _limit_blas_threads() -> None:
    """Run the BLAS that the kernel calls on as many threads as torch runs (one, beside the
    server, on a 2-core machine): left at its default it spins on every core."""
    import scipy.linalg.cython_blas  # noqa: F401  (loads the library numba's np.dot calls)

    threadpool_limits(torch.get_num_threads(), user_api="blas")


class Decoded(NamedTuple):
    """What ``Decoder.decode`` gives for its N rows: logits [N, vocab] (fp32), mixture gate
    logits [N] (None without a mixture) and, when asked for, the hidden states [N, d_model]
    that the kNN datastore is searched with."""

    logits: torch.Tensor
    gate: torch.Tensor | None
    hidden: torch.Tensor | None


def _rows(followers: FollowerInput | None, shape: Callable) -> FollowerInput | None:
    """``followers`` with ``shape`` applied to each of its tensors (None stays None)."""
    return None if followers is None else FollowerInput(*map(shape, vars(followers).values()))


def _array(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()  # shares memory with the tensor


def _empty(*shape: int) -> np.ndarray:
    return np.zeros(shape, dtype=np.float32)


class Decoder:
    """``decode`` runs new tokens of the sequences cached in consecutive slots of ``cache``:
    ``counts[b]`` tokens for slot ``first + b``, flattened in slot order. Calls of up to
    ``MAX_ROWS`` tokens go through the kernel when ``fused`` (default: when it fits the
    model), reading the parameters and the cache in place; the others through the model.

    The kernel runs without the GIL, so a call of many rows is split, at sequence boundaries,
    into parts run at once on up to ``threads`` threads (default: one per core; the sequences'
    caches are apart, so the parts share nothing they write). The calling thread runs the
    first part and then the call's ``alongside`` work; its share of the rows is tuned from
    call to call so that it finishes when the other threads do (waking a thread costs a few
    hundred microseconds on some machines)."""

    def __init__(
        self,
        model: Transformer,
        cache: KVCache,
        fused: bool | None = None,
        threads: int | None = None,
    ):
        self.model, self.cache = model, cache
        self.fused = fused_decode_fits(model) if fused is None else fused
        if self.fused and not fused_decode_fits(model):
            raise ConfigError("the fused decoder runs fp32 models on the CPU only")
        self.threads = threads or cores()
        self._pool = None
        self._share = 1 / self.threads  # of a split call's cost, for the calling thread
        if self.fused:
            self._args = self._kernel_arguments()
            _limit_blas_threads()
            if self.threads > 1:
                self._pool = ThreadPoolExecutor(self.threads - 1, "teralm-decode")

    def decode(
        self,
        tokens: list[int],
        next_token: list[int],
        match_len: list[int],
        counts: list[int],
        first: int = 0,
        keep_hidden: bool = False,
        alongside: Callable[[], None] | None = None,
        followers: FollowerInput | None = None,
    ) -> Decoded:
        """The ``N = sum(counts)`` tokens through the model, their keys and values added to the
        cache (InputError when a sequence would pass ``max_seq_len``). ``alongside`` (work
        that needs no output of the model, called once) runs on this thread while the
        kernel's other parts run on theirs. ``followers``: the rows' [N, ...] index followers,
        for a model with ``index_followers``."""
        B = len(counts)
        start = self.cache.lengths.numpy()[first : first + B]  # a view of the cache's lengths
        if int((start + np.asarray(counts)).max()) > self.cache.max_len:
            raise InputError(f"positions beyond max_seq_len {self.cache.max_len}")
        if self.fused and sum(counts) <= MAX_ROWS:
            rows = (tokens, next_token, match_len, counts, first, start, followers)
            return self._fused(*rows, keep_hidden, alongside or (lambda: None))
        device = self.cache.keys[0].device
        columns = [torch.tensor(xs, device=device) for xs in (tokens, next_token, match_len)]
        followers = _rows(followers, lambda t: t.to(device))
        if len(set(counts)) == 1:  # one batched call
            calls = [(first, slice(None), B)]
        else:  # a call per sequence
            ends = np.cumsum(counts).tolist()
            calls = [(first + b, slice(e - n, e), 1) for b, (n, e) in enumerate(zip(counts, ends))]
        parts = []
        for slot, rows, batch in calls:
            take = lambda t, rows=rows, batch=batch: t[rows].reshape(batch, -1, *t.shape[1:])  # noqa: E731
            inputs = (*map(take, columns), self.cache, slot, _rows(followers, take))
            parts.append(self.model.decode(*inputs))
        hidden = parts[0] if len(parts) == 1 else torch.cat([part[0] for part in parts])[None]
        logits, gate = self.model.head(hidden)
        if alongside is not None:
            alongside()
        return Decoded(
            logits.flatten(0, 1).float(),
            None if gate is None else gate.flatten(),
            hidden.flatten(0, 1).float() if keep_hidden else None,
        )

    def _fused(
        self, tokens, next_token, match_len, counts, first, start, followers, keep_hidden, alongside
    ):
        """The kernel on the rows; ``start``: the slots' cache lengths (a view, advanced)."""
        n, counts = sum(counts), np.asarray(counts)
        sequence = np.repeat(np.arange(len(counts)), counts)  # of each row
        positions = start[sequence] + np.arange(n) - (np.cumsum(counts) - counts)[sequence]
        d = self.model.cfg.d_model
        logits = np.empty((n, self.model.cfg.vocab_size), dtype=np.float32)
        gate = np.empty(n, dtype=np.float32)
        hidden = _empty(n if keep_hidden else 0, d)
        columns = [np.asarray(xs, dtype=np.int64) for xs in (tokens, next_token, match_len)]
        columns += [first + sequence, positions]
        if followers is None:
            columns += [_empty(0, d), _empty(0, d)]
        else:
            with torch.no_grad():
                parts = self.model.index_input.follower_parts(followers, torch.float32)
            columns += [part.numpy() for part in parts]

        def run(rows: slice) -> float:
            forward_rows(
                *(c[rows] for c in columns), **self._args, logits=logits[rows], gate=gate[rows],
                hidden_out=hidden[rows] if keep_hidden else hidden,
            )  # fmt: skip
            return time.perf_counter()

        began = time.perf_counter()
        parts = self._parts(counts, positions)
        running = [self._pool.submit(run, rows) for rows in parts[1:]]
        run(parts[0])
        try:
            alongside()
        finally:  # the other parts write into this call's arrays and the cache
            mine, theirs = time.perf_counter(), [part.result() for part in running]
        if theirs:
            self._balance(began, mine, max(theirs))
        start += counts
        has_gate = self.model.mixture_gate is not None
        return Decoded(
            torch.from_numpy(logits),
            torch.from_numpy(gate) if has_gate else None,
            torch.from_numpy(hidden) if keep_hidden else None,
        )

    def close(self) -> None:
        """Let the kernel's threads go."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def _parts(self, counts: np.ndarray, positions: np.ndarray) -> list[slice]:
        """The rows in consecutive parts of whole sequences, one per thread: the first of
        ``_share`` of the cost (a row costs ``ROW_POSITIONS`` plus its position), the others
        of equal shares of the rest; one part for few rows."""
        parts = min(self.threads, len(counts), len(positions) // PART_ROWS)
        if parts <= 1:
            return [slice(None)]
        ends = np.cumsum(counts)
        cost = np.cumsum(positions + ROW_POSITIONS)[ends - 1]  # up to each sequence's end
        shares = self._share + (1 - self._share) * np.arange(parts - 1) / (parts - 1)
        cuts = np.searchsorted(cost, cost[-1] * shares)
        bounds = [0, *np.unique(ends[cuts]).tolist()]
        bounds = [b for b in bounds if b < len(positions)] + [len(positions)]
        return [slice(a, b) for a, b in zip(bounds, bounds[1:])]

    def _balance(self, began: float, mine: float, theirs: float) -> None:
        """Move the calling thread's share towards the point where it and the other threads
        (done at ``mine`` and ``theirs``) finish together."""
        wait = (theirs - mine) / max(max(mine, theirs) - began, 1e-9)  # > 0: this thread waited
        self._share = min(max(self._share + SHARE_STEP * wait, 0.1), 0.9)

    def _kernel_arguments(self) -> dict:
        """The kernel's view of the model and the cache: arrays sharing their memory."""
        model, cfg = self.model, self.model.cfg
        blocks, d = model.blocks, cfg.d_model
        per_layer = lambda get: List([_array(get(b)) for b in blocks])  # noqa: E731
        index, mix = model.index_input, model.mixture_gate
        return dict(
            embed=_array(model.embed.weight),
            next_embed=_array(index.next_embed.weight) if index else _empty(0, d),
            length_embed=_array(index.length_embed.weight) if index else _empty(0, d),
            gate_w=_array(index.gate.weight) if index else _empty(0, d),
            gate_b=_array(index.gate.bias) if index else _empty(0),
            attn_norm=per_layer(lambda b: b.attn_norm.weight),
            qkv_w=per_layer(lambda b: b.attn.qkv.weight),
            q_norm=per_layer(lambda b: b.attn.q_norm.weight),
            k_norm=per_layer(lambda b: b.attn.k_norm.weight),
            proj_w=per_layer(lambda b: b.attn.proj.weight),
            mlp_norm=per_layer(lambda b: b.mlp_norm.weight),
            up_w=per_layer(lambda b: b.mlp.up.weight),
            down_w=per_layer(lambda b: b.mlp.down.weight),
            windows=np.array([cfg.window if cfg.windowed(i) else 0 for i in range(cfg.n_layer)]),
            norm=_array(model.norm.weight),
            mix_w=_array(mix.weight) if mix is not None else _empty(0, d),
            mix_b=_array(mix.bias) if mix is not None else _empty(1),
            cos=_array(model.rope_cos),
            sin=_array(model.rope_sin),
            keys=List(map(_array, self.cache.keys)),
            values=List(map(_array, self.cache.values)),
            swiglu=cfg.mlp == "swiglu",
        )
