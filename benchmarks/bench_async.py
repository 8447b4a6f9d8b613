"""DiLoCo on torchft against synchronous all-reduce, with a worker that dies and comes back.

    pip install -e '.[ft]'
    python benchmarks/bench_async.py [--steps 300] [--workers 4] [--inner-steps 50]
        [--link-steps 100] [--no-link]

Part 1 trains the ``tiny`` preset on pydocs with the index, equal steps, global batch and
tokens, in one run: ``--workers`` processes under torchrun with ``--comm allreduce`` (the
reference), then as many DiLoCo workers (``--lighthouse auto``) with ``--inner-steps`` steps a
round and each ``--outer-compress`` (none, onebit, demo), then the demo run again with worker 3
killed (SIGKILL) once the run passes 30% of its steps and started again with ``--resume`` at
60%. Every run is scored on the held-out documents (``teralm eval``). It reports held-out bits
per byte, the bytes each worker sent in all (from ``metrics.jsonl``: every step of the
all-reduce run, every round of the DiLoCo ones) and wall time.

Part 2 (root only) repeats the all-reduce run and the two DiLoCo runs that sent least, with 2
workers in two network namespaces joined by a veth pair shaped by ``tc`` to a consumer link
(10 Mbit/s up, 100 Mbit/s down, 20 ms round trip where the kernel has netem), and reports the
wall time per step of each. The namespaces are made and removed by bench_distributed's helpers.

Prints tables and writes benchmarks/results/bench_async.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench_distributed import HOME, PEER, has_netem, namespaces, torchrun
from bench_distributed import train_args as sync_train_args
from common import CACHE, corpus_index, free_port, run_measured, save, table, teralm_cli

from teralm.train.diloco import lighthouse_server, worker_threads
from teralm.train.report import read_metrics

WORK = CACHE / "async"
TERALM = [sys.executable, "-m", "teralm.cli"]
COMPRESSIONS = ("none", "onebit", "demo")


def train_args(index: Path, run: Path, steps: int, *extra) -> list[str]:
    """The tiny preset's ``teralm train`` arguments (comm allreduce, which DiLoCo leaves as is)."""
    return sync_train_args(index, run, steps, "allreduce", "--preset", "tiny", *extra)


def diloco_args(inner: int, workers: int, compress: str) -> list:
    flags = ["--mode", "diloco", "--replicas", workers, "--inner-steps", inner]
    return [*flags, "--outer-compress", compress]


def total_sent(run: Path, steps: int) -> int:
    """Bytes the writing worker (or rank 0) sent in all: the logged step's bytes times the steps
    for the all-reduce run (every step sends as much), the sum over the records of a DiLoCo
    run (the last record of each round carries the round's bytes)."""
    records = read_metrics(run)
    if "workers" not in records[0]:
        return records[-1]["sent_bytes"] * steps
    return sum(r["sent_bytes"] for r in records)


def killed_run(index: Path, run: Path, steps: int, extra: list, workers: int) -> float:
    """The DiLoCo run with worker ``workers - 1`` killed at 30% of the steps and started again
    with --resume at 60%: its wall time."""
    env = {**os.environ, "OMP_NUM_THREADS": str(worker_threads(workers))}
    began = time.perf_counter()
    with lighthouse_server("127.0.0.1:0", min_replicas=1) as url:

        def start(replica: int, *more: str) -> subprocess.Popen:
            args = [*train_args(index, run, steps, *extra), "--lighthouse", url]
            command = [*TERALM, *args, "--replica-id", str(replica), *more]
            return subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)

        procs = [start(r) for r in range(workers)]

        def reached(fraction: float) -> bool:
            records = read_metrics(run) if (run / "metrics.jsonl").exists() else []
            return bool(records) and records[-1]["step"] >= fraction * steps

        while not reached(0.3):
            time.sleep(0.5)
        procs[-1].send_signal(signal.SIGKILL)
        procs[-1].wait()
        print(f"  worker {workers - 1} killed at step {read_metrics(run)[-1]['step']}", flush=True)
        while not reached(0.6):
            time.sleep(0.5)
        procs[-1] = start(workers - 1, "--resume")
        print(f"  started again at step {read_metrics(run)[-1]['step']}", flush=True)
        for p in procs:
            _, err = p.communicate(timeout=7200)
            if p.returncode:
                sys.exit(f"a worker of the killed run failed:\n{err[-3000:]}")
    return time.perf_counter() - began


def part_one(index: Path, args: argparse.Namespace) -> list[dict]:
    steps, workers, inner = args.steps, args.workers, args.inner_steps
    runs = [("sync allreduce", "sync", [])]
    runs += [
        (f"diloco H={inner} {c}", "diloco", diloco_args(inner, workers, c)) for c in COMPRESSIONS
    ]
    runs.append((f"diloco H={inner} demo, worker killed", "killed", diloco_args(inner, workers, "demo")))  # fmt: skip
    rows = []
    for name, kind, extra in runs:
        run = WORK / "".join(c if c.isalnum() or c in "-." else "-" for c in name)
        shutil.rmtree(run, ignore_errors=True)
        if kind == "killed":
            wall = killed_run(index, run, steps, extra, workers)
        else:
            launcher = torchrun(1, workers, "127.0.0.1", free_port()) if kind == "sync" else TERALM
            command = [*launcher, *train_args(index, run, steps, *extra)]
            if kind == "diloco":
                command += ["--lighthouse", "auto"]
            env = {**os.environ, "OMP_NUM_THREADS": "1"} if kind == "sync" else None
            measured = run_measured(command, env=env)
            if measured["returncode"]:
                sys.exit(f"{name} failed:\n{measured['output']}")
            wall = measured["wall_s"]
        scored = json.loads(
            teralm_cli("eval", run, "--index", index, "--max-tokens", args.max_tokens, "--json", "--quiet")
        )  # fmt: skip
        sent = total_sent(run, steps)
        rows.append({"run": name, "bpb": scored["model"], "bytes_sent": sent, "wall_s": wall})
        print(f"  {name}: bpb {scored['model']:.4f}, {sent:,} bytes, {wall:.0f} s", flush=True)
    reference = rows[0]
    for row in rows:
        row["fewer_bytes"] = reference["bytes_sent"] / row["bytes_sent"]
        row["bpb_vs_sync"] = row["bpb"] / reference["bpb"] - 1
    clean = next(r for r in rows if r["run"] == runs[3][0])
    rows[-1]["bpb_vs_clean"] = rows[-1]["bpb"] / clean["bpb"] - 1
    return rows


def link_run(index: Path, name: str, steps: int, extra: list) -> dict:
    """2 workers, one in each shaped namespace (the lighthouse in the first): seconds per
    step."""
    run = WORK / f"link-{name}"
    for folder in (run, WORK / f"link-{name}-peer"):
        shutil.rmtree(folder, ignore_errors=True)
    diloco = "--mode" in map(str, extra)
    with namespaces(delay=has_netem()), contextlib.ExitStack() as held:
        url = None
        if diloco:
            port = free_port()
            house = subprocess.Popen(
                ["ip", "netns", "exec", HOME[0], *TERALM, "lighthouse", "--bind", f"{HOME[2]}:{port}"],
                stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            held.callback(house.kill)
            house.stdout.readline()  # it is up
            url = f"http://{HOME[2]}:{port}"
        port, procs = free_port(), []
        for rank, (space, device, address) in enumerate((HOME, PEER)):
            env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": device}
            out = run if rank == 0 else WORK / f"link-{name}-peer"
            args = train_args(index, out, steps, *extra)
            if diloco:
                places = ["--lighthouse", url, "--replica-id", rank, "--advertise", address]
                command = [*TERALM, *args, *map(str, places)]
            else:
                command = [*torchrun(2, 1, HOME[2], port, rank), *args]
            procs.append(subprocess.Popen(["ip", "netns", "exec", space, *command], env=env,
                                          stderr=subprocess.PIPE, text=True))  # fmt: skip
        errors = [p.communicate(timeout=7200)[1] for p in procs]
        if any(p.returncode for p in procs):
            sys.exit(f"link run {name} failed:\n" + "\n".join(e[-2000:] for e in errors))
    written = run if (run / "metrics.jsonl").exists() else WORK / f"link-{name}-peer"
    records = read_metrics(written)
    return {"run": name, "s_per_step": records[-1]["elapsed_s"] / records[-1]["step"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=100_000)
    parser.add_argument("--link-steps", type=int, default=100, help="steps of each DiLoCo link run")
    parser.add_argument("--no-link", action="store_true", help="skip the shaped-link runs")
    args = parser.parse_args()
    _, index = corpus_index("pydocs")
    WORK.mkdir(parents=True, exist_ok=True)
    print(f"part 1: tiny preset, {args.steps} steps, global batch 16 x 256, {args.workers} workers")
    rows = part_one(index, args)
    print(
        table(
            rows,
            [
                ("run", "run", "s"), ("bpb", "held-out bpb", ".4f"),
                ("bpb_vs_sync", "vs sync", "+.2%"), ("bytes_sent", "bytes/worker", ",.0f"),
                ("fewer_bytes", "x fewer", ",.0f"), ("wall_s", "wall s", ".0f"),
            ],
        )
    )  # fmt: skip
    killed = rows[-1]["bpb_vs_clean"]
    print(f"killed worker vs clean: {killed:+.2%} bpb (target within 5%)")
    link = []
    if not args.no_link and os.geteuid() == 0:
        best = sorted(rows[1:4], key=lambda r: r["bytes_sent"])[:2]
        inner = args.inner_steps
        plans = [("sync allreduce", 8, [])]
        plans += [
            (r["run"], args.link_steps, diloco_args(inner, 2, r["run"].split()[-1])) for r in best
        ]
        for name, steps, extra in plans:
            link.append(link_run(index, name.replace(" ", "-").replace("=", ""), steps, extra))
            print(f"  link {name}: {link[-1]['s_per_step']:.2f} s/step", flush=True)
        latency = "20 ms round trip" if has_netem() else "no added delay (no netem here)"
        print(f"part 2: 2 workers, 10 Mbit/s up, 100 Mbit/s down, {latency}")
        print(table(link, [("run", "run", "s"), ("s_per_step", "s/step", ".2f")]))
    payload = {"args": vars(args), "rows": rows, "link": link}
    print(f"wrote {save('bench_async', payload)}")


if __name__ == "__main__":
    main()
