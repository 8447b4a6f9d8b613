"""Build-index benchmark: teralm's full causal build against infini-gram and tokengrams indexing the
same bytes, on pydocs (62 MB) and on a ~1 GB stream made from it.

    pip install -e '.[bench]'          # the peers: infini-gram, tokengrams
    python benchmarks/bench_build.py [--sizes pydocs,1gb] [--workers 2] [--no-peers]

Prints a table per corpus and writes benchmarks/results/bench_build.json.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import shutil
import sys
from pathlib import Path

import numpy as np
from common import CACHE, SHARED_DATA, run_measured, save, table

PYDOCS = SHARED_DATA / "pydocs.jsonl.gz"
COPIES_1GB = 16


def make_corpora(sizes: list[str]) -> dict[str, Path]:
    """JSONL files (one per corpus, each alone in a folder, as infini-gram wants)."""
    corpora = {}
    for name in sizes:
        corpora[name] = CACHE / name / "data" / f"{name}.jsonl"
        write_copies(corpora[name], 1 if name == "pydocs" else COPIES_1GB)
    return corpora


def write_copies(path: Path, copies: int) -> None:
    """``path``: ``copies`` copies of pydocs as JSONL, each after the first with the lines of
    every document in another order (kept when it exists)."""
    if path.exists():
        return
    if not PYDOCS.exists():
        sys.exit(f"{PYDOCS} not found: the benchmark reads the team's shared data folder")
    with gzip.open(PYDOCS, "rt") as f:
        docs = [json.loads(line)["text"] for line in f]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    with open(tmp, "w") as out:
        for copy in range(copies):
            rng = np.random.default_rng(copy)
            for i, text in enumerate(docs):
                if copy:  # each later copy with its lines in another order
                    lines = text.split("\n")
                    text = "\n".join(lines[j] for j in rng.permutation(len(lines)))
                out.write(json.dumps({"id": copy * len(docs) + i, "text": text}) + "\n")
    os.replace(tmp, path)


def corpus_bytes(jsonl: Path) -> tuple[int, int]:
    """(UTF-8 bytes of all texts, documents)."""
    total = docs = 0
    with open(jsonl) as f:
        for line in f:
            total += len(json.loads(line)["text"].encode())
            docs += 1
    return total, docs


def bench_teralm(jsonl: Path, out: Path, workers: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "teralm.cli",
        "build-index",
        str(jsonl),
        "--out",
        str(out),
        "--workers",
        str(workers),
        "--quiet",
    ]
    run = run_measured(cmd)
    if run["returncode"]:
        raise SystemExit(f"teralm build failed:\n{run['output']}")
    m = json.loads((out / "manifest.json").read_text())
    return {
        "tool": "teralm (causal)",
        **run,
        "tokens": m["num_tokens"],
        "bytes_per_token": m["bytes_per_token"],
        "passes": json.loads((out / "build-stats.json").read_text())["passes"],
        "shards": len(m["shards"]),
    }


def bench_infini_gram(jsonl: Path, out: Path, workers: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    mem_gib = max(1, int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30) - 4)
    cmd = [
        sys.executable,
        "-m",
        "infini_gram.indexing",
        "--data_dir",
        str(jsonl.parent.resolve()),
        "--save_dir",
        str(out.resolve()),
        "--token_dtype",
        "u8",
        "--cpus",
        str(workers),
        "--mem",
        str(mem_gib),
        "--ulimit",
        str(hard),
    ]
    run = run_measured(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if run["returncode"]:  # e.g. transformers missing: pip install -e '.[bench]'
        raise SystemExit(f"infini-gram's indexer failed:\n{run['output'][-2000:]}")
    files = {p.name: p.stat().st_size for p in out.iterdir()} if out.exists() else {}
    tokens = files.get("tokenized.0", 0)
    by_kind = {
        "tokens": files.get("tokenized.0", 0),
        "suffix array": files.get("table.0", 0),
        "offsets": files.get("offset.0", 0),
    }
    bpt = {k: v / tokens for k, v in by_kind.items()} if tokens else {}
    if bpt:
        bpt["total"] = sum(by_kind.values()) / tokens
    return {"tool": "infini-gram", **run, "tokens": tokens, "bytes_per_token": bpt}


def bench_tokengrams(jsonl: Path, out: Path, max_tokens: int) -> dict:
    """tokengrams has no u8 tokens: the bytes are widened to u16 first (not timed)."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    data = bytearray()
    with open(jsonl) as f:
        for line in f:
            data += json.loads(line)["text"].encode()
    if len(data) > max_tokens:
        return {
            "tool": "tokengrams",
            "skipped": f"{len(data):,} tokens: its in-memory build "
            f"(10 B/token on disk, more in RAM) would not fit this machine",
        }
    np.frombuffer(bytes(data), np.uint8).astype(np.uint16).tofile(out / "tokens.u16")
    del data
    code = (
        "from tokengrams import MemmapIndex; "
        f"MemmapIndex.build({str(out / 'tokens.u16')!r}, {str(out / 'index.idx')!r}, "
        "vocab=256, verbose=False)"
    )
    run = run_measured([sys.executable, "-c", code])
    tokens = (out / "tokens.u16").stat().st_size // 2
    sizes = {
        "tokens": (out / "tokens.u16").stat().st_size,
        "suffix array": (out / "index.idx").stat().st_size,
    }
    bpt = {k: v / tokens for k, v in sizes.items()}
    bpt["total"] = sum(sizes.values()) / tokens
    return {"tool": "tokengrams", **run, "tokens": tokens, "bytes_per_token": bpt}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="pydocs,1gb")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--tokengrams-max-tokens", type=int, default=300_000_000)
    args = parser.parse_args()
    corpora = make_corpora(args.sizes.split(","))
    results = {}
    for name, jsonl in corpora.items():
        n_bytes, n_docs = corpus_bytes(jsonl)
        work = CACHE / name
        rows = [bench_teralm(jsonl, work / "teralm-index", args.workers)]
        if not args.no_peers:
            rows.append(bench_infini_gram(jsonl, work / "infini-gram-index", args.workers))
            rows.append(
                bench_tokengrams(jsonl, work / "tokengrams-index", args.tokengrams_max_tokens)
            )
        for r in rows:
            if "wall_s" in r:
                r["ns_per_token"] = r["wall_s"] / n_bytes * 1e9
                r["mtok_s"] = n_bytes / r["wall_s"] / 1e6
                r["peak_gib"] = r["peak_rss"] / 2**30
                r["bpt_total"] = r["bytes_per_token"].get("total")
        results[name] = {"bytes": n_bytes, "documents": n_docs, "rows": rows}
        print(f"\n{name}: {n_bytes:,} bytes, {n_docs:,} documents, {args.workers} workers")
        print(
            table(
                rows,
                [
                    ("tool", "tool", "s"),
                    ("wall_s", "wall s", ".1f"),
                    ("peak_gib", "peak GiB", ".2f"),
                    ("mtok_s", "Mtok/s", ".2f"),
                    ("ns_per_token", "ns/token", ".0f"),
                    ("bpt_total", "B/token", ".2f"),
                ],
            )
        )
        for r in rows:
            if "skipped" in r:
                print(f"  {r['tool']}: skipped ({r['skipped']})")
            elif r.get("returncode"):
                print(f"  {r['tool']}: FAILED\n{r['output']}")
            else:
                files = ", ".join(f"{k} {v:.2f}" for k, v in r["bytes_per_token"].items())
                print(f"  {r['tool']} bytes/token: {files}")
        teralm = rows[0]
        print(
            "  teralm passes: "
            + ", ".join(
                f"{k} {v['wall_s']:.1f} s / {v['peak_rss'] / 2**30:.2f} GiB"
                for k, v in teralm["passes"].items()
            )
        )
    if len(results) > 1:
        small, large = (results[k]["rows"][0] for k in list(results)[:2])
        print(
            f"\ngrowth {list(results)[0]} -> {list(results)[1]}: ns/token x"
            f"{large['ns_per_token'] / small['ns_per_token']:.2f}, peak RSS x"
            f"{large['peak_rss'] / small['peak_rss']:.2f} for x"
            f"{large['tokens'] / small['tokens']:.1f} tokens"
        )
    for r in (r for v in results.values() for r in v["rows"]):
        r.pop("output", None)
    print(f"\nwrote {save('bench_build', results)}")


if __name__ == "__main__":
    main()
