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
DROPOUT_FEATURES = ("self", "none")  # index-dropout fragments' features, teralm.train.data
ONEBIT_TARGETS = ("momentum", "gradient")  # what 1-bit messages carry: teralm.train.distributed
_NEW = object()  # a setting that runs have always had


def setting(default, doc: str, choices: tuple = (), resumable: bool = False, before=_NEW):
    """A training setting: its default and what it does (``doc``, the ``teralm train`` flag's
    help); ``choices``, the values it may take; ``resumable``, whether a resumed run may change
    it; ``before``, for a setting added later, the value that means "as runs trained before it"."""
    metadata = {"help": doc, "choices": choices, "resumable": resumable}
    if before is not _NEW:
        metadata["before"] = before
    return field(default=default, metadata=metadata)


@dataclass
class DataSettings:
    """Data: the fragments each step trains on"""

    batch_size: int = setting(16, "fragments per step: the global batch, split over the processes")
    seq_len: int = setting(256, "tokens per fragment")
    grad_accum: int = setting(1, "micro-batches per step, each of batch-size fragments")
    seed: int = setting(0, "seed of the initial weights and of the fragments drawn")
    holdout_every: int = setting(
        50, "documents whose id is a multiple of this are held out (never trained on)"
    )
    index_dropout: float = setting(
        0.5,
        "fraction of fragments shown as new text would be, without what the index knows of them",
        before=0.0,
    )
    dropout_features: str = setting(
        "self",
        "an index-dropout fragment's features and ∞-gram: made against its own earlier text "
        "alone (self), or none",
        DROPOUT_FEATURES,
        before="none",
    )

    def _check_data(self) -> None:
        for name in ("batch_size", "seq_len", "grad_accum", "holdout_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1")
        if not 0 <= self.index_dropout <= 1:
            raise ConfigError("index_dropout must be between 0 and 1")
        if self.dropout_features not in DROPOUT_FEATURES:
            raise ConfigError(f"dropout_features must be one of {', '.join(DROPOUT_FEATURES)}")


@dataclass
class ScheduleSettings:
    """Schedule: the run's length, learning rate and bookkeeping"""

    max_steps: int = setting(1000, "steps to train in all", resumable=True)
    max_minutes: float = setting(0.0, "stop after this many minutes (0: no limit)", resumable=True)
    lr: float = setting(3e-3, "peak learning rate")
    min_lr_ratio: float = setting(0.1, "cosine: the final learning rate, as a fraction of lr")
    warmup_steps: int = setting(50, "steps of linear warm-up")
    schedule: str = setting(
        "cosine",
        "cosine (warm-up, cosine decay to min-lr-ratio) or wsd (warm-up, constant, then linear "
        "decay over the last decay-fraction of the steps)",
        SCHEDULES,
    )
    decay_fraction: float = setting(0.2, "wsd: the fraction of the steps it decays over")
    grad_clip: float = setting(1.0, "clip the gradients' norm to this (0: no clipping)")
    own_loss_weight: float = setting(
        0.5,
        "with an ∞-gram mixture, the loss adds this times the model's own (unmixed) loss, so "
        "the model stays a good predictor where the ∞-gram is weak",
        before=0.0,
    )
    checkpoint_every: int = setting(200, "steps between checkpoints", resumable=True)
    log_every: int = setting(10, "steps between metrics records", resumable=True)
    compile: bool = setting(False, "torch.compile the model")

    def _check_schedule(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule must be one of {', '.join(SCHEDULES)}")
        if self.grad_clip < 0:
            raise ConfigError("grad_clip must be 0 (no clipping) or more")
        for name in ("max_steps", "checkpoint_every", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1")
        if not 0 <= self.own_loss_weight < float("inf"):
            raise ConfigError("own_loss_weight must be a finite number >= 0")


@dataclass
class OptimizerSettings:
    """Optimizer: AdamW or GaLore, and where its state lives"""

    optimizer: str = setting("adamw", "adamw, or GaLore's", OPTIMIZERS)
    weight_decay: float = setting(0.1, "AdamW's weight decay")
    beta1: float = setting(0.9, "AdamW's beta1")
    beta2: float = setting(0.95, "AdamW's beta2")
    galore_rank: float = setting(0.25, "GaLore: rank, or a fraction of the width")
    galore_gap: int = setting(200, "GaLore: steps between projections")
    galore_scale: float = setting(0.25, "GaLore: scale of the update")
    offload: str = setting("none", "optimizer state (and master weights) on the CPU", OFFLOADS)
    per_layer_update: bool = setting(
        False, "step each parameter inside the backward and free its gradient"
    )

    def _check_optimizer(self) -> None:
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
        if self.galore_rank <= 0 or self.galore_gap < 1:
            raise ConfigError("galore_rank must be above 0 and galore_gap at least 1")
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


@dataclass
class ExchangeSettings:
    """Gradient exchange: how torchrun's processes agree each step"""

    comm: str = setting(
        "allreduce", "the exchange (teralm.train.distributed): all-reduce, 1-bit, PowerSGD or DeMo",
        COMMS,
    )  # fmt: skip
    demo_chunk: int = setting(64, "DeMo: chunk size of the DCT")
    demo_topk: int = setting(32, "DeMo: components sent per chunk")
    demo_beta: float = setting(0.999, "DeMo: momentum")
    onebit_warmup: int = setting(50, "1-bit: steps of plain all-reduce first")
    onebit_block: int = setting(256, "1-bit: values sharing one scale")
    onebit_target: str = setting(
        "momentum",
        "1-bit: what the messages carry (momentum: AdamW's, its second moment frozen after the "
        "warm-up, 1-bit Adam's way)",
        ONEBIT_TARGETS,
        before="gradient",
    )
    powersgd_rank: int = setting(4, "PowerSGD: rank of its factors")
    powersgd_warmup: int = setting(10, "PowerSGD: steps of plain all-reduce first")

    def _check_exchange(self) -> None:
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


@dataclass
class DilocoSettings:
    """DiLoCo (--mode diloco): workers that train apart and meet seldom"""

    mode: str = setting("sync", "sync (torchrun data-parallel) or diloco", MODES)
    replicas: int = setting(1, "workers the global batch is split over")
    inner_steps: int = setting(50, "steps between rounds")
    outer_lr: float = setting(0.7, "outer SGD learning rate")
    outer_momentum: float = setting(0.9, "outer Nesterov momentum")
    outer_compress: str = setting("none", "pseudo-gradients sent as", OUTER_COMPRESSIONS)
    outer_async: float = setting(
        0.0,
        "0: synchronous rounds; S <= 0.5: apply the previous round's mean times S while the "
        "next round's exchange is in flight (TScale's async mode)",
    )
    min_replicas: int = setting(1, "live workers a round needs")

    def _check_diloco(self) -> None:
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
        if self.mode != "diloco":
            return
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


SETTING_GROUPS = (
    DataSettings,
    ScheduleSettings,
    OptimizerSettings,
    ExchangeSettings,
    DilocoSettings,
)


@dataclass
class TrainConfig(
    DilocoSettings, ExchangeSettings, OptimizerSettings, ScheduleSettings, DataSettings
):
    """How to train: the settings of every group in ``SETTING_GROUPS`` (saved and written in
    config files as one flat ``[train]`` table), each group checking its own."""

    def __post_init__(self) -> None:
        self._check_data()
        self._check_schedule()
        self._check_exchange()
        self._check_optimizer()
        self._check_diloco()


def settings_added_since() -> dict:
    """The training settings added after the first runs, with the value that means "as runs
    trained before them"."""
    return {f.name: f.metadata["before"] for f in fields(TrainConfig) if "before" in f.metadata}


def resumable_settings() -> set[str]:
    """The training settings a resumed run may change (its length and bookkeeping)."""
    return {f.name for f in fields(TrainConfig) if f.metadata["resumable"]}


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
        train = {**settings_added_since(), **data.get("train", {})}
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
    # 2 CPU cores, 10-15 minutes: a byte model that already uses its index input well, and
    # reads the counted answers of the index and of a short window (benchmarks/README.md)
    "tiny": {
        "model": {
            "n_layer": 4,
            "n_head": 4,
            "d_model": 256,
            "max_seq_len": 256,
            "index_followers": 4,
            "window_order": 3,
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
