"""What sampling, evaluation and serving share: device and precision choice."""

from teralm.infer.precision import PrecisionChoice, choose_precision

__all__ = ["PrecisionChoice", "choose_precision"]
