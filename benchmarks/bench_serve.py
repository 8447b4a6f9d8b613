"""Serving benchmark on the CPU: the tiny model with the pydocs index behind `teralm serve`.

    python benchmarks/bench_quality.py        # trains the tiny model this uses (once)
    python benchmarks/bench_serve.py [--clients 32] [--seconds 60] [--max-tokens 32]

Single stream: time to first token and tokens/s of one streamed completion. Then ``--clients``
concurrent clients send completions for ``--seconds``: throughput, p50/p99 latency, errors, and the
share of the engine's time spent in index lookups (from /metrics). Prints a table, writes
benchmarks/results/bench_serve.json.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from common import CACHE, save, table

QUALITY = CACHE / "quality"


def post(port: int, body: dict):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def metrics(port: int) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    return {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def single_stream(port: int, prompt: str, tokens: int) -> dict:
    began = time.perf_counter()
    conn, response = post(
        port, {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True}
    )
    first, count = None, 0
    for line in response:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        if first is None:
            first = time.perf_counter() - began
        count += 1
    total = time.perf_counter() - began
    conn.close()
    return {"ttft_ms": first * 1e3, "tok_per_s": (count - 1) / (total - first)}


def load(port: int, prompts: list[str], clients: int, seconds: float, max_tokens: int) -> dict:
    latencies, errors, tokens = [], [0], [0]
    lock = threading.Lock()
    stop_at = time.perf_counter() + seconds

    def client(k: int) -> None:
        i = k
        while time.perf_counter() < stop_at:
            began = time.perf_counter()
            try:
                conn, response = post(
                    port,
                    {
                        "prompt": prompts[i % len(prompts)],
                        "max_tokens": max_tokens,
                        "temperature": 0.8,
                        "seed": i,
                    },
                )
                answer = json.loads(response.read())
                conn.close()
                ok = response.status == 200
            except OSError:
                ok, answer = False, {}
            with lock:
                if ok:
                    latencies.append(time.perf_counter() - began)
                    tokens[0] += answer["usage"]["completion_tokens"]
                else:
                    errors[0] += 1
            i += clients

    before = metrics(port)
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    after = metrics(port)
    lookup = (
        after["teralm_index_lookup_seconds_total"] - before["teralm_index_lookup_seconds_total"]
    )
    model = after["teralm_model_seconds_total"] - before["teralm_model_seconds_total"]
    lat = np.array(latencies) * 1e3
    return {
        "requests": len(latencies),
        "errors": errors[0],
        "tok_per_s": tokens[0] / wall,
        "p50_ms": float(np.percentile(lat, 50)) if len(lat) else None,
        "p99_ms": float(np.percentile(lat, 99)) if len(lat) else None,
        "lookup_share": lookup / max(lookup + model, 1e-9),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, default=QUALITY / "run-index")
    parser.add_argument("--index", type=Path, default=QUALITY / "index")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    if not (args.run / "latest.json").exists():
        sys.exit(f"no trained run at {args.run}: run benchmarks/bench_quality.py first")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "teralm.cli",
        "serve",
        "--index",
        str(args.index),
        "--run",
        str(args.run),
        "--port",
        str(port),
        "--max-batch",
        str(args.clients),
    ]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            try:
                metrics(port)
                break
            except OSError:
                time.sleep(0.5)
        from teralm.index import Index

        ix = Index.open(args.index)
        held = [ix.document_range(d) for d in range(0, ix.num_documents, 50)]
        prompts = [ix.decode(ix.tokens(a + 100, a + 164)) for a, b in held if b - a > 200]
        single = single_stream(port, prompts[0], 128)
        under_load = load(port, prompts, args.clients, args.seconds, args.max_tokens)
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(
        f"tiny model ({args.run}) with the pydocs index on the CPU; prompts of 64 bytes from "
        f"held-out documents"
    )
    print(
        f"single stream: time to first token {single['ttft_ms']:.0f} ms, "
        f"{single['tok_per_s']:.1f} tokens/s"
    )
    print(
        table(
            [{"clients": str(args.clients), **under_load}],
            [
                ("clients", "clients", "s"),
                ("requests", "requests", "d"),
                ("errors", "errors", "d"),
                ("tok_per_s", "tokens/s", ".1f"),
                ("p50_ms", "p50 ms", ".0f"),
                ("p99_ms", "p99 ms", ".0f"),
                ("lookup_share", "lookup share", ".1%"),
            ],
        )
    )
    print(
        f"wrote {save('bench_serve', {'single': single, 'load': under_load, 'clients': args.clients, 'seconds': args.seconds})}"
    )


if __name__ == "__main__":
    main()
