"""Training settings, presets and TOML config files."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import tomllib

from teralm.errors import ConfigError
from teralm.model.config import ModelConfig

SCHEDULES = ("cosine", "wsd")
COMMS = ("allreduce", "onebit", "powersgd", "demo")  # gradient exchanges: train.distributed
OPTIMIZERS = ("adamw", "galore", "galore8bit")  # see teralm.train.optim
OFFLOADS = ("none", "optimizer", "optimizer+master")  # see teralm.train.offload
MODES = ("sync", "diloco")  # data-parallel under torchrun, or teralm.train.diloco
OUTER_COMPRESSIONS = ("none", "onebit", "demo")  # DiLoCo's pseudo-gradients, teralm.train.diloco
DROPOUT_FEATURES = ("self", "none")
ONEBIT_TARGETS = (
    "momentum",
    "gradient",
)  # what 1-bit messages carry: teralm.train.distributed  # index-dropout fragments' features, teralm.train.data
# training settings added later, with the value that means "as runs trained before them"
ADDED_SINCE = {
    "own_loss_weight": 0.0,
    "index_dropout": 0.0,
    "dropout_features": "none",
    "onebit_target": "gradient",
}


@dataclass
class TrainConfig:
    """How to train: batch shape, optimizer, schedule, length and bookkeeping.

    ``schedule``: ``cosine`` (linear warmup, cosine decay to ``min_lr_ratio``) or ``wsd``
    (warmup, constant, then linear decay over the last ``decay_fraction`` of the steps).
    ``holdout_every``: documents whose id is a multiple of it are held out (never trained on).
    ``own_loss_weight``: with an ∞-gram mixture, the loss adds this times the model's own
    (unmixed) loss, so the model stays a good predictor where the ∞-gram is weak or silent
    instead of learning only what the ∞-gram misses. ``index_dropout``: the fraction of
    training fragments shown as new text would be: ``dropout_features = "self"``, with features
    and ∞-gram made against the fragment's own earlier text alone; ``"none"``, with neither.
    ``batch_size`` is the global batch: with ``torchrun``, each of the W processes takes
    ``batch_size / W`` fragments. ``comm``: how the processes agree each step (see
    teralm.train.distributed); ``demo_*``: DeMo's chunk size, components kept per chunk and
    momentum; ``onebit_warmup``: steps of plain all-reduce before 1-bit messages,
    ``onebit_block``: values sharing one scale in them, ``onebit_target``: what they carry
    (AdamW's momentum with its second moment frozen after the warm-up, or the gradients); ``powersgd_*``: PowerSGD's matrix rank and the steps of plain all-reduce before it
    starts compressing.
    ``mode = "diloco"`` trains ``replicas`` workers apart (teralm.train.diloco), each on
    ``batch_size / replicas`` fragments a step, meeting every ``inner_steps`` steps: the
    pseudo-gradients' mean (sent as ``outer_compress`` says) steps the global weights by SGD with
    Nesterov momentum (``outer_lr``, ``outer_momentum``), or, with ``outer_async`` = s > 0,
    by ``s`` times the previous round's mean; a round needs ``min_replicas`` live workers.
    """

    batch_size: int = 16
    seq_len: int = 256
    grad_accum: int = 1
    max_steps: int = 1000
    max_minutes: float = 0.0  # 0: no time limit
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    warmup_steps: int = 50
    schedule: str = "cosine"
    decay_fraction: float = 0.2
    grad_clip: float = 1.0
    checkpoint_every: int = 200
    log_every: int = 10
    compile: bool = False
    seed: int = 0
    holdout_every: int = 50
    own_loss_weight: float = 0.5
    index_dropout: float = 0.5
    dropout_features: str = "self"
    comm: str = "allreduce"
    demo_chunk: int = 64
    demo_topk: int = 32
    demo_beta: float = 0.999
    onebit_warmup: int = 50
    onebit_block: int = 256
    onebit_target: str = "momentum"
    mode: str = "sync"
    inner_steps: int = 50
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_compress: str = "none"
    outer_async: float = 0.0
    replicas: int = 1
    min_replicas: int = 1
    powersgd_rank: int = 4
    powersgd_warmup: int = 10
    optimizer: str = "adamw"
    galore_rank: float = 0.25
    galore_gap: int = 200
    galore_scale: float = 0.25
    offload: str = "none"
    per_layer_update: bool = False

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule must be one of {', '.join(SCHEDULES)}")
        self._check_exchange()
        self._check_optimizer()
        self._check_diloco()
        self._check_steps()

    def _check_exchange(self) -> None:
        """The gradient exchange's settings (comm, DeMo, 1-bit, PowerSGD)."""
        if self.comm not in COMMS:
            raise ConfigError(f"comm must be one of {', '.join(COMMS)}, not {self.comm!r}")
        if self.demo_chunk < 1 or self.demo_topk < 1:
            raise ConfigError("demo_chunk and demo_topk must be at least 1")
        if not 0 <= self.demo_beta < 1:
            raise ConfigError("demo_beta must be in [0, 1)")
        if self.onebit_warmup < 0 or self.onebit_block < 8 or self.onebit_block % 8:
            raise ConfigError("onebit_warmup must be 0 or more, onebit_block a multiple of 8")
        if self.onebit_target not in ONEBIT_TARGETS:
            raise ConfigError(f"onebit_target must be one of {', '.join(ONEBIT_TARGETS)}")
        if self.comm == "onebit" and self.onebit_target == "momentum":
            if self.onebit_warmup < 1:
                raise ConfigError(
                    "onebit_target momentum freezes AdamW's second moment at the end of the "
                    "warm-up: onebit_warmup must be at least 1"
                )
            if self.optimizer != "adamw" or self.offload != "none" or self.per_layer_update:
                raise ConfigError(
                    "onebit_target momentum is an AdamW of its own: use optimizer adamw, "
                    "offload none and no per-layer updates (or onebit_target gradient)"
                )
        if self.powersgd_rank < 1 or self.powersgd_warmup < 2:
            raise ConfigError("powersgd_rank must be at least 1 and powersgd_warmup at least 2")

    def _check_optimizer(self) -> None:
        """The optimizer and where its state lives, against the exchange."""
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer must be one of {', '.join(OPTIMIZERS)}")
        if self.optimizer != "adamw" and self.comm == "demo":
            raise ConfigError(
                f"comm demo is an optimizer of its own; optimizer {self.optimizer} needs another "
                "comm (allreduce, onebit or powersgd)"
            )
        if self.offload not in OFFLOADS:
            raise ConfigError(f"offload must be one of {', '.join(OFFLOADS)}")
        if self.offload != "none" and self.comm == "demo":
            raise ConfigError("comm demo exchanges its momentum on the device: use offload none")

    def _check_diloco(self) -> None:
        """The mode, and DiLoCo's outer loop."""
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.outer_compress not in OUTER_COMPRESSIONS:
            raise ConfigError(f"outer_compress must be one of {', '.join(OUTER_COMPRESSIONS)}")
        if not 0 <= self.outer_async <= 0.5:
            raise ConfigError("outer_async must be 0 (synchronous rounds) or a scale up to 0.5")
        if self.outer_lr <= 0 or not 0 <= self.outer_momentum < 1:
            raise ConfigError("outer_lr must be above 0 and outer_momentum in [0, 1)")
        if min(self.inner_steps, self.replicas, self.min_replicas) < 1:
            raise ConfigError("inner_steps, replicas and min_replicas must be at least 1")
        if self.mode == "diloco":
            if self.comm != "allreduce":
                raise ConfigError(
                    "mode diloco exchanges pseudo-gradients (outer_compress), not gradients: "
                    "leave comm at allreduce"
                )
            if self.batch_size % self.replicas:
                raise ConfigError(
                    f"batch_size {self.batch_size} (the global batch) is not a multiple of the "
                    f"{self.replicas} replicas"
                )
            if self.checkpoint_every % self.inner_steps:
                raise ConfigError(
                    f"checkpoint_every {self.checkpoint_every} must be a multiple of inner_steps "
                    f"{self.inner_steps} (checkpoints are taken when the workers agree)"
                )

    def _check_steps(self) -> None:
        """The step itself: clipping, per-layer updates, GaLore, sizes, index dropout."""
        if self.grad_clip < 0:
            raise ConfigError("grad_clip must be 0 (no clipping) or more")
        if self.per_layer_update and (
            self.grad_accum != 1
            or self.grad_clip
            or self.comm != "allreduce"
            or self.offload != "none"
        ):
            raise ConfigError(
                "per_layer_update steps each parameter during the backward, before the whole "
                "gradient exists: it needs grad_accum 1, grad_clip 0, comm allreduce on one "
                "process and offload none"
            )
        if self.galore_rank <= 0 or self.galore_gap < 1:
            raise ConfigError("galore_rank must be above 0 and galore_gap at least 1")
        for name in (
            "batch_size",
            "seq_len",
            "grad_accum",
            "max_steps",
            "holdout_every",
            "checkpoint_every",
            "log_every",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1")
        if not 0 <= self.own_loss_weight < float("inf"):
            raise ConfigError("own_loss_weight must be a finite number >= 0")
        if not 0 <= self.index_dropout <= 1:
            raise ConfigError("index_dropout must be between 0 and 1")
        if self.dropout_features not in DROPOUT_FEATURES:
            raise ConfigError(f"dropout_features must be one of {', '.join(DROPOUT_FEATURES)}")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict:
        return {"model": self.model.to_dict(), "train": asdict(self.train)}

    @classmethod
    def from_saved(cls, data: dict) -> RunConfig:
        """A run's saved config. A setting added after the run was saved takes the value that
        reproduces how the run trained, not today's default."""
        check_shape(data)
        train = {**ADDED_SINCE, **data.get("train", {})}
        return cls.from_dict({**data, "train": train})

    @classmethod
    def from_dict(cls, data: dict) -> RunConfig:
        """Settings from ``{"model": {...}, "train": {...}}``; ConfigError for unknown names and
        values of the wrong type."""
        check_shape(data)
        names = {f.name for f in fields(TrainConfig)}
        train = data.get("train", {})
        bad = sorted(set(train) - names)
        if bad:
            raise ConfigError(f"unknown train settings: {', '.join(bad)}")
        model = data.get("model", {})
        check_types("model", ModelConfig, model)
        check_types("train", TrainConfig, train)
        return cls(ModelConfig.from_dict(model), TrainConfig(**train))


def check_shape(data) -> None:
    """A config is a table of a ``model`` and a ``train`` table."""
    if not isinstance(data, dict):
        raise ConfigError("a config must be a table with [model] and [train] tables")
    unknown = sorted(set(data) - {"model", "train"})
    if unknown:
        raise ConfigError(f"unknown config sections: {', '.join(unknown)}")
    for section in ("model", "train"):
        if not isinstance(data.get(section, {}), dict):
            raise ConfigError(f"[{section}] must be a table of settings")


def check_types(section: str, cls: type, values: dict) -> None:
    """Each known setting has the type of its default (an int where a float is expected is fine)."""
    for f in fields(cls):
        if f.name not in values:
            continue
        value, kind = values[f.name], type(f.default)
        allowed = (int, float) if kind is float else kind
        if not isinstance(value, allowed) or (kind is not bool and isinstance(value, bool)):
            raise ConfigError(f"{section}.{f.name} must be {kind.__name__}, not {value!r}")


PRESETS: dict[str, dict] = {
    # 2 CPU cores, 10-15 minutes: a byte model that already uses its index input well
    "tiny": {
        "model": {
            "n_layer": 4,
            "n_head": 4,
            "d_model": 256,
            "max_seq_len": 256,
            "precision": "auto",
        },
        "train": {
            "batch_size": 16,
            "seq_len": 256,
            "max_steps": 800,
            "lr": 3e-3,
            "warmup_steps": 50,
            "checkpoint_every": 100,
        },
    },
    # GPU presets with TScale-like shapes
    "125m": {
        "model": {
            "n_layer": 12,
            "n_head": 12,
            "d_model": 768,
            "max_seq_len": 1024,
            "attention": "tscale",
            "window": 128,
            "precision": "fp8",
        },
        "train": {
            "batch_size": 32,
            "seq_len": 1024,
            "max_steps": 20000,
            "lr": 1.5e-3,
            "warmup_steps": 500,
            "schedule": "wsd",
            "checkpoint_every": 1000,
            "compile": True,
        },
    },
    "1.5b": {
        "model": {
            "n_layer": 24,
            "n_head": 16,
            "d_model": 2048,
            "max_seq_len": 1024,
            "attention": "tscale",
            "window": 128,
            "mlp": "swiglu",
            "precision": "fp8",
        },
        "train": {
            "batch_size": 16,
            "seq_len": 1024,
            "grad_accum": 4,
            "max_steps": 50000,
            "lr": 6e-4,
            "warmup_steps": 1000,
            "schedule": "wsd",
            "checkpoint_every": 1000,
            "compile": True,
        },
    },
}


def load_config(preset: str | None, path: Path | None) -> RunConfig:
    """A preset's settings, or a TOML file's (``[model]`` and ``[train]`` tables)."""
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read config {path}: {e}") from None
        return RunConfig.from_dict(data)
    name = preset or "tiny"
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return RunConfig.from_dict(PRESETS[name])
