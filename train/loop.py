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
import torch.distributed as dist
from tqdm import tqdm

from teralm.index import Index
from teralm.index import format as fmt
from teralm.infer.precision import PrecisionChoice, autocast, choose_precision, default_device
from teralm.model import ModelConfig, Transformer, checkpoint
from teralm.model.config import AUTO, PRECISIONS
from teralm.model.transformer import index_lm_loss
from teralm.train.config import RunConfig, TrainConfig
from teralm.train.data import FragmentSampler, prefetched
from teralm.train.distributed import (
    World,
    gather_local_states,
    join_world,
    leave_world,
    local_state_of,
    make_exchange,
)
from teralm.train.optim import make_optimizer

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


@dataclass
class TrainResult:
    steps: int
    final_loss: float
    tokens: int
    wall_s: float
    stopped: str  # "max_steps" or "max_minutes"
    parameters: int
    bytes_sent: int = 0  # by this process to the others, in all
    main: bool = True  # whether this process is the one that writes the run (rank 0)


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
    if (
        run.exists()
        and any(p.name != checkpoint.LOCK for p in run.iterdir())
        and not holds_run(run)
    ):
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
    """Train (or continue) the run in folder ``run``: on the processes ``torchrun`` started
    (data-parallel, see teralm.train.distributed), or in this one."""
    device = device or default_device()
    world = join_world(device.type, group_alone=config.train.comm == "powersgd")
    try:
        if device.type == "cuda" and world.size > 1:
            device = torch.device("cuda", world.local_rank)
            torch.cuda.set_device(device)
        with contextlib.ExitStack() as held:  # the run's lock, on the main process
            result = _train(ix, config, run, resume, progress and world.main, device, world, held)
    except BaseException:
        leave_world(world, together=False)
        raise
    leave_world(world)
    return result


def _open_run_everywhere(
    run: Path, resume: bool, world: World, held: contextlib.ExitStack
) -> Path | None:
    """``open_run`` and the run's lock (kept in ``held``) on the main process, then the
    checkpoint to resume from, on every one."""
    error = None
    if world.main:
        try:
            open_run(run, resume)
            held.enter_context(checkpoint.lock_run(run))
        except ValueError as e:
            error = e
    if world.size > 1:
        failed = torch.tensor([error is not None], dtype=torch.int32, device=world.device)
        dist.broadcast(failed, src=0)
        if failed.item() and error is None:
            raise ValueError("the main process (rank 0) refused the run folder: see its error")
    if error is not None:
        raise error
    return checkpoint.latest(run) if resume else None


def _check_world(cfg: TrainConfig, world: World, state: dict | None) -> None:
    """ValueError unless the processes divide the global batch and (resuming from ``state``)
    are as many as the run was trained on."""
    if cfg.batch_size % world.size:
        raise ValueError(
            f"batch_size {cfg.batch_size} (the global batch) is not a multiple of the "
            f"{world.size} processes; choose a batch_size that {world.size} divides"
        )
    if cfg.per_layer_update and world.size > 1:
        raise ValueError(
            "per_layer_update steps before the processes could exchange gradients: "
            "train it on one process"
        )
    saved = (state or {}).get("world_size", 1)
    if state is not None and saved != world.size:
        raise ValueError(
            f"the run was trained on {saved} processes, and resuming on {world.size} is not "
            f"supported; resume it with torchrun --nproc-per-node {saved} (in all)"
        )


def _agree(value: float, world: World, op: str = "sum") -> float:
    """``value`` summed (or, with ``op="max"``, the largest) over the processes."""
    if world.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=world.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return float(t[0])


def _run_precision(
    model: ModelConfig, device: torch.device, resumed: Path | None, world: World
) -> PrecisionChoice:
    """The precision to train in: as asked; for ``auto``, the ``resumed`` run's own, or the
    main process's choice for this machine (which may time bf16 against fp32) on every one."""
    if model.precision != AUTO:
        return choose_precision(model.precision, device, width=model.d_model)
    if resumed is not None:
        return PrecisionChoice(saved_config(resumed).model.precision, "the resumed run's own")
    choice = choose_precision(AUTO, device, width=model.d_model)
    if world.size > 1:
        pick = torch.tensor([PRECISIONS.index(choice.precision)], device=world.device)
        dist.broadcast(pick, src=0)
        if PRECISIONS[int(pick)] != choice.precision:
            choice = PrecisionChoice(PRECISIONS[int(pick)], "the main process's choice")
    return choice


def _train(
    ix: Index,
    config: RunConfig,
    run: Path,
    resume: bool,
    progress: bool,
    device: torch.device,
    world: World,
    held: contextlib.ExitStack,
) -> TrainResult:
    keep_freed_memory()
    cfg = config.train
    config.model.vocab_size, config.model.max_match = ix.vocab_size, ix.max_match
    config.model.max_seq_len = max(config.model.max_seq_len, cfg.seq_len)
    identity = ix.identity()
    _check_world(cfg, world, None)
    folder = _open_run_everywhere(run, resume, world, held)
    precision = _run_precision(config.model, device, run if folder else None, world)
    config.model.precision = precision.precision

    torch.manual_seed(cfg.seed)  # the same initial weights on every process
    model = Transformer(config.model).to(device)
    optimizer = make_optimizer(model, cfg, world)
    exchange = make_exchange(cfg, world, optimizer)
    start, tokens_done, wall_before = 0, 0, 0.0
    if folder is not None:
        weights, opt_tensors, state = checkpoint.load(folder)
        check_resumable(state, config, identity)
        _check_world(cfg, world, state)
        model.load_state_dict(weights)
        torch.set_rng_state(opt_tensors.pop("torch_rng"))
        ranks = {k: opt_tensors.pop(k) for k in list(opt_tensors) if k.startswith("rank")}
        checkpoint.restore_optimizer(optimizer, opt_tensors, state["optimizer"])
        exchange.load_local_state(local_state_of(ranks, world.rank))
        start, tokens_done, wall_before = state["step"], state["tokens"], state["wall_s"]
    if world.main:
        _truncate_metrics(run / METRICS, start)
    forward = exchange.wrap(model)
    forward = torch.compile(forward) if cfg.compile else forward
    sampler = FragmentSampler(
        ix,
        cfg.seq_len,
        cfg.batch_size // world.size,
        cfg.seed,
        cfg.holdout_every,
        infgram=model.mixture_gate is not None,
        index_dropout=cfg.index_dropout if config.model.index_input else 0.0,
        rank=world.rank,
        world=world.size,
        workers=torch.get_num_threads(),
    )
    if world.main:
        record = {"config": config.to_dict(), "index": identity, "precision": precision.to_dict()}
        fmt.write_atomic(run / RUN_CONFIG, json.dumps(record, indent=1).encode())
    if progress:
        print(f"precision {precision.precision}: {precision.reason}", file=sys.stderr)
        if world.size > 1:
            print(f"{world.size} processes, gradients by {cfg.comm}", file=sys.stderr)
    if precision.warning and world.main:
        print(f"warning: {precision.warning}", file=sys.stderr)

    saved_step = start if folder is not None else None

    def save(step: int) -> None:
        nonlocal saved_step
        saved_step = step
        local_states = gather_local_states(exchange, world)  # every rank takes part
        if not world.main:
            return
        state = {
            "config": config.to_dict(),
            "index": identity,
            "tokens": tokens_done,
            "wall_s": wall_before + time.perf_counter() - t0,
            "world_size": world.size,
        }
        checkpoint.save(run, step, model, optimizer, state, local_states)

    params = [p for p in model.parameters() if p.requires_grad]
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum
    t0 = time.perf_counter()
    last_log, loss_value, stopped, step = t0, float("nan"), "max_steps", start
    bar = tqdm(total=cfg.max_steps, initial=start, desc="train", unit="step", disable=not progress)
    keys = [
        (step, micro) for step in range(start, cfg.max_steps) for micro in range(cfg.grad_accum)
    ]
    batches = prefetched(sampler, keys, background=device.type != "cpu")
    with contextlib.ExitStack() as stack:
        stack.enter_context(contextlib.closing(batches))
        metrics = stack.enter_context(open(run / METRICS, "a")) if world.main else None
        for step in range(start, cfg.max_steps):
            if cfg.max_minutes:
                late = wall_before + time.perf_counter() - t0 > 60 * cfg.max_minutes
                if _agree(float(late), world, "max"):
                    stopped = "max_minutes"
                    break
            lr = learning_rate(cfg, step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            exchange.traffic.new_step()
            micro_losses = []  # read back only when logged: no device sync per step
            for micro in range(cfg.grad_accum):
                batch = next(batches).to(device)
                with exchange.accumulating(last=micro == cfg.grad_accum - 1):
                    with autocast(device, config.model.precision):
                        logits, gate = forward(
                            batch.tokens, batch.next_token, batch.match_len, with_gate=True,
                            infgram_total=batch.infgram_total,
                        )  # fmt: skip
                    mixed, own = index_lm_loss(
                        logits, gate, batch.targets, batch.infgram_total, batch.infgram_hits
                    )
                    loss = mixed + cfg.own_loss_weight * own if gate is not None else mixed
                    (loss / cfg.grad_accum).backward()
                micro_losses.append(mixed.detach())
            exchange.exchange(params)
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tokens_done += tokens_per_step
            now = time.perf_counter()
            if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.max_steps:
                loss_value = _agree(_step_loss(micro_losses), world) / world.size
                rate = tokens_per_step * cfg.log_every / max(now - last_log, 1e-9)
                last_log = now
                record = {
                    "step": step + 1,
                    "loss": loss_value,
                    "lr": lr,
                    "tokens": tokens_done,
                    "tok_per_s": rate,
                    "elapsed_s": wall_before + now - t0,
                    "sent_bytes": exchange.traffic.step_sent,
                    "received_bytes": exchange.traffic.step_sent,  # a ring receives what it sends
                }
                if world.main:
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
        loss_value = _agree(_step_loss(micro_losses), world) / world.size
    if saved_step != step:
        save(step)
    wall = wall_before + time.perf_counter() - t0
    return TrainResult(
        step, loss_value, tokens_done, wall, stopped, model.num_parameters(), exchange.traffic.sent,
        world.main,
    )  # fmt: skip
