"""The compact transformer with its index-feature input (``teralm.model``)."""

from teralm.model.config import ModelConfig
from teralm.model.transformer import Transformer

__all__ = ["ModelConfig", "Transformer"]
