"""``teralm train``: the training loop with index features, checkpoints and resume."""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from teralm.index import Index
from teralm.index import format as fmt
from teralm.infer.precision import autocast, choose_precision, default_device
from teralm.model import Transformer, checkpoint
from teralm.model.transformer import index_lm_loss
from teralm.train.config import RunConfig, TrainConfig
from teralm.train.data import FragmentSampler, prefetched

METRICS = "metrics.jsonl"
RUN_CONFIG = "config.json"
# settings that may change when a run is resumed (its length); anything else must match
RESUMABLE_CHANGES = {"max_steps", "max_minutes", "checkpoint_every", "log_every"}


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for reuse (True where it could be set).

    By default it returns large blocks to the system on free and maps them afresh on the next
    allocation, so every step page-faults its activations in anew: 5-10% of a tiny-preset
    step here. Blocks up to 32 MiB now come from the heap, which is trimmed only past 1 GiB
    free."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(mallopt(M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(M_TRIM_THRESHOLD, 1 << 30))


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Warmup, then cosine decay to ``min_lr_ratio`` or warmup-stable-decay (WSD)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "wsd":
        decay_start = int(cfg.max_steps * (1 - cfg.decay_fraction))
        if step < decay_start:
            return cfg.lr
        frac = (step - decay_start) / max(1, cfg.max_steps - decay_start)
        return cfg.lr - (cfg.lr - floor) * min(frac, 1.0)
    frac = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW, fused (one kernel for all parameters, on the CPU too); matrices decay, vectors
    (norm weights, biases) do not."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=True)


@dataclass
class TrainResult:
    steps: int
    final_loss: float
    tokens: int
    wall_s: float
    stopped: str  # "max_steps" or "max_minutes"
    parameters: int


def check_resumable(saved: dict, config: RunConfig, identity: dict) -> None:
    """Refuse to resume a run whose model, training settings or index differ."""
    old = RunConfig.from_saved(saved["config"])
    if old.model != config.model:
        diff = [
            f"{k}: {v!r} -> {config.model.to_dict()[k]!r}"
            for k, v in old.model.to_dict().items()
            if config.model.to_dict()[k] != v
        ]
        raise ValueError("the run was trained with another model config (" + ", ".join(diff) + ")")
    new_train = asdict(config.train)
    changed = [k for k, v in asdict(old.train).items() if new_train[k] != v]
    if set(changed) - RESUMABLE_CHANGES:
        raise ValueError(
            "the run was trained with other settings: "
            + ", ".join(sorted(set(changed) - RESUMABLE_CHANGES))
        )
    for key in ("tokenizer", "tokenizer_sha256", "vocab_size", "num_tokens"):
        if saved["index"].get(key) != identity[key]:
            raise ValueError(f"the run was trained on another index ({key} differs)")


def _step_loss(micro_losses: list[torch.Tensor]) -> float:
    """A step's mean loss over its micro-batches, as a float."""
    total = 0.0
    for loss in micro_losses:
        total += loss.item() / len(micro_losses)
    return total


def _metric_step(line: str) -> int | None:
    """The step of a ``metrics.jsonl`` line, or None when it is not a metrics record."""
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def _truncate_metrics(path: Path, step: int) -> None:
    """Keep the metric lines of steps up to ``step`` (a resumed run redoes the rest)."""
    if not path.exists():
        return
    kept = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        line_step = _metric_step(line)
        if line_step is None:
            raise ValueError(
                f"{path} line {number} is not a metrics record; delete that line and resume"
            )
        if line_step <= step:
            kept.append(line + "\n")
    fmt.write_atomic(path, "".join(kept).encode())


def saved_config(run: Path) -> RunConfig:
    """The config a run was started with (``RUN/config.json``); ValueError naming the file."""
    path = run / RUN_CONFIG
    advice = "pass --preset or --config with the run's settings to resume"
    record = checkpoint.read_json(path, advice)
    try:
        return RunConfig.from_saved(record.get("config"))
    except ValueError as e:
        raise ValueError(f"{path} is not a teralm run config ({e}); {advice}") from None


def holds_run(run: Path) -> bool:
    """Whether folder ``run`` is a teralm run: it has a checkpoint pointer, or a run config."""
    if (run / checkpoint.LATEST).exists():
        return True
    try:
        record = json.loads((run / RUN_CONFIG).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and {"config", "index"} <= record.keys()


def open_run(run: Path, resume: bool) -> Path | None:
    """Create or check the run folder; the checkpoint to resume from (None: start afresh).

    A folder that holds anything but a run is refused, so no file of it is overwritten."""
    if run.exists() and not run.is_dir():
        raise ValueError(f"--out {run} is a file, not a folder; choose another --out")
    if run.exists() and any(run.iterdir()) and not holds_run(run):
        raise ValueError(
            f"--out {run} is not empty and holds no teralm run; choose another --out "
            "(a new or empty folder)"
        )
    run.mkdir(parents=True, exist_ok=True)
    folder = checkpoint.latest(run)
    if folder is not None and not resume:
        raise ValueError(
            f"{run} already holds a run: pass --resume to continue it, or another --out"
        )
    return folder


def train(
    ix: Index,
    config: RunConfig,
    run: Path,
    resume: bool = False,
    progress: bool = True,
    device: torch.device | None = None,
) -> TrainResult:
    """Train (or continue) the run in folder ``run``."""
    device = device or default_device()
    keep_freed_memory()
    cfg = config.train
    precision = choose_precision(config.model.precision, device)
    config.model.precision = precision.precision
    config.model.vocab_size, config.model.max_match = ix.vocab_size, ix.max_match
    config.model.max_seq_len = max(config.model.max_seq_len, cfg.seq_len)
    identity = ix.identity()
    folder = open_run(run, resume)

    torch.manual_seed(cfg.seed)
    model = Transformer(config.model).to(device)
    optimizer = make_optimizer(model, cfg)
    start, tokens_done, wall_before = 0, 0, 0.0
    if folder is not None:
        weights, opt_tensors, state = checkpoint.load(folder)
        check_resumable(state, config, identity)
        model.load_state_dict(weights)
        torch.set_rng_state(opt_tensors.pop("torch_rng"))
        checkpoint.restore_optimizer(optimizer, opt_tensors, state["optimizer"])
        start, tokens_done, wall_before = state["step"], state["tokens"], state["wall_s"]
    _truncate_metrics(run / METRICS, start)
    forward = torch.compile(model) if cfg.compile else model
    sampler = FragmentSampler(
        ix,
        cfg.seq_len,
        cfg.batch_size,
        cfg.seed,
        cfg.holdout_every,
        infgram=model.mixture_gate is not None,
        index_dropout=cfg.index_dropout if config.model.index_input else 0.0,
    )
    record = {"config": config.to_dict(), "index": identity, "precision": precision.to_dict()}
    fmt.write_atomic(run / RUN_CONFIG, json.dumps(record, indent=1).encode())
    if progress:
        print(f"precision {precision.precision}: {precision.reason}", file=sys.stderr)
    if precision.warning:
        print(f"warning: {precision.warning}", file=sys.stderr)

    saved_step = start if folder is not None else None

    def save(step: int) -> None:
        nonlocal saved_step
        saved_step = step
        state = {
            "config": config.to_dict(),
            "index": identity,
            "tokens": tokens_done,
            "wall_s": wall_before + time.perf_counter() - t0,
        }
        checkpoint.save(run, step, model, optimizer, state)

    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum
    t0 = time.perf_counter()
    last_log, loss_value, stopped, step = t0, float("nan"), "max_steps", start
    bar = tqdm(total=cfg.max_steps, initial=start, desc="train", unit="step", disable=not progress)
    keys = [
        (step, micro) for step in range(start, cfg.max_steps) for micro in range(cfg.grad_accum)
    ]
    batches = prefetched(sampler, keys)
    with open(run / METRICS, "a") as metrics, contextlib.closing(batches):
        for step in range(start, cfg.max_steps):
            if cfg.max_minutes and wall_before + time.perf_counter() - t0 > 60 * cfg.max_minutes:
                stopped = "max_minutes"
                break
            lr = learning_rate(cfg, step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            micro_losses = []  # read back only when logged: no device sync per step
            for _ in range(cfg.grad_accum):
                batch = next(batches).to(device)
                with autocast(device, config.model.precision):
                    logits, gate = forward(
                        batch.tokens, batch.next_token, batch.match_len, with_gate=True
                    )
                if gate is not None:
                    gate = model.gate_logit(gate, batch.infgram_total)
                mixed, own = index_lm_loss(
                    logits, gate, batch.targets, batch.infgram_total, batch.infgram_hits
                )
                loss = mixed + cfg.own_loss_weight * own if gate is not None else mixed
                (loss / cfg.grad_accum).backward()
                micro_losses.append(mixed.detach())
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tokens_done += tokens_per_step
            now = time.perf_counter()
            if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.max_steps:
                loss_value = _step_loss(micro_losses)
                rate = tokens_per_step * cfg.log_every / max(now - last_log, 1e-9)
                last_log = now
                record = {
                    "step": step + 1,
                    "loss": loss_value,
                    "lr": lr,
                    "tokens": tokens_done,
                    "tok_per_s": rate,
                    "elapsed_s": wall_before + now - t0,
                }
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
                bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{rate:,.0f}")
            bar.update(1)
            if (step + 1) % cfg.checkpoint_every == 0:
                save(step + 1)
        else:
            step = cfg.max_steps
    bar.close()
    if step > start:
        loss_value = _step_loss(micro_losses)
    if saved_step != step:
        save(step)
    wall = wall_before + time.perf_counter() - t0
    return TrainResult(step, loss_value, tokens_done, wall, stopped, model.num_parameters())
