"""Serving memory: resident set of `teralm serve` for a run and for its fp8 export.

    python benchmarks/bench_memory.py [--preset 125m] [--index DIR]

Saves a randomly initialised model of ``--preset``'s shape (with the index's vocabulary) as a
run, exports it with `teralm export-fp8`, then serves each with `teralm serve` on 127.0.0.1 and
reads the server's RSS after start and after one completion. The export keeps one byte per
matrix parameter in memory (teralm.infer.fp8), the run four. Prints a table, writes
benchmarks/results/bench_memory.json.
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import torch
from common import CACHE, ROOT, save, serve_process, table, teralm_cli

from teralm.index import Index
from teralm.model import Transformer, checkpoint
from teralm.train.config import PRESETS, RunConfig

MIB = 2**20
MAX_BATCH = 16  # teralm serve's default: the KV cache holds this many sequences


def make_run(preset: str, ix: Index, run: Path) -> int:
    """A checkpoint of a randomly initialised ``preset`` model for ``ix``; its parameter count."""
    shape = {**PRESETS[preset]["model"], "precision": "fp32"}
    shape.update(vocab_size=ix.vocab_size, max_match=ix.max_match)
    config = RunConfig.from_dict({**PRESETS[preset], "model": shape})
    model = Transformer(config.model)
    optimizer = torch.optim.AdamW(model.parameters())
    state = {"config": config.to_dict(), "index": ix.identity(), "tokens": 0, "wall_s": 0.0}
    checkpoint.save(run, 0, model, optimizer, state)
    return model.num_parameters()


def served_rss(index: Path, model: Path) -> dict:
    """RSS of a `teralm serve` of ``model`` once up, and after one 32-token completion."""
    began = time.perf_counter()
    with serve_process(model, index, "--max-batch", MAX_BATCH) as (port, server):
        up_s = time.perf_counter() - began
        idle = psutil.Process(server.pid).memory_info().rss
        body = b'{"prompt": "def main(", "max_tokens": 32}'
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
        )
        urllib.request.urlopen(request, timeout=600).read()
        busy = psutil.Process(server.pid).memory_info().rss
    return {"start_s": up_s, "rss_idle_mib": idle / MIB, "rss_after_mib": busy / MIB}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="125m", choices=list(PRESETS))
    parser.add_argument("--index", type=Path, default=ROOT / "runs" / "stdlib-index")
    args = parser.parse_args()
    if not args.index.exists():
        sys.exit(f"{args.index} not found: run `build-index stdlib --out {args.index}` first")
    work = CACHE / "memory"
    run, export = work / f"{args.preset}-run", work / f"{args.preset}-fp8"
    ix = Index.open(args.index)
    parameters = make_run(args.preset, ix, run)
    shape = PRESETS[args.preset]["model"]
    cache = MAX_BATCH * shape["n_layer"] * 2 * shape["max_seq_len"] * shape["d_model"] * 4
    teralm_cli("export-fp8", run, "--out", export)
    rows = []
    for label, path in (("run (fp32 weights)", run), ("fp8 export", export)):
        files = sum(
            p.stat().st_size for p in path.rglob("*.safetensors") if "optimizer" not in p.name
        )
        rows.append({"model": label, "files_mib": files / MIB, **served_rss(args.index, path)})
    print(
        f"teralm serve, {args.preset} shape, {parameters:,} parameters, random weights; its fp32 "
        f"KV cache for --max-batch {MAX_BATCH} takes {cache / MIB:.0f} MiB in both\n"
    )
    print(
        table(
            rows,
            [
                ("model", "model", "s"),
                ("files_mib", "weights MiB", ".1f"),
                ("start_s", "start s", ".1f"),
                ("rss_idle_mib", "RSS idle MiB", ".0f"),
                ("rss_after_mib", "RSS after MiB", ".0f"),
            ],
        )
    )
    saved = save(
        "bench_memory",
        {
            "preset": args.preset,
            "parameters": parameters,
            "kv_cache_mib": cache / MIB,
            "rows": rows,
        },
    )
    print(f"\nwrote {saved}")


if __name__ == "__main__":
    main()
