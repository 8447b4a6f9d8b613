"""Serving an fp8 export as stored: every matrix stays e4m3 (one byte per parameter) in memory.

On a GPU with fp8 tensor cores a linear layer feeds its stored weight and scale to
``torch._scaled_mm`` (activations quantised per call, as in fp8 training). Elsewhere each layer
dequantises its weight when it runs, so only one layer's matrix is ever held in full precision.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from teralm.errors import CheckpointError
from teralm.kernels.fp8 import E4M3, has_fp8_matmul, quantize_fp8, scaled_mm
from teralm.model.transformer import Linear


class Fp8Linear(nn.Module):
    """A linear layer whose weight is kept in e4m3 with its scale (``weight = q / scale``)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("q", q)
        self.register_buffer("scale", scale.float())
        self.register_buffer("bias", bias)

    @property
    def weight(self) -> torch.Tensor:
        """The weight in fp32, made for this use and not kept."""
        return self.q.float() / self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if has_fp8_matmul(x.device) and self.scale.numel() == 1:
            xq, xs = quantize_fp8(x.reshape(-1, x.shape[-1]), E4M3)
            y = scaled_mm(xq, xs, self.q, self.scale, x.dtype).reshape(*x.shape[:-1], -1)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)


class Fp8Embedding(nn.Module):
    """An embedding table kept in e4m3 with one scale per row (or one for the table)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("q", q)
        self.register_buffer("scale", scale.float().reshape(-1, 1).expand(q.shape[0], 1))

    @property
    def weight(self) -> torch.Tensor:
        """The table in fp32 (for a tied output head), made for this use and not kept."""
        return self.q.float() / self.scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.q[ids].float() / self.scale[ids]


def load_fp8(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Give ``model`` an fp8 export's tensors: its linear layers and embeddings become their
    fp8 twins holding the stored e4m3 values; everything else is loaded as usual. CheckpointError
    when the export does not fit the model."""
    tensors, twins = dict(tensors), set()
    try:
        for name, module in list(model.named_modules()):
            if isinstance(module, (Linear, nn.Linear, nn.Embedding)):
                q, scale = tensors.pop(f"{name}.weight"), tensors.pop(f"{name}.weight.scale")
                if q.dtype != E4M3 or q.shape != module.weight.shape:
                    raise CheckpointError(f"{name}.weight is {q.dtype} {tuple(q.shape)}")
                if isinstance(module, nn.Embedding):
                    twin = Fp8Embedding(q, scale)
                else:
                    twin = Fp8Linear(q, scale, tensors.pop(f"{name}.bias", None))
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent), attr, twin)
                twins.update(f"{name}.{key}" for key in twin.state_dict())
        result = model.load_state_dict(tensors, strict=False, assign=True)
    except (KeyError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"the fp8 export does not fit its model config: {e}") from None
    wrong = sorted(set(result.missing_keys) - twins) + result.unexpected_keys
    if wrong:
        raise CheckpointError(
            f"the fp8 export does not fit its model config: {', '.join(wrong[:3])}"
        )
