"""What sampling, evaluation and serving share: loading, device and precision, the ∞-gram
mixture step, one sampler and the generation engine (``teralm.infer.*``)."""

from teralm.infer.precision import PrecisionChoice, choose_precision

__all__ = ["PrecisionChoice", "choose_precision"]
