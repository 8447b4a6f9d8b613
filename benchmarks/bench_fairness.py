"""Serving under a mixed load: does a small request wait behind a large one, and does a seeded
request give the same text whatever else runs?

    python benchmarks/bench_fairness.py [--repeats 5] [--large-tokens 1024] [--tries 3]

A ``teralm serve`` of bench_serve's run (bench_quality's tiny run, or a short one trained here)
on 127.0.0.1, with drafts from the index (the default) and without (``--speculate 0``). For each:
the latency of a 16-token request (temperature 0.8) alone and while one streamed request of
8 prompts x ``n`` 8 x ``--large-tokens`` tokens runs (the median of ``--repeats``; target: beside
<= 3x alone); then a seeded request (seed 1234, ``n`` 3, temperature 0.9, 64 tokens) alone and
``--tries`` times beside 3 other clients sending sampled requests (target: the same text every
time). Prints a table and writes benchmarks/results/bench_fairness.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

from bench_serve import post, trained_run
from common import save, serve_process, table

SMALL = {"prompt": "def main(", "max_tokens": 16, "temperature": 0.8}
SEEDED = {"prompt": "import os\n", "max_tokens": 64, "temperature": 0.9, "seed": 1234, "n": 3}
LARGE_PROMPTS = ["class ", "def ", "import ", "for i in ", "with open(", "try:\n", "# ", "if "]


def complete(port: int, body: dict) -> dict:
    conn, response = post(port, body)
    answer = json.loads(response.read())
    conn.close()
    if response.status != 200:
        raise SystemExit(f"the server answered {response.status}: {answer}")
    return answer


def latency(port: int, repeats: int) -> float:
    """The median seconds of ``repeats`` small requests."""
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        complete(port, SMALL)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def beside_large(port: int, tokens: int, measure):
    """``measure()`` while one streamed request of 64 long sequences runs."""
    body = {"prompt": LARGE_PROMPTS, "n": 8, "max_tokens": tokens, "stream": True}
    conn, response = post(port, body)
    response.readline()  # its first event: its sequences are in the batch
    try:
        return measure()
    finally:
        conn.close()


def seeded_under_load(port: int, tries: int) -> tuple[int, int]:
    """How many of ``tries`` seeded requests beside 3 busy clients gave the text it gives
    alone, and how many were made."""
    want = [c["text"] for c in complete(port, SEEDED)["choices"]]
    same, stop = 0, threading.Event()

    def busy(k: int) -> None:
        i = k
        while not stop.is_set():
            complete(port, {"prompt": LARGE_PROMPTS[i % 8], "max_tokens": 48, "temperature": 1.0})
            i += 3

    clients = [threading.Thread(target=busy, args=(k,), daemon=True) for k in range(3)]
    for c in clients:
        c.start()
    try:
        for _ in range(tries):
            time.sleep(0.2)
            same += [c["text"] for c in complete(port, SEEDED)["choices"]] == want
    finally:
        stop.set()
        for c in clients:
            c.join(timeout=120)
    return same, tries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--large-tokens", type=int, default=1024)
    parser.add_argument("--tries", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="steps of a run trained here")
    args = parser.parse_args()
    run, index = trained_run(args.steps)
    rows = []
    for label, flags in (("drafts (default)", []), ("--speculate 0", ["--speculate", "0"])):
        with serve_process(run, index, *flags) as (port, _):
            complete(port, SMALL)  # warm
            alone = latency(port, args.repeats)
            beside = beside_large(port, args.large_tokens, lambda: latency(port, args.repeats))
            same, tries = seeded_under_load(port, args.tries)
        rows.append(
            {
                "server": label,
                "alone_ms": alone * 1e3,
                "beside_ms": beside * 1e3,
                "ratio": beside / alone,
                "seeded_same": f"{same}/{tries}",
            }
        )
        print(rows[-1], flush=True)
    print(
        table(
            rows,
            [
                ("server", "server", "s"),
                ("alone_ms", "16 tokens alone ms", ".1f"),
                ("beside_ms", "beside 64 x 1024 ms", ".1f"),
                ("ratio", "ratio (<= 3)", ".2f"),
                ("seeded_same", "seeded, same text under load", "s"),
            ],
        )
    )
    print(f"wrote {save('bench_fairness', {'args': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
