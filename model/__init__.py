"""The compact transformer with its index-feature input (``teralm.model``)."""

from teralm.model.config import ModelConfig

__all__ = ["ModelConfig", "Transformer"]


def __getattr__(name: str):
    # Transformer imports torch: only on first use, so the index commands start fast
    if name == "Transformer":
        from teralm.model.transformer import Transformer

        return Transformer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
