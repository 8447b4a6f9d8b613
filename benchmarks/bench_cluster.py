"""build-index on a Ray cluster against a local build with the same cores: the first MB of pydocs
(above its 62 MB, copies of it with shuffled lines, as in bench_scale), byte-level, built with
``--workers 2`` locally and with ``--workers 2 --cluster ADDRESS`` on two Ray nodes of 1 CPU each
on this machine (``ray.cluster_utils``). Checks that both give the same files.

    pip install -e '.[cluster]'
    python benchmarks/bench_cluster.py [--mb 8,62,1000] [--shard-tokens 2097152]

Prints a table and writes benchmarks/results/bench_cluster.json. Wall times are of the whole
``build-index`` command (the cluster's: connecting and starting its workers included, starting the
cluster not); peak RSS is left out, as Ray's workers are not the command's children.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import time
from pathlib import Path

from bench_build import write_copies
from bench_scale import PYDOCS_BYTES
from common import CACHE, PYDOCS, TERALM, run_measured, save, table

from teralm.files import sha256_file

STORE_BYTES = 200 << 20


def make_corpus(mb: int) -> Path:
    """The first pydocs documents that add up to ``mb`` MB of text, as JSONL; above pydocs'
    size, copies of it with shuffled lines (as ``bench_scale``)."""
    if not PYDOCS.exists():
        sys.exit(f"{PYDOCS} not found: the benchmark reads the team's shared data folder")
    path = CACHE / "cluster" / f"pydocs-{mb}mb.jsonl"
    if mb * 1_000_000 > PYDOCS_BYTES:
        write_copies(path, round(mb * 1_000_000 / PYDOCS_BYTES))
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, total = path.with_suffix(".part"), 0
    with gzip.open(PYDOCS, "rt") as f, open(tmp, "w") as out:
        for line in f:
            if total >= mb * 1_000_000:
                break
            out.write(line)
            total += len(json.loads(line)["text"].encode())
    os.replace(tmp, path)
    return path


def content(index: Path) -> dict[str, str]:
    """sha256 of every index file but the catalog and the manifest (timings): equal between
    two builds."""
    files = [p for p in sorted(index.iterdir()) if p.is_file() and p.name != "manifest.json"]
    return {p.name: sha256_file(p) for p in files}


def build(corpus: Path, out: Path, shard_tokens: int, *flags: str) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [*TERALM, "build-index", corpus, "--out", out, "--shard-tokens", shard_tokens]
    run = run_measured([*map(str, cmd), "--workers", "2", "--quiet", *flags])
    if run["returncode"]:
        sys.exit(f"build-index {' '.join(flags)} failed:\n{run['output']}")
    m = json.loads((out / "manifest.json").read_text())
    stats = json.loads((out / "build-stats.json").read_text())
    passes = {f"{name}_s": p["wall_s"] for name, p in stats["passes"].items()}
    return {
        "wall_s": run["wall_s"],
        "tokens": m["num_tokens"],
        "shards": len(m["shards"]),
        **passes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", default="8,62", help="corpus sizes, MB of pydocs text")
    parser.add_argument("--shard-tokens", type=int, default=1 << 21)
    args = parser.parse_args()
    from ray.cluster_utils import Cluster

    began = time.perf_counter()
    nodes = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": STORE_BYTES}
    )
    nodes.add_node(num_cpus=1, object_store_memory=STORE_BYTES)
    started_s = time.perf_counter() - began
    rows = []
    try:
        for mb in map(int, args.mb.split(",")):
            corpus = make_corpus(mb)
            work = CACHE / "cluster" / f"{mb}mb"
            local = build(corpus, work / "local", args.shard_tokens)
            remote = build(corpus, work / "cluster", args.shard_tokens, "--cluster", nodes.address)
            same = content(work / "local") == content(work / "cluster")
            if not same:
                sys.exit(f"{mb} MB: the cluster's index differs from the local build's")
            rows.append({"run": f"{mb} MB, local", **local})
            rows.append(
                {
                    "run": f"{mb} MB, 2 Ray nodes",
                    **remote,
                    "vs_local": remote["wall_s"] / local["wall_s"],
                }
            )
    finally:
        nodes.shutdown()
    columns = [
        ("run", "run", ""),
        ("tokens", "tokens", ","),
        ("shards", "shards", "d"),
        ("wall_s", "wall s", ".1f"),
        ("tokenize_s", "tokenize", ".1f"),
        ("sort_s", "sort", ".1f"),
        ("features_s", "features", ".1f"),
        ("vs_local", "vs local", ".2f"),
    ]
    print(f"Ray cluster of 2 nodes x 1 CPU started in {started_s:.1f} s (not counted below)")
    print(table(rows, columns))
    path = save("bench_cluster", {"cluster_start_s": started_s, "rows": rows, **vars(args)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
