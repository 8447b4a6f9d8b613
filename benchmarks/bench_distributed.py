"""Data-parallel training: the four gradient exchanges against one process, in one run.

    pip install -e .
    python benchmarks/bench_distributed.py [--steps 300] [--processes 4] [--lr 1e-3]
        [--demo-lr 2e-3] [--demo-topk 16] [--link-steps 8]

Part 1 trains the ``tiny`` preset on pydocs with the index (equal steps, global batch and
tokens) as one process and as ``--processes`` processes under torchrun on 127.0.0.1 with each
``--comm`` (``onebit`` at ``--lr``, ``demo`` at ``--demo-lr``, ``allreduce`` at both ``--lr`` and
the preset's, DeMo once more with ``--demo-topk``), then scores every run on the held-out documents (``teralm
eval``). It reports held-out bits per byte, the bytes each rank sent per step (as logged in
``metrics.jsonl``) and wall time.

Part 2 (root only; ``--no-link`` skips it) runs 2 processes in two network namespaces joined by a
veth pair shaped by ``tc`` to a consumer link: 10 Mbit/s up from the "home" side, 100 Mbit/s
down to it, and 20 ms round trip where the kernel has ``netem`` (where it has not, the rates
only, and the table says so). The namespaces are made and removed here; no traffic leaves the
machine. It reports the wall time per step of each exchange.

Prints tables and writes benchmarks/results/bench_distributed.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from common import CACHE, corpus_index, free_port, run_measured, save, table, teralm_cli

from teralm.train.report import read_metrics

WORK = CACHE / "distributed"
METHODS = ("allreduce", "onebit", "powersgd", "demo")
HOME, PEER = ("tl-home", "tl-veth-home", "10.77.0.1"), ("tl-peer", "tl-veth-peer", "10.77.0.2")


def torchrun(nodes: int, per_node: int, master: str, port: int, rank: int = 0) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
        "--nproc-per-node", str(per_node), "--node-rank", str(rank), "--master-addr", master,
        "--master-port", str(port), "-m", "teralm.cli",
    ]  # fmt: skip


def train_args(index: Path, run: Path, steps: int, comm: str, *extra) -> list[str]:
    args = ["train", "--index", index, "--out", run, "--max-steps", steps, "--comm", comm]
    return [*map(str, [*args, "--checkpoint-every", steps, *extra]), "--quiet"]


def per_step_bytes(run: Path) -> tuple[float, int]:
    """Mean bytes rank 0 sent per logged step, and in the last one (PowerSGD's first steps
    are plain all-reduce)."""
    sent = [r["sent_bytes"] for r in read_metrics(run)]
    return sum(sent) / len(sent), sent[-1]


def part_one(
    index: Path, steps: int, processes: int, max_tokens: int, lr: float, demo_lr: float, topk: int
):
    """One process and ``processes`` with each exchange: held-out bpb, bytes, wall time.

    ``onebit`` trains at ``lr``, ``demo`` at ``demo_lr`` (its sign steps move every weight by the
    whole rate). ``allreduce`` runs at the preset's rate and at ``lr``, so that neither compared
    run is at a rate that suits only it."""
    lower = ["--lr", lr]
    runs = [
        ("1 process", "allreduce", 1, []),
        (f"{processes} × allreduce", "allreduce", processes, []),
    ]
    runs.append((f"{processes} × allreduce lr={lr:g}", "allreduce", processes, lower))
    runs.append((f"{processes} × onebit lr={lr:g}", "onebit", processes, lower))
    runs.append((f"{processes} × powersgd", "powersgd", processes, []))
    demo = ["--lr", demo_lr]
    runs.append((f"{processes} × demo lr={demo_lr:g}", "demo", processes, demo))
    if topk:
        extra = [*demo, "--demo-topk", topk]
        runs.append((f"{processes} × demo k={topk} lr={demo_lr:g}", "demo", processes, extra))
    rows = []
    for name, comm, world, extra in runs:
        run = WORK / "".join(c if c.isalnum() or c in "-." else "-" for c in name)
        shutil.rmtree(run, ignore_errors=True)
        launcher = torchrun(1, world, "127.0.0.1", free_port()) if world > 1 else [
            sys.executable, "-m", "teralm.cli",
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"} if world > 1 else None
        args = train_args(index, run, steps, comm, "--preset", "tiny", *extra)
        measured = run_measured([*launcher, *args], env=env)
        if measured["returncode"]:
            sys.exit(f"{name} failed:\n{measured['output']}")
        scored = json.loads(
            teralm_cli("eval", run, "--index", index, "--max-tokens", max_tokens, "--json", "--quiet")
        )  # fmt: skip
        mean, last = per_step_bytes(run) if world > 1 else (0.0, 0)
        rows.append(
            {
                "run": name, "comm": comm, "processes": world, "bpb": scored["model"],
                "bytes_per_step": mean, "bytes_last_step": last,
                "train_wall_s": read_metrics(run)[-1]["elapsed_s"],
                "wall_s": measured["wall_s"], "peak_rss_gib": measured["peak_rss"] / 2**30,
            }
        )  # fmt: skip
        print(f"  {name}: bpb {scored['model']:.4f}, {mean:,.0f} B/step", flush=True)
    reference = rows[1]  # allreduce on as many processes, at the preset's rate
    for row in rows:
        if row["processes"] > 1:
            row["fewer_bytes"] = reference["bytes_per_step"] / row["bytes_per_step"]
            row["fewer_bytes_last"] = reference["bytes_last_step"] / row["bytes_last_step"]
        row["bpb_vs_one"] = row["bpb"] / rows[0]["bpb"] - 1
    return rows


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _shape(namespace: str, device: str, rate: str, delay: bool) -> None:
    """Egress of ``device`` at ``rate``, through netem with 10 ms delay if asked."""
    qdisc = ["netem", "delay", "10ms", "rate", rate, "limit", "100000"] if delay else [
        "tbf", "rate", rate, "burst", "64kb", "latency", "2s",
    ]  # fmt: skip
    subprocess.run(
        ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", *qdisc],
        check=True, capture_output=True,
    )  # fmt: skip


def has_netem() -> bool:
    """Whether this kernel can add delay (sch_netem), tried on a throwaway namespace."""
    with namespaces(delay=False, probe=True) as ok:
        return ok


@contextlib.contextmanager
def namespaces(delay: bool, probe: bool = False) -> Iterator[bool]:
    """Two network namespaces joined by a shaped veth pair, removed on exit."""
    try:
        for name, _, _ in (HOME, PEER):
            _ip("netns", "add", name)
        _ip("link", "add", HOME[1], "netns", HOME[0], "type", "veth", "peer", "name", PEER[1],
            "netns", PEER[0])  # fmt: skip
        for name, device, address in (HOME, PEER):
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", device)
            _ip("-n", name, "link", "set", device, "up")
            _ip("-n", name, "link", "set", "lo", "up")
        if probe:
            try:
                _shape(HOME[0], HOME[1], "10mbit", delay=True)
                yield True
            except subprocess.CalledProcessError:
                yield False
            return
        _shape(HOME[0], HOME[1], "10mbit", delay)  # the home side's upload
        _shape(PEER[0], PEER[1], "100mbit", delay)  # its download
        yield True
    finally:
        for name, _, _ in (HOME, PEER):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def part_two(index: Path, steps: int) -> tuple[list[dict], bool]:
    """Wall time per step of 2 processes over the shaped link, for each exchange."""
    delay = has_netem()
    config = WORK / "link.toml"  # the tiny preset, logging every step
    config.write_text(
        '[model]\nn_layer = 4\nn_head = 4\nd_model = 256\nmax_seq_len = 256\nprecision = "auto"\n'
        "[train]\nbatch_size = 16\nseq_len = 256\nlr = 3e-3\nwarmup_steps = 50\nlog_every = 1\n"
    )
    rows = []
    for comm in METHODS:
        run = WORK / f"link-{comm}"
        shutil.rmtree(run, ignore_errors=True)
        port = free_port()
        with namespaces(delay):
            procs = []
            for rank, (name, device, _) in enumerate((HOME, PEER)):
                env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": device}
                out = run if rank == 0 else WORK / f"link-{comm}-peer"
                cmd = [
                    "ip", "netns", "exec", name, *torchrun(2, 1, HOME[2], port, rank),
                    *train_args(index, out, steps, comm, "--config", config,
                                "--powersgd-warmup", 2, "--onebit-warmup", 2),
                ]  # fmt: skip
                procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True))  # fmt: skip
            outputs = [p.communicate(timeout=3600)[0] for p in procs]
            if any(p.returncode for p in procs):
                sys.exit(f"link run {comm} failed:\n" + "\n".join(o[-2000:] for o in outputs))
        shutil.rmtree(WORK / f"link-{comm}-peer", ignore_errors=True)
        records = read_metrics(run)
        timed = records[2:]  # past start-up and the 2 warm-up steps of PowerSGD and 1-bit Adam
        per_step = (timed[-1]["elapsed_s"] - records[1]["elapsed_s"]) / len(timed)
        rows.append(
            {
                "comm": comm, "s_per_step": per_step,
                "bytes_per_step": sum(r["sent_bytes"] for r in timed) / len(timed),
            }
        )  # fmt: skip
        print(f"  link {comm}: {per_step:.2f} s/step", flush=True)
    return rows, delay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=100_000)
    parser.add_argument("--link-steps", type=int, default=8, help="steps of each link run")
    parser.add_argument(
        "--lr", type=float, default=1e-3, help="learning rate of onebit (and allreduce)"
    )
    parser.add_argument("--demo-lr", type=float, default=2e-3, help="learning rate of demo")
    parser.add_argument(
        "--demo-topk", type=int, default=16, help="one more DeMo run with this k (0: none)"
    )
    parser.add_argument("--no-link", action="store_true", help="skip the shaped-link runs")
    args = parser.parse_args()
    _, index = corpus_index("pydocs")
    WORK.mkdir(parents=True, exist_ok=True)

    print(f"part 1: tiny preset, {args.steps} steps, global batch 16 x 256 tokens", flush=True)
    rows = part_one(
        index, args.steps, args.processes, args.max_tokens, args.lr, args.demo_lr, args.demo_topk
    )
    print(
        table(
            rows,
            [
                ("run", "run", "s"), ("bpb", "held-out bpb", ".4f"),
                ("bpb_vs_one", "vs 1 process", "+.2%"),
                ("bytes_per_step", "bytes/step/rank", ",.0f"),
                ("fewer_bytes", "x fewer", ".1f"), ("fewer_bytes_last", "x fewer (last)", ".1f"),
                ("train_wall_s", "train s", ".0f"),
            ],
        )
    )  # fmt: skip
    link, delay = ([], False) if args.no_link or os.geteuid() else part_two(index, args.link_steps)
    if link:
        latency = "20 ms round trip" if delay else "no added delay (this kernel has no netem)"
        print(f"part 2: 2 processes, 10 Mbit/s up, 100 Mbit/s down, {latency}")
        print(
            table(
                link,
                [("comm", "comm", "s"), ("s_per_step", "s/step", ".2f"),
                 ("bytes_per_step", "bytes/step/rank", ",.0f")],
            )
        )  # fmt: skip
    payload = {"steps": args.steps, "processes": args.processes, "rows": rows, "link": link}
    payload["link_delay"] = delay
    print(f"wrote {save('bench_distributed', payload)}")


if __name__ == "__main__":
    main()
