"""Fault benchmark: build-index killed (kill -9) and out of disk in every pass, a pool worker
killed, a second build of the same folder started in every pass, and training killed; each
resumed with the same command and compared with a run that was never interrupted.

    python benchmarks/bench_faults.py [--kills 20] [--worker-kills 2] [--second-builds 4]
                                      [--disk-fills 2]
                                      [--train-kills 3] [--train-steps 12] [--tokens 800000]
                                      [--no-disk] [--timeout 120]

The corpus is the first pydocs documents (../shared/data) up to --tokens bytes, built with
--workers 2 into 4 shards. Kill points are random, spread evenly over the passes (which each
run's progress bars show) and over the training steps. A resumed index must match the reference
file for file, byte for byte (the manifest without its date and timings, the catalog's records
without timings); a resumed training run must log the same losses and end with the same weights
and optimizer state. The full-disk part (root only, skipped otherwise) builds into a tmpfs sized
from the reference build's disk use so that it fills during each pass in turn (--disk-fills
points per pass), expects a one-line "disk full" error, remounts the tmpfs larger and runs the
same command again.
Every command has a time limit (--timeout), so a hang is reported, not waited on.

Prints a table and writes benchmarks/results/bench_faults.json.
"""

from __future__ import annotations

import argparse
import contextlib
import filecmp
import gzip
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
from common import PYDOCS, TERALM, save, table

from teralm.index import format as fmt
from teralm.model import checkpoint
from teralm.train.report import read_metrics

PASSES = ("tokenize", "sort", "features", "finalize")
PASS_BARS = ("pass 1/4", "pass 2/4", "pass 3/4", "checksums")  # progress bar titles
TRAIN_BAR = re.compile(r"^train.*?(\d+)/\d+ \[")
PAGE = 4096
ENV = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}  # the bars tell where it is
TEARDOWN_S = 5  # how long a killed command's workers may take to die


def build_position(line: str) -> int | None:
    """The pass a build-index progress line belongs to."""
    return next((i for i, title in enumerate(PASS_BARS) if title in line), None)


def train_position(line: str) -> int | None:
    """The step a ``teralm train`` progress line shows."""
    found = TRAIN_BAR.search(line)
    return int(found.group(1)) if found else None


# ----------------------------------------------------------------------- watched subprocesses


@dataclass
class Outcome:
    """How one command ended, and what its progress bars showed on the way."""

    returncode: int | None  # None: it ran past its time limit (a hang) and was killed
    stderr: str
    wall_s: float
    started: dict[int, float]  # pass (or step) -> seconds after the start it was first seen
    fault_at: int | None = None  # the pass (or step) it was in when the fault was injected
    orphans: int = 0  # processes of its group still alive a while after it ended

    @property
    def message(self) -> str:
        """The last line it printed (its error, when it failed)."""
        lines = [line for line in re.split(r"[\r\n]", self.stderr) if line.strip()]
        return lines[-1][:200] if lines else ""


class Watched:
    """A command in its own process group whose stderr progress bars are read as they come;
    ``position`` is the furthest pass (or step) seen, and ``on_position`` hears each new one."""

    def __init__(
        self,
        cmd: list[str],
        parse: Callable[[str], int | None],
        on_position: Callable[[Watched, int], None],
    ):
        self.parse, self.on_position = parse, on_position
        self.position: int | None = None
        self.started: dict[int, float] = {}
        self.chunks: list[str] = []
        self.began = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV, start_new_session=True
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        tail = ""
        for raw in iter(lambda: os.read(self.proc.stderr.fileno(), 1 << 16), b""):
            text = raw.decode(errors="replace")
            self.chunks.append(text)
            lines = re.split(r"[\r\n]", tail + text)  # the last may be cut short: kept
            tail = lines[-1]
            for position in filter(lambda p: p is not None, map(self.parse, lines)):
                if self.position is None or position > self.position:
                    self.position = position
                    self.started.setdefault(position, time.perf_counter() - self.began)
                    self.on_position(self, position)

    def elapsed(self) -> float:
        return time.perf_counter() - self.began

    def finish(self, timeout: float) -> Outcome:
        """Wait for the command; past ``timeout`` seconds, kill its group (a hang)."""
        try:
            returncode = self.proc.wait(max(0.0, timeout - self.elapsed()))
        except subprocess.TimeoutExpired:
            returncode = None
        wall = self.elapsed()
        orphans = reap_group(self.proc.pid)
        self.reader.join(TEARDOWN_S)
        return Outcome(returncode, "".join(self.chunks), wall, self.started, None, orphans)


def reap_group(pgid: int) -> int:
    """Wait a little for a process group to be gone; kill what is left and count it."""
    deadline = time.perf_counter() + TEARDOWN_S
    while time.perf_counter() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return 0
        time.sleep(0.05)
    left = 0
    for p in psutil.process_iter():
        with contextlib.suppress(ProcessLookupError):
            left += os.getpgid(p.pid) == pgid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    return left


@dataclass
class Fault:
    """``inject`` the fault ``delay`` seconds after the bars first show ``position`` (retried
    every 10 ms until it reports that it hit). With ``reference_start``, when the reference run
    reached ``position``, the delay is scaled by how much slower (or faster) this run got there:
    the machine's load varies."""

    position: int
    delay: float
    inject: Callable[[Watched], bool]
    reference_start: float = 0.0

    def wait(self, w: Watched) -> float:
        """Seconds to wait, from when ``w`` reached ``position``."""
        started = w.started.get(self.position)
        if not self.reference_start or started is None:
            return self.delay
        return self.delay * started / self.reference_start


def run(
    cmd: list[str],
    timeout: float,
    parse: Callable[[str], int | None] = build_position,
    fault: Fault | None = None,
    sample: Callable[[Watched], None] | None = None,
) -> Outcome:
    """Run ``cmd`` to its end or its time limit, injecting ``fault``; ``sample(watched)`` is
    called every 10 ms meanwhile."""
    hit: dict[str, int | None] = {}
    armed = threading.Event()

    def arm(w: Watched, position: int) -> None:
        if fault and position >= fault.position and not armed.is_set():
            armed.set()
            threading.Thread(target=fire, args=(w,), daemon=True).start()

    def fire(w: Watched) -> None:
        time.sleep(fault.wait(w))
        while w.proc.poll() is None:
            where = w.position
            if fault.inject(w):
                hit["at"] = where
                return
            time.sleep(0.01)

    w = Watched(cmd, parse, arm)
    try:
        while sample and w.proc.poll() is None and w.elapsed() < timeout:
            sample(w)
            time.sleep(0.01)
        outcome = w.finish(timeout)
    except BaseException:  # Ctrl-C: its own session does not get it, so end it here
        with contextlib.suppress(ProcessLookupError):
            os.killpg(w.proc.pid, signal.SIGKILL)
        raise
    outcome.fault_at = hit.get("at")
    return outcome


def kill_command(w: Watched) -> bool:
    """kill -9 of the command itself (its pool workers must die with it)."""
    w.proc.send_signal(signal.SIGKILL)
    return True


def kill_worker(w: Watched) -> bool:
    """kill -9 of one of the command's pool workers, once there is one."""
    try:
        children = psutil.Process(w.proc.pid).children()
        workers = [p for p in children if "spawn_main" in " ".join(p.cmdline())]
    except psutil.Error:
        return False
    if not workers:
        return False
    min(workers, key=lambda p: p.pid).send_signal(signal.SIGKILL)
    return True


# -------------------------------------------------------------------------------- comparisons


def index_differences(ref: Path, out: Path) -> list[str]:
    """How index ``out`` differs from ``ref``: every file byte for byte but the build's stats
    (``format.content_digests``); empty when identical."""
    want, got = fmt.content_digests(ref), fmt.content_digests(out)
    diffs = [f"missing {n}" for n in sorted(want.keys() - got.keys())]
    diffs += [f"extra {n}" for n in sorted(got.keys() - want.keys())]
    return diffs + [f"{n} differs" for n in sorted(want.keys() & got.keys()) if want[n] != got[n]]


def run_differences(ref: Path, out: Path) -> list[str]:
    """How training run ``out`` differs from ``ref``: logged losses, final weights and optimizer."""
    diffs = [] if logged_losses(ref) == logged_losses(out) else ["logged losses differ"]
    final = json.loads((ref / checkpoint.LATEST).read_text())["checkpoint"]
    for name in ("model.safetensors", "optimizer.safetensors"):
        theirs = out / final / name
        if not theirs.exists() or not filecmp.cmp(ref / final / name, theirs, shallow=False):
            diffs.append(f"{final}/{name} differs")
    return diffs


def logged_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir)}


# --------------------------------------------------------------------------------- the trials


@dataclass
class Trial:
    """One faulted command and the same command run again."""

    fault: str
    aimed: str  # the pass (or step) the fault was aimed at
    landed: str = "-"  # the pass (or step) it hit
    hit: bool = False  # it hit where it was aimed (training: before the run ended)
    one_line_error: bool | None = None  # the faulted command failed with one clear line
    resumed: bool = False
    identical: bool = False
    hang: str = ""  # which command ran past its time limit
    orphans: int = 0
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        if self.hang:
            state = f"HANG ({self.hang})"
        elif not self.resumed:
            state = "resume FAILED"
        else:
            state = "identical" if self.identical else "NOT identical"
        return f"hit {self.landed}: {state} {'; '.join(self.notes)}".rstrip()


@dataclass
class Setup:
    """What every build trial shares."""

    corpus: Path
    reference: Path
    work: Path
    shard_tokens: int
    timeout: float
    rng: random.Random

    def build_cmd(self, out: Path) -> list[str]:
        return [
            *TERALM,
            "build-index",
            str(self.corpus),
            *("--out", str(out), "--workers", "2", "--shard-tokens", str(self.shard_tokens)),
        ]


def finish_trial(
    trial: Trial,
    faulted: Outcome,
    cmd: list[str],
    timeout: float,
    parse: Callable[[str], int | None],
    differences: Callable[[], list[str]],
) -> None:
    """Record how the faulted command ended; unless it hung, run the same command again and
    record whether that finished and matches the reference."""
    trial.orphans += faulted.orphans
    trial.wall_s += faulted.wall_s
    if faulted.returncode is None:
        trial.hang = "faulted run"
        return
    if faulted.returncode != -signal.SIGKILL and not trial.one_line_error:  # unexpected end
        trial.notes.append(f"faulted run: exit {faulted.returncode}: {faulted.message[:120]}")
    again = run(cmd, timeout, parse)
    trial.orphans += again.orphans
    trial.wall_s += again.wall_s
    if again.returncode is None:
        trial.hang = "run again"
    elif again.returncode:
        trial.notes.append(f"run again: {again.message}")
    else:
        trial.resumed = True
        diffs = differences()
        trial.identical = not diffs
        trial.notes += diffs[:4]


def make_corpus(tokens: int, path: Path) -> int:
    """The first pydocs documents, in id order, up to ``tokens`` bytes of text; bytes written."""
    written = 0
    with gzip.open(PYDOCS, "rt") as f, open(path, "w") as out:
        for line in f:
            record = json.loads(line)
            out.write(json.dumps({"id": record["id"], "text": record["text"]}) + "\n")
            written += len(record["text"].encode())
            if written >= tokens:
                break
    return written


def pass_seconds(outcome: Outcome) -> list[float]:
    """How long each pass took, from when its progress bar first showed."""
    starts = [outcome.started.get(i, 0.0) for i in range(len(PASSES))]
    return [max(0.0, b - a) for a, b in zip(starts, [*starts[1:], outcome.wall_s])]


def kill_trials(
    setup: Setup, reference: Outcome, kind: str, passes: list[int], count: int
) -> list[Trial]:
    """``count`` builds, each hit once by a kill -9 (of the build or of a pool worker) at a
    random point of one of ``passes`` (in turn, timed from the ``reference`` build), then run
    again and compared."""
    inject = kill_command if kind == "kill -9 build" else kill_worker
    seconds = pass_seconds(reference)
    trials = []
    for i in range(count):
        p = passes[i % len(passes)]
        out = setup.work / "faulted"
        cmd = setup.build_cmd(out)
        trial = Trial(kind, PASSES[p])
        delay = setup.rng.uniform(0, 0.9 * seconds[p])
        fault = Fault(p, delay, inject, reference.started.get(p, 0.0))
        hit = run(cmd, setup.timeout, fault=fault)
        trial.landed = PASSES[hit.fault_at] if hit.fault_at is not None else "nothing (it ended)"
        trial.hit = hit.fault_at == p
        compare = lambda out=out: index_differences(setup.reference, out)  # noqa: E731
        finish_trial(trial, hit, cmd, setup.timeout, build_position, compare)
        shutil.rmtree(out, ignore_errors=True)
        trials.append(trial)
        print(f"  {kind:<15} {PASSES[p]:<9} {trial.line()}", flush=True)
    return trials


def second_build_trials(setup: Setup, reference: Outcome, count: int) -> list[Trial]:
    """``count`` builds, each joined at a random point of a pass (in turn) by a second build of
    the same ``--out`` (``second_build_trial``)."""
    trials = []
    for i in range(count):
        trial = second_build_trial(setup, reference, i % len(PASSES))
        trials.append(trial)
        print(f"  {'second build':<15} {trial.aimed:<9} {trial.line()}", flush=True)
    return trials


def second_build_trial(setup: Setup, reference: Outcome, p: int) -> Trial:
    """A build joined at a random point of pass ``p`` by the same command (with
    ``--verify-samples 0``, so that nothing but the folder's lock could stop a race). The
    second must be refused with one line naming the first; the first must finish with the
    index an undisturbed build gives. (A second build that gets the lock once the first has
    released it finds the index complete: exit 0 is right there.)"""
    out = setup.work / "shared"
    cmd = [*setup.build_cmd(out), "--verify-samples", "0"]
    trial, second = Trial("second build", PASSES[p]), {}

    def start_second(w: Watched) -> bool:
        second["outcome"] = run(cmd, setup.timeout)
        return True

    delay = setup.rng.uniform(0, 0.9 * pass_seconds(reference)[p])
    fault = Fault(p, delay, start_second, reference.started.get(p, 0.0))
    first = run(cmd, setup.timeout, fault=fault)
    trial.landed = PASSES[first.fault_at] if first.fault_at is not None else "nothing (it ended)"
    trial.hit, trial.orphans, trial.wall_s = first.fault_at == p, first.orphans, first.wall_s
    late = second.get("outcome")
    if first.returncode is None or (late and late.returncode is None):
        trial.hang = "first build" if first.returncode is None else "second build"
    elif late is not None:
        refused = late.returncode == 1 and "in use by build-index" in late.message
        trial.one_line_error = refused or late.returncode == 0  # 0: it found the index done
        if not trial.one_line_error:
            trial.notes.append(f"second build: exit {late.returncode}: {late.message[:120]}")
        trial.resumed = first.returncode == 0  # here: the first build ended well
        diffs = index_differences(setup.reference, out) if trial.resumed else [first.message]
        trial.identical = not diffs
        trial.notes += diffs[:4]
    shutil.rmtree(out, ignore_errors=True)
    return trial


# ------------------------------------------------------------------------------ the full disk


def mount_tmpfs(where: Path, size: int) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)]
    return subprocess.run(cmd, capture_output=True).returncode == 0


def remount(where: Path, size: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(where)], check=True)


def unmount(where: Path) -> None:
    subprocess.run(["umount", str(where)], check=True)


def used_bytes(where: Path) -> int:
    s = os.statvfs(where)
    return (s.f_blocks - s.f_bfree) * s.f_frsize


def profiled_build(setup: Setup, mnt: Path) -> tuple[Outcome, list[tuple[int, int]]]:
    """The reference build, into tmpfs ``mnt``, with its disk use sampled: for each pass, the
    bytes used when it began and the most used while it ran."""
    seen: dict[int, list[int]] = {}
    outcome = run(
        setup.build_cmd(mnt / "index"),
        setup.timeout * 5,
        sample=lambda w: seen.setdefault(w.position or 0, []).append(used_bytes(mnt)),
    )
    seen.setdefault(len(PASSES) - 1, []).append(used_bytes(mnt))  # the manifest, at the end
    profile, before = [], 0
    for p in range(len(PASSES)):
        during = seen.get(p, [before])
        profile.append((min(before, *during), max(during)))
        before = during[-1]
    return outcome, profile


def fill_disk(mnt: Path) -> Callable[[Watched], bool]:
    """A fault that takes all the free space of tmpfs ``mnt`` (as another program might)."""

    def inject(_: Watched) -> bool:
        with contextlib.suppress(OSError), open(mnt / "filler", "wb", buffering=0) as f:
            while True:
                f.write(bytes(1 << 16))
        return True

    return inject


def fill_plan(profile: list[tuple[int, int]], fills: int) -> list[tuple[int, int, bool]]:
    """``(pass, tmpfs size, fill it up as the pass begins)`` of each full-disk trial: ``fills``
    sizes spread evenly over what each pass adds to the disk. A pass that never needs more room
    than an earlier one took (finalize) instead finds the tmpfs filled up as it begins."""
    plan = []
    for p, (begin, peak) in enumerate(profile):
        before = max((top for _, top in profile[:p]), default=0)
        if peak <= before:
            plan.append((p, before + (1 << 20), True))
            continue
        begin = max(begin, before)
        for i in range(1, fills + 1):
            size = begin + (peak - begin) * i // (fills + 1)
            plan.append((p, max(PAGE, size // PAGE * PAGE), False))
    return plan


def disk_trials(setup: Setup, profile: list[tuple[int, int]], fills: int) -> list[Trial]:
    """Builds into a tmpfs that fills up during each pass in turn (see ``fill_plan``), each
    followed by the same command once the tmpfs has been remounted larger."""
    trials, mnt = [], setup.work / "tmpfs"
    roomy = 4 * max(peak for _, peak in profile) + (64 << 20)
    for p, size, fill_at_start in fill_plan(profile, fills):
        trial = Trial("disk full", PASSES[p])
        fault = Fault(p, 0.0, fill_disk(mnt)) if fill_at_start else None
        if not mount_tmpfs(mnt, size):
            sys.exit(f"cannot mount a tmpfs of {size} bytes on {mnt}")
        try:
            cmd = setup.build_cmd(mnt / "index")
            full = run(cmd, setup.timeout, fault=fault)
            (mnt / "filler").unlink(missing_ok=True)
            reached = max(full.started, default=None)
            trial.landed = PASSES[reached] if reached is not None else "before any pass"
            trial.hit = reached == p
            trial.one_line_error = (
                full.returncode == 1
                and "Traceback" not in full.stderr
                and all(word in full.message for word in ("error:", "disk", "full"))
            )
            remount(mnt, roomy)
            compare = lambda: index_differences(setup.reference, mnt / "index")  # noqa: E731
            finish_trial(trial, full, cmd, setup.timeout, build_position, compare)
        finally:
            unmount(mnt)
        trials.append(trial)
        print(f"  {'disk full':<15} {PASSES[p]:<9} {trial.line()}", flush=True)
    return trials


# ----------------------------------------------------------------------------------- training


def train_trials(
    setup: Setup, steps: int, every: int, kills: int, precision: str
) -> tuple[list[Trial], float | None]:
    """An uninterrupted ``--preset tiny`` run on the reference index, then ``kills`` runs killed
    at random steps (at a random moment within the step) and resumed."""

    def cmd(out: Path) -> list[str]:
        return [
            *TERALM,
            "train",
            "--index",
            str(setup.reference),
            *("--out", str(out), "--preset", "tiny", "--precision", precision, "--resume"),
            *("--max-steps", str(steps), "--checkpoint-every", str(every)),
        ]

    reference = setup.work / "train-reference"
    whole = run(cmd(reference), setup.timeout * 5, train_position)
    if whole.returncode != 0:
        sys.exit(f"the reference training run failed: {whole.message}")
    first, last = whole.started.get(1, 0.0), whole.started.get(steps, whole.wall_s)
    step_s = (last - first) / max(1, steps - 1)
    trials = []
    for i in range(kills):
        target = setup.rng.randint(1, steps - 1)
        out = setup.work / f"train-{i}"
        trial = Trial("kill -9 train", f"step {target}")
        fault = Fault(target, setup.rng.uniform(0, step_s), kill_command)
        hit = run(cmd(out), setup.timeout * 5, train_position, fault)
        trial.landed = f"step {hit.fault_at}" if hit.fault_at is not None else "nothing (it ended)"
        trial.hit = hit.fault_at is not None
        compare = lambda out=out: run_differences(reference, out)  # noqa: E731
        finish_trial(trial, hit, cmd(out), setup.timeout * 5, train_position, compare)
        shutil.rmtree(out, ignore_errors=True)
        trials.append(trial)
        print(f"  {'kill -9 train':<15} step {target:<4} {trial.line()}", flush=True)
    return trials, whole.wall_s


# --------------------------------------------------------------------------------------- main


def reference_build(setup: Setup, disk: bool) -> tuple[Outcome, list | None]:
    """The uninterrupted build, and (when a tmpfs can be mounted) its disk use per pass."""
    mnt = setup.work / "tmpfs"
    if disk and mount_tmpfs(mnt, 1 << 30):
        try:
            whole, profile = profiled_build(setup, mnt)
            if whole.returncode == 0:
                shutil.copytree(mnt / "index", setup.reference)
        finally:
            unmount(mnt)
    else:
        if disk:
            print("full disk: skipped (mounting a tmpfs is not permitted here; run as root)")
        whole, profile = run(setup.build_cmd(setup.reference), setup.timeout * 5), None
    if whole.returncode != 0:
        sys.exit(f"the reference build failed: {whole.message}")
    return whole, profile


def summarize(trials: list[Trial]) -> list[dict]:
    """One row per fault and pass: runs, how many were hit where aimed, failed with one clear
    line, resumed, and resumed byte-identical."""
    rows: dict[tuple[str, str], dict] = {}
    for t in trials:
        where = "random steps" if t.fault == "kill -9 train" else t.aimed
        empty = {"fault": t.fault, "where": where, "runs": 0, "hit": 0, "one_line_error": None}
        counts = {"resumed": 0, "identical": 0, "hangs": 0, "orphans": 0}
        row = rows.setdefault((t.fault, where), {**empty, **counts})
        row["runs"] += 1
        row["hit"] += t.hit
        if t.one_line_error is not None:
            row["one_line_error"] = (row["one_line_error"] or 0) + t.one_line_error
        row["resumed"] += t.resumed
        row["identical"] += t.identical
        row["hangs"] += bool(t.hang)
        row["orphans"] += t.orphans
    return list(rows.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20, help="kill -9 of the build (all passes)")
    parser.add_argument("--worker-kills", type=int, default=2, help="kill -9 of a pool worker")
    parser.add_argument(
        "--second-builds", type=int, default=4, help="a second build of the same --out"
    )
    parser.add_argument("--train-kills", type=int, default=3, help="kill -9 of training")
    parser.add_argument("--train-steps", type=int, default=12)
    parser.add_argument("--checkpoint-every", type=int, default=3)
    parser.add_argument(
        "--train-precision",
        default="fp32",
        help="the tiny preset's bf16 is ~15x slower on CPUs without native bf16",
    )
    parser.add_argument("--tokens", type=int, default=800_000, help="corpus bytes")
    parser.add_argument("--disk-fills", type=int, default=2, help="full-disk points per pass")
    parser.add_argument("--no-disk", action="store_true", help="skip the full-disk part")
    parser.add_argument("--timeout", type=float, default=120, help="seconds per build command")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not PYDOCS.exists():
        sys.exit(f"{PYDOCS} not found: the benchmark reads the team's shared data folder")
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as tmp:
        work = Path(tmp)
        n = make_corpus(args.tokens, work / "corpus.jsonl")
        setup = Setup(
            corpus=work / "corpus.jsonl",
            reference=work / "reference",
            work=work,
            shard_tokens=-(-n // 4),
            timeout=args.timeout,
            rng=random.Random(args.seed),
        )
        whole, profile = reference_build(setup, disk=not args.no_disk)
        pass_s = pass_seconds(whole)
        print(
            f"reference build: {n:,} tokens, {whole.wall_s:.1f} s ("
            + ", ".join(f"{name} {s:.1f} s" for name, s in zip(PASSES, pass_s))
            + ")",
            flush=True,
        )
        trials = kill_trials(setup, whole, "kill -9 build", [0, 1, 2, 3], args.kills)
        trials += kill_trials(setup, whole, "kill -9 worker", [1, 2], args.worker_kills)
        trials += second_build_trials(setup, whole, args.second_builds)
        if profile:
            trials += disk_trials(setup, profile, args.disk_fills)
        train_s = None
        if args.train_kills:
            more, train_s = train_trials(
                setup,
                args.train_steps,
                args.checkpoint_every,
                args.train_kills,
                args.train_precision,
            )
            trials += more
    rows = summarize(trials)
    print()
    print(
        table(
            rows,
            [
                ("fault", "fault", "s"),
                ("where", "aimed at", "s"),
                ("runs", "runs", "d"),
                ("hit", "hit there", "d"),
                ("one_line_error", "1-line error", "d"),
                ("resumed", "resumed", "d"),
                ("identical", "identical", "d"),
                ("hangs", "hangs", "d"),
                ("orphans", "orphans", "d"),
            ],
        )
    )
    identical, total = sum(r["identical"] for r in rows), sum(r["runs"] for r in rows)
    orphans, wall = sum(r["orphans"] for r in rows), time.perf_counter() - began
    print(
        f"{identical}/{total} faulted runs resumed byte-identical; {orphans} processes outlived "
        f"their command by {TEARDOWN_S} s ({wall:.0f} s)"
    )
    payload = {
        "args": vars(args),
        "tokens": n,
        "reference_build_s": whole.wall_s,
        "pass_s": dict(zip(PASSES, pass_s)),
        "disk_profile": dict(zip(PASSES, profile)) if profile else None,
        "reference_train_s": train_s,
        "wall_s": wall,
        "rows": rows,
        "trials": [asdict(t) for t in trials],
    }
    print(f"wrote {save('bench_faults', payload)}")


if __name__ == "__main__":
    main()
