"""Model hyperparameters."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from teralm.errors import ConfigError

PRECISIONS = ("fp32", "bf16", "fp8", "int8")
AUTO = "auto"  # a config's request: resolved for the machine by teralm.infer.choose_precision


@dataclass
class ModelConfig:
    """Shape and options of a Transformer.

    ``attention``: ``"full"`` everywhere, or ``"tscale"``: the first ``local_fraction`` of layers
    attend only to the last ``window`` positions and the rest alternate window and full width.
    ``index_input``: feed the index's causal features (looked-up next token, match length
    bucket) through a learned gate; off for ablations, with all else equal (it also turns off
    ``index_mixture``). ``index_mixture``: the output mixes the model's next-token distribution
    with the ∞-gram's, with a weight the model computes at every position.
    ``index_followers``: also feed the ``index_followers`` most frequent followers of the
    context's last ``follower_cap`` tokens in the index (with their shares, the suffix's length
    and its count), seeing only earlier text (``teralm.train.data.causal_followers``); 0: off,
    as every run before it. Generation counts every occurrence in the index
    (``teralm.infer.followers``). ``follower_backoff``: as many again at this shorter cap (the
    index backs off to it), as a further source; 0: none.
    ``window_order``: beside the index's followers, as many from a short-window model (PPM-style):
    those of the longest of the context's last ``window_order`` tokens that occurs earlier in
    its document, within its last ``window_tokens`` tokens (``teralm.kernels.window``); 0: off.
    ``precision``: arithmetic of every Linear layer in the blocks (see teralm.kernels.fp8), or
    ``auto`` in a config, which training resolves for the machine before it builds the model.
    """

    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 256
    mlp: str = "relu2"  # or "swiglu"
    mlp_ratio: float = 4.0
    max_seq_len: int = 1024
    rope_base: float = 10000.0
    attention: str = "full"  # or "tscale"
    window: int = 64
    local_fraction: float = 0.15
    index_input: bool = True
    index_mixture: bool = True
    max_match: int = 127
    index_followers: int = 0
    follower_cap: int = 8
    follower_backoff: int = 0
    window_order: int = 0
    window_tokens: int = 2048
    precision: str = "fp32"

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ConfigError(f"d_model {self.d_model} is not a multiple of n_head {self.n_head}")
        if self.mlp not in ("relu2", "swiglu"):
            raise ConfigError(f"mlp must be relu2 or swiglu, not {self.mlp!r}")
        if self.attention not in ("full", "tscale"):
            raise ConfigError(f"attention must be full or tscale, not {self.attention!r}")
        if self.index_followers < 0 or self.follower_cap < 1:
            raise ConfigError("index_followers must be 0 or more and follower_cap at least 1")
        if not 0 <= self.follower_backoff < self.follower_cap:
            raise ConfigError("follower_backoff must be 0 (none) or a cap below follower_cap")
        if self.index_followers and not self.index_input:
            raise ConfigError("index_followers is part of the index input: it needs index_input")
        if self.window_order < 0 or self.window_tokens < 1:
            raise ConfigError("window_order must be 0 or more and window_tokens at least 1")
        if self.window_order and not self.index_followers:
            raise ConfigError("window_order gives as many followers as index_followers: set both")
        if self.precision not in (*PRECISIONS, AUTO):
            raise ConfigError(f"precision must be one of {', '.join((*PRECISIONS, AUTO))}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelConfig:
        """Build from a dict; unknown keys are an error (a typo must not pass silently)."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"unknown model settings: {', '.join(unknown)}")
        return cls(**data)

    @property
    def follower_caps(self) -> tuple[int, ...]:
        """The context lengths the index's followers are counted at, longest first."""
        if self.follower_backoff:
            return (self.follower_cap, self.follower_backoff)
        return (self.follower_cap,)

    @property
    def follower_sources(self) -> int:
        """How many counted answers a position's followers come from: the index's at each of
        ``follower_caps``, and the short window's with ``window_order`` (0 without
        ``index_followers``)."""
        return (len(self.follower_caps) + (self.window_order > 0)) if self.index_followers else 0

    @property
    def follower_reach(self) -> int:
        """How many tokens up to a position its followers read."""
        return max(self.follower_cap, self.window_tokens if self.window_order else 0)

    def windowed(self, layer: int) -> bool:
        """Whether ``layer`` attends only to a short window."""
        if self.attention == "full":
            return False
        local = max(1, round(self.local_fraction * self.n_layer))
        return layer < local or (layer - local) % 2 == 0
