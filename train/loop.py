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

from teralm.errors import ConfigError
from teralm.files import write_atomic
from teralm.index import Index
from teralm.infer.precision import PrecisionChoice, autocast, choose_precision, default_device
from teralm.model import ModelConfig, Transformer, checkpoint
from teralm.model.config import AUTO, PRECISIONS
from teralm.model.transformer import index_lm_loss
from teralm.train.config import RunConfig, TrainConfig
from teralm.train.data import FragmentSampler, prefetched
from teralm.train.diloco import WorkerPlace, is_round_end, open_worker, worker_env_problem
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
    rounds: int = 0  # DiLoCo: the rounds this worker took part in
    weights_sha256: str | None = None  # DiLoCo: of the global weights the workers agreed on


def check_resumable(saved: dict, config: RunConfig, identity: dict) -> None:
    """Refuse to resume a run whose model, training settings or index differ."""
    old = RunConfig.from_saved(saved["config"])
    if old.model != config.model:
        diff = [
            f"{k}: {v!r} -> {config.model.to_dict()[k]!r}"
            for k, v in old.model.to_dict().items()
            if config.model.to_dict()[k] != v
        ]
        raise ConfigError("the run was trained with another model config (" + ", ".join(diff) + ")")
    new_train = asdict(config.train)
    changed = [k for k, v in asdict(old.train).items() if new_train[k] != v]
    if set(changed) - RESUMABLE_CHANGES:
        raise ConfigError(
            "the run was trained with other settings: "
            + ", ".join(sorted(set(changed) - RESUMABLE_CHANGES))
        )
    for key in ("tokenizer", "tokenizer_sha256", "vocab_size", "num_tokens", "tokens_sha256"):
        if saved["index"].get(key, identity[key]) != identity[key]:  # older runs lack some
            raise ConfigError(f"the run was trained on another index ({key} differs)")


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
    """Keep the metric lines of steps up to ``step`` (a resumed run redoes the rest); a last
    line cut short (the process was killed while writing it) is dropped."""
    if not path.exists():
        return
    kept, text = [], path.read_text()
    lines = text.splitlines()
    if lines and not text.endswith("\n") and _metric_step(lines[-1]) is None:
        lines.pop()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        line_step = _metric_step(line)
        if line_step is None:
            raise ConfigError(
                f"{path} line {number} is not a metrics record; delete that line and resume"
            )
        if line_step <= step:
            kept.append(line + "\n")
    write_atomic(path, "".join(kept).encode())


def saved_config(run: Path) -> RunConfig:
    """The config a run was started with (``RUN/config.json``); ConfigError naming the file."""
    path = run / RUN_CONFIG
    advice = "pass --preset or --config with the run's settings to resume"
    record = checkpoint.read_json(path, advice)
    try:
        return RunConfig.from_saved(record.get("config"))
    except ValueError as e:
        raise ConfigError(f"{path} is not a teralm run config ({e}); {advice}") from None


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
        raise ConfigError(f"--out {run} is a file, not a folder; choose another --out")
    if (
        run.exists()
        and any(not p.name.startswith(checkpoint.LOCK) for p in run.iterdir())
        and not holds_run(run)
    ):
        raise ConfigError(
            f"--out {run} is not empty and holds no teralm run; choose another --out "
            "(a new or empty folder)"
        )
    run.mkdir(parents=True, exist_ok=True)
    folder = checkpoint.latest(run)
    if folder is not None and not resume:
        raise ConfigError(
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
    worker: WorkerPlace | None = None,
) -> TrainResult:
    """Train (or continue) the run in folder ``run``: on the processes ``torchrun`` started
    (data-parallel, see teralm.train.distributed), in this one, or as DiLoCo ``worker``
    (``mode = "diloco"``, see teralm.train.diloco)."""
    device = device or default_device()
    if (config.train.mode == "diloco") != (worker is not None):
        raise ConfigError(
            "mode diloco runs as a worker that a lighthouse coordinates (--lighthouse auto, or "
            "its address); --lighthouse belongs to mode diloco"
        )
    if worker is not None and (problem := worker_env_problem()):
        raise ConfigError(problem)
    world = join_world(device.type, group_alone=config.train.comm == "powersgd")
    try:
        if device.type == "cuda" and world.size > 1:
            device = torch.device("cuda", world.local_rank)
            torch.cuda.set_device(device)
        with contextlib.ExitStack() as held:  # the run's lock, on the main process
            result = _train(
                ix, config, run, resume, progress and world.main, device, world, held, worker
            )
    except BaseException:
        leave_world(world, together=False)
        raise
    leave_world(world)
    return result


def _open_run_everywhere(
    run: Path, resume: bool, world: World, held: contextlib.ExitStack, worker: int | None
) -> Path | None:
    """``open_run`` and the run's lock (kept in ``held``; a DiLoCo ``worker`` holds one of its
    own) on the main process, then the checkpoint to resume from, on every one."""
    error = None
    if world.main:
        try:
            open_run(run, resume)
            held.enter_context(checkpoint.lock_run(run, worker))
        except ValueError as e:
            error = e
    if world.size > 1:
        failed = torch.tensor([error is not None], dtype=torch.int32, device=world.device)
        dist.broadcast(failed, src=0)
        if failed.item() and error is None:
            raise ConfigError("the main process (rank 0) refused the run folder: see its error")
    if error is not None:
        raise error
    return checkpoint.latest(run) if resume else None


def _check_world(cfg: TrainConfig, world: World, state: dict | None) -> None:
    """ConfigError unless the processes divide the global batch and (resuming from ``state``)
    are as many as the run was trained on."""
    if cfg.batch_size % world.size:
        raise ConfigError(
            f"batch_size {cfg.batch_size} (the global batch) is not a multiple of the "
            f"{world.size} processes; choose a batch_size that {world.size} divides"
        )
    if cfg.per_layer_update and world.size > 1:
        raise ConfigError(
            "per_layer_update steps before the processes could exchange gradients: "
            "train it on one process"
        )
    saved = (state or {}).get("world_size", 1)
    if state is not None and saved != world.size:
        raise ConfigError(
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


def _write_round(path: Path, records: list[dict], start: int, outer) -> None:
    """A DiLoCo round's metrics records, once the round is agreed, with the workers in it; the
    last carries the bytes this worker sent in the round (the others 0). The lines past
    ``start`` (from a run killed before it was resumed) go first."""
    _truncate_metrics(path, start)
    with open(path, "a") as metrics:
        for i, record in enumerate(records, 1):
            sent = outer.round_sent if i == len(records) else 0
            record.update(sent_bytes=sent, received_bytes=sent, workers=outer.workers)
            metrics.write(json.dumps(record) + "\n")


def _train_step(
    cfg: TrainConfig,
    precision: str,
    step: int,
    device: torch.device,
    batches,
    forward,
    exchange,
    optimizer,
    params: list[torch.Tensor],
) -> list[torch.Tensor]:
    """One optimizer step (``grad_accum`` micro-batches, the exchange, clipping): the
    micro-batches' mixed losses, not yet read back (no device sync per step)."""
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(cfg, step)
    micro_losses = []
    for micro in range(cfg.grad_accum):
        batch = next(batches).to(device)
        with exchange.accumulating(last=micro == cfg.grad_accum - 1):
            with autocast(device, precision):
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
    return micro_losses


def _train(
    ix: Index,
    config: RunConfig,
    run: Path,
    resume: bool,
    progress: bool,
    device: torch.device,
    world: World,
    held: contextlib.ExitStack,
    worker: WorkerPlace | None,
) -> TrainResult:
    keep_freed_memory()
    cfg = config.train
    config.model.vocab_size, config.model.max_match = ix.vocab_size, ix.max_match
    config.model.max_seq_len = max(config.model.max_seq_len, cfg.seq_len)
    identity = ix.identity()
    _check_world(cfg, world, None)
    folder = _open_run_everywhere(run, resume, world, held, worker and worker.replica)
    precision = _run_precision(config.model, device, run if folder else None, world)
    config.model.precision = precision.precision

    torch.manual_seed(cfg.seed)  # the same initial weights on every process
    model = Transformer(config.model).to(device)
    optimizer = make_optimizer(model, cfg, world)
    exchange = make_exchange(cfg, world, optimizer)
    outer = held.enter_context(open_worker(worker, model, optimizer, cfg)) if worker else None
    start, tokens_done, wall_before = 0, 0, 0.0
    if folder is not None:
        folder, (weights, opt_tensors, state) = checkpoint.load_latest(run)
        check_resumable(state, config, identity)
        _check_world(cfg, world, state)
        model.load_state_dict(weights)
        torch.set_rng_state(opt_tensors.pop("torch_rng"))
        ranks = {k: opt_tensors.pop(k) for k in list(opt_tensors) if k.startswith("rank")}
        rounds = {k: opt_tensors.pop(k) for k in list(opt_tensors) if k.startswith("outer/")}
        checkpoint.restore_optimizer(optimizer, opt_tensors, state["optimizer"])
        exchange.load_local_state(local_state_of(ranks, world.rank))
        start, tokens_done, wall_before = state["step"], state["tokens"], state["wall_s"]
        if outer is not None:
            outer.restore(rounds, state["outer"], start)

    def writes() -> bool:
        """Whether this process writes the run now: rank 0; in DiLoCo, the first worker of the
        last round's quorum (before the first round, worker 0)."""
        if outer is None:
            return world.main
        return outer.main if outer.rounds else worker.replica == 0

    logs_each_step = outer is None and world.main  # DiLoCo writes its metrics by round
    if logs_each_step:
        _truncate_metrics(run / METRICS, start)
    forward = exchange.wrap(model)
    forward = torch.compile(forward) if cfg.compile else forward
    parts, part = (cfg.replicas, worker.replica) if worker else (world.size, world.rank)
    sampler = FragmentSampler(
        ix,
        cfg.seq_len,
        cfg.batch_size // parts,
        cfg.seed,
        cfg.holdout_every,
        infgram=model.mixture_gate is not None,
        index_dropout=cfg.index_dropout if config.model.index_input else 0.0,
        dropout_features=cfg.dropout_features,
        rank=part,
        world=parts,
        workers=torch.get_num_threads(),
    )
    if writes():  # the same file from every DiLoCo worker, written whole
        record = {"config": config.to_dict(), "index": identity, "precision": precision.to_dict()}
        write_atomic(run / RUN_CONFIG, json.dumps(record, indent=1).encode())
    if progress:
        print(f"precision {precision.precision}: {precision.reason}", file=sys.stderr)
        if world.size > 1:
            print(f"{world.size} processes, gradients by {cfg.comm}", file=sys.stderr)
    if precision.warning and writes():
        print(f"warning: {precision.warning}", file=sys.stderr)

    saved_step = start if folder is not None else None

    def save(step: int) -> None:
        nonlocal saved_step
        saved_step = step
        local_states = gather_local_states(exchange, world)  # every rank takes part
        if not writes():
            return
        state = {
            "config": config.to_dict(),
            "index": identity,
            "tokens": tokens_done,
            "wall_s": wall_before + time.perf_counter() - t0,
            "world_size": world.size,
        }
        if outer is not None:
            state["outer"] = outer.checkpoint_state()
            local_states.update(outer.checkpoint_tensors())
        checkpoint.save(run, step, model, optimizer, state, local_states)

    def batches_from(step: int):
        keys = [(s, micro) for s in range(step, cfg.max_steps) for micro in range(cfg.grad_accum)]
        return prefetched(sampler, keys, background=device.type != "cpu")

    params = [p for p in model.parameters() if p.requires_grad]
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum
    traffic = exchange.traffic if outer is None else outer.traffic
    t0 = time.perf_counter()
    last_log, loss_value, stopped, step = t0, float("nan"), "max_steps", start
    micro_losses: list[torch.Tensor] = []
    round_start = start  # DiLoCo: where this worker's current round began
    round_records: list[dict] = []  # DiLoCo: written once the round is agreed
    bar = tqdm(total=cfg.max_steps, initial=start, desc="train", unit="step", disable=not progress)
    with contextlib.ExitStack() as stack:
        batches = stack.enter_context(contextlib.closing(batches_from(start)))
        metrics = stack.enter_context(open(run / METRICS, "a")) if logs_each_step else None
        while step < cfg.max_steps:
            if cfg.max_minutes and (outer is None or step == round_start):  # between rounds
                late = wall_before + time.perf_counter() - t0 > 60 * cfg.max_minutes
                if _agree(float(late), world, "max"):
                    stopped = "max_minutes"
                    break
            if outer is None:
                traffic.new_step()
            micro_losses = _train_step(
                cfg, config.model.precision, step, device, batches, forward, exchange,
                optimizer, params,
            )  # fmt: skip
            step += 1
            tokens_done += tokens_per_step
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                now = time.perf_counter()
                loss_value = _agree(_step_loss(micro_losses), world) / world.size
                rate = tokens_per_step * cfg.log_every / max(now - last_log, 1e-9)
                last_log = now
                record = {
                    "step": step,
                    "loss": loss_value,
                    "lr": learning_rate(cfg, step - 1),
                    "tokens": tokens_done,
                    "tok_per_s": rate,
                    "elapsed_s": wall_before + now - t0,
                    "sent_bytes": traffic.step_sent,
                    "received_bytes": traffic.step_sent,  # a ring receives what it sends
                }
                if outer is not None:
                    round_records.append(record)
                elif logs_each_step:
                    metrics.write(json.dumps(record) + "\n")
                    metrics.flush()
                bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{rate:,.0f}")
            bar.update(1)
            if outer is not None and is_round_end(cfg, step):
                agreed = outer.round(step, float(step - round_start))
                if agreed == step and writes():
                    _write_round(run / METRICS, round_records, round_start, outer)
                if agreed != step:  # redo the round, or go on from where a peer put this worker
                    batches.close()
                    batches = stack.enter_context(contextlib.closing(batches_from(agreed)))
                    tokens_done += (agreed - step) * tokens_per_step
                    bar.update(agreed - step)
                step = round_start = agreed
                round_records = []
            agreed_here = outer is None or step == round_start  # DiLoCo: right after a round
            if step % cfg.checkpoint_every == 0 and agreed_here and saved_step != step:
                save(step)
    bar.close()
    if outer is not None:
        outer.finish()
    if micro_losses:
        loss_value = _agree(_step_loss(micro_losses), world) / world.size
    if saved_step != step:
        save(step)
    wall = wall_before + time.perf_counter() - t0
    return TrainResult(
        step, loss_value, tokens_done, wall, stopped, model.num_parameters(), traffic.sent,
        writes(), outer.rounds if outer else 0, outer.digest() if outer else None,
    )  # fmt: skip
