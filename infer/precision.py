"""Choosing a model's arithmetic for the machine it runs on.

``auto`` is bf16 on a CUDA GPU, and fp32 on a CPU without native bf16 instructions (AVX512_BF16 or
AMX), where bf16 matmuls run several times slower than fp32. Native bf16 is not enough: on an
Intel Xeon (Emerald Rapids) whose virtual machine exposes AVX512_BF16 but not AMX, a bf16
training step of the tiny preset took 1.7 times as long as fp32, while on a Zen 4 EPYC bf16 was
the faster. So on such a CPU ``auto`` times a transformer MLP's forward and backward at the
model's width in both (``cpu_bf16_speedup``, a few tenths of a second) and takes bf16 only when
it is clearly faster. Generating on
the CPU, ``auto`` is fp32 on every CPU: a decode step of a few tokens is bound by per-op
dispatch, not by matmul throughput, and the fused fp32 kernel (teralm.kernels.decode) skips the
dispatch (tiny preset, one token on a Zen 4 with native bf16: 0.4 ms fused against 4 ms through
PyTorch in bf16). fp8 and int8 are explicit choices: fast with fp8 tensor cores, emulated (a
correctness path) elsewhere.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from functools import cache

import torch

from teralm.kernels.fp8 import has_fp8_matmul


@dataclass(frozen=True)
class PrecisionChoice:
    """The precision to run in, why, and a warning when it will be slow on this machine."""

    precision: str
    reason: str
    warning: str | None = None

    def to_dict(self) -> dict:
        return {"precision": self.precision, "reason": self.reason, "warning": self.warning}


def default_device() -> torch.device:
    """The GPU when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def inference_threads() -> int:
    """Threads for the model's CPU ops when generating: all cores but one, which is left to
    the index lookups and the HTTP server (on 2 cores, 1 thread decoded 25-40% faster than 2)."""
    return max(1, cores() - 1)


def autocast(device: torch.device, precision: str):
    """bf16 autocast for every precision but fp32 (fp8/int8 Linear layers quantise inside)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision != "fp32")


def cpu_native_bf16() -> tuple[bool, str]:
    """Whether this CPU has native bf16 instructions, and what torch reports about it."""
    capability = torch.backends.cpu.get_cpu_capability()
    probes = {"AVX512_BF16": "_is_avx512_bf16_supported", "AMX": "_is_amx_tile_supported"}
    native = [name for name, probe in probes.items() if getattr(torch.cpu, probe, lambda: False)()]
    if native:
        return True, f"CPU {capability} with native {' and '.join(native)}"
    return False, f"CPU {capability} without native bf16 (AVX512_BF16 or AMX)"


BF16_MARGIN = 1.1  # auto takes bf16 on a CPU only when measured this many times faster than fp32


@cache
def cpu_bf16_speedup(width: int) -> float:
    """How many times faster a forward and backward of a ReLU MLP of ``width`` channels (and four
    times as many inside, a transformer block's largest products) runs in bf16 autocast than in
    fp32 on this CPU: the best of three timings of each, on as many rows as keep a timing near
    0.1 s (2048 rows at width 256; widths past 1024 are timed at 1024)."""
    width = min(width, 1024)
    tokens = min(8192, max(64, (2048 * 256**2) // width**2))
    torch.manual_seed(0)
    x = torch.randn(tokens, width)
    up = torch.randn(4 * width, width, requires_grad=True)
    down = torch.randn(width, 4 * width, requires_grad=True)

    def best_time(dtype: torch.dtype) -> float:
        times = []
        for _ in range(4):  # the first is a warm-up
            began = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                y = torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, up)), down)
            y.float().sum().backward()
            times.append(time.perf_counter() - began)
        return min(times[1:])

    return best_time(torch.float32) / best_time(torch.bfloat16)


def choose_precision(
    requested: str, device: torch.device, generating: bool = False, width: int = 256
) -> PrecisionChoice:
    """Resolve ``requested`` (``auto`` or an explicit precision) for ``device``: for training and
    scoring a model ``width`` channels wide, or for ``generating`` (sample, serve)."""
    if device.type == "cuda":
        if requested == "auto":
            return PrecisionChoice("bf16", "CUDA GPU: bf16 (fp8 is an explicit choice)")
        if requested == "fp8" and not has_fp8_matmul(device):
            return PrecisionChoice(
                "fp8", "requested", "fp8 is emulated on this GPU (no fp8 tensor cores)"
            )
        return PrecisionChoice(requested, "requested")

    native, probe = cpu_native_bf16()
    if requested == "auto" and generating:
        return PrecisionChoice("fp32", f"generating on the CPU: the fused fp32 decoder ({probe})")
    if requested in ("auto", "bf16") and not native:
        slow = f"bf16 on a {probe} runs several times slower than fp32 (auto: fp32)"
        return PrecisionChoice("fp32", probe) if requested == "auto" else _requested(slow)
    if requested in ("auto", "bf16"):
        speedup = cpu_bf16_speedup(width)
        measured = f"{probe}; bf16 measured at {speedup:.2f}x fp32's speed (width {width})"
        if requested == "bf16":
            return _requested(None if speedup >= 1 else f"{measured}: auto would take fp32")
        return PrecisionChoice("bf16" if speedup >= BF16_MARGIN else "fp32", measured)
    if requested in ("fp8", "int8"):
        return PrecisionChoice(
            requested,
            "requested",
            f"{requested} on the CPU is an emulation: a check of the GPU numerics, not fast",
        )
    return PrecisionChoice(requested, "requested")


def _requested(warning: str | None) -> PrecisionChoice:
    return PrecisionChoice("bf16", "requested", warning)
