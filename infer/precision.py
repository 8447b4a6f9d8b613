"""Choosing a model's arithmetic for the machine it runs on.

``auto`` is bf16 on a CUDA GPU and on a CPU with native bf16 instructions (AVX512_BF16 or AMX),
and fp32 on any other CPU, where bf16 matmuls run several times slower than fp32. Generating on
the CPU, ``auto`` is fp32 on every CPU: a decode step of a few tokens is bound by per-op
dispatch, not by matmul throughput, and the fused fp32 kernel (teralm.kernels.decode) skips the
dispatch (tiny preset, one token on a Zen 4 with native bf16: 0.4 ms fused against 4 ms through
PyTorch in bf16). fp8 and int8 are explicit choices: fast with fp8 tensor cores, emulated (a
correctness path) elsewhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

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


def inference_threads() -> int:
    """Threads for the model's CPU ops when generating: all cores but one, which is left to
    the index lookups and the HTTP server (on 2 cores, 1 thread decoded 25-40% faster than 2)."""
    return max(1, (os.cpu_count() or 1) - 1)


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


def choose_precision(
    requested: str, device: torch.device, generating: bool = False
) -> PrecisionChoice:
    """Resolve ``requested`` (``auto`` or an explicit precision) for ``device``: for training and
    scoring, or for ``generating`` (sample, serve)."""
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
    if requested == "auto":
        return PrecisionChoice("bf16" if native else "fp32", probe)
    if requested == "bf16" and not native:
        return PrecisionChoice(
            "bf16",
            "requested",
            f"bf16 on a {probe} runs several times slower than fp32 (auto: fp32)",
        )
    if requested in ("fp8", "int8"):
        return PrecisionChoice(
            requested,
            "requested",
            f"{requested} on the CPU is an emulation: a check of the GPU numerics, not fast",
        )
    return PrecisionChoice(requested, "requested")
