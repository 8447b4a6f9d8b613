"""Index scale benchmark: a build inside a memory cgroup against an uncapped one, infini-gram on
the same bytes in the same run, and query latency against the shard count.

    pip install -e '.[bench]'          # infini-gram (and tokengrams, where it fits)
    sudo python benchmarks/bench_scale.py [--small 1gb] [--big 4gb] [--cgroup 2G]
        [--parts capped,identical,peers,shards,cold,pass1,profile] [--workers 2] [--shard-counts 1,8,58]
        [--bpe-corpus 256mb] [--pass1-tokenizers bytes,bpe:8192]

Corpora are byte-level JSONL streams made from pydocs as in bench_build.py (``Ngb``/``Nmb``: about
that many bytes of pydocs copies, each later copy with its lines shuffled). ``capped`` builds
``--big`` inside a cgroup of ``--cgroup`` bytes (page cache included; cgroup v1 or v2, needs root)
with ``--memory`` 3/4 of it, beside an uncapped build of ``--small``; ``identical`` builds ``--small``
capped as well and compares every file; ``peers`` runs infini-gram's indexer on ``--small``;
``shards`` builds ``--small`` with each of ``--shard-counts`` shards (1, 8 and 58) and times
bench_query's lookups (32-byte contexts from pydocs documents, and random bytes); ``cold`` times
lookups, training batches and decode steps on the ``--small`` index in the page cache and from a
memory cgroup of a quarter of the index's size, first with nothing read ahead, then with 2/3 of
the group holding the files lookups read first (``lookup_probe.py --memory``: pages read per
lookup; ``--keep-cold`` keeps that index); ``pass1`` times
pass 1 alone (read, tokenize, write the shards) on 1 process and on ``--workers``, byte-level on
``--small`` and BPE (``bpe:8192``, its model trained once beforehand) on ``--bpe-corpus``, and
checks that both write the same shards; ``profile`` builds each of ``--profile-sizes`` capped
and prints where pass 3's time went (its jobs' stages, reads and merge rounds, per token). Prints tables and writes
benchmarks/results/bench_scale_PARTS.json (PARTS: the parts run, joined by _).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np
from bench_build import bench_infini_gram, corpus_bytes, write_copies
from bench_query import CONTEXT, latency
from common import CACHE, TERALM, run_measured, save, table

from teralm.files import sha256_file
from teralm.index.format import BUILD_STATS, content_digests

WORK = CACHE / "scale"
PYDOCS_BYTES = 61_737_119


def make_corpus(name: str) -> Path:
    """``name`` is like 1gb or 256mb: that many bytes (rounded to whole pydocs copies)."""
    size = float(name[:-2]) * (1 << 30 if name.endswith("gb") else 1 << 20)
    path = WORK / name / "data" / f"{name}.jsonl"
    write_copies(path, max(1, round(size / PYDOCS_BYTES)))
    return path


class MemoryCgroup:
    """A memory cgroup of ``limit`` bytes (v2 when mounted, else v1); page cache counts."""

    def __init__(self, limit: int):
        v2, v1 = Path("/sys/fs/cgroup/cgroup.controllers"), Path("/sys/fs/cgroup/memory")
        if v2.exists():
            self.path, self.limit_file, self.peak_file = (
                Path("/sys/fs/cgroup/teralm-bench"),
                "memory.max",
                "memory.peak",
            )
        elif v1.is_dir():
            self.path, self.limit_file = v1 / "teralm-bench", "memory.limit_in_bytes"
            self.peak_file = "memory.max_usage_in_bytes"
        else:
            sys.exit("no memory cgroup controller mounted")
        self.path.mkdir(exist_ok=True)
        (self.path / self.limit_file).write_text(str(limit))
        if (self.path / "memory.max_usage_in_bytes").exists():
            (self.path / "memory.max_usage_in_bytes").write_text("0")

    def command(self, cmd: list[str]) -> list[str]:
        """``cmd`` run inside the group (the shell joins it, then execs)."""
        procs = self.path / "cgroup.procs"
        return ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *cmd]

    def peak(self) -> int:
        peak = self.path / self.peak_file
        return int(peak.read_text()) if peak.exists() else 0

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


@contextmanager
def disk_peak(folder: Path):
    """Track the largest size of ``folder`` (its files' allocated blocks) while the body runs."""
    found = {"peak": 0}
    done = threading.Event()

    def poll():
        while not done.wait(0.5):
            total = 0
            for p in folder.rglob("*") if folder.exists() else []:
                with suppress(OSError):  # a file renamed or removed meanwhile
                    total += p.stat().st_blocks * 512
            found["peak"] = max(found["peak"], total)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield found
    finally:
        done.set()
        thread.join()


def teralm_build(jsonl: Path, out: Path, workers: int, *flags, cgroup: MemoryCgroup | None = None):
    shutil.rmtree(out, ignore_errors=True)
    cmd = [*TERALM, "build-index", str(jsonl), "--out", str(out), "--workers", str(workers)]
    cmd += ["--quiet", *map(str, flags)]
    with disk_peak(out) as disk:
        run = run_measured(cgroup.command(cmd) if cgroup else cmd)
    if run["returncode"]:
        raise SystemExit(f"teralm build failed:\n{run['output']}")
    m = json.loads((out / "manifest.json").read_text())
    stats = json.loads((out / BUILD_STATS).read_text())
    n = m["num_tokens"]
    return {
        **{k: run[k] for k in ("wall_s", "peak_rss")},
        "tokens": n,
        "ns_per_token": run["wall_s"] / n * 1e9,
        "disk_peak_per_token": disk["peak"] / n,
        "bytes_per_token": m["bytes_per_token"]["total"],
        **{k: stats[k] for k in ("passes", "features_jobs", "features_profile")},
        "cgroup_peak": cgroup.peak() if cgroup else None,
    }


def report(row: dict) -> dict:
    """Print a finished build's row at once (the tables come at the end)."""
    print(json.dumps(row), flush=True)
    return row


def capped_build(jsonl: Path, out: Path, limit: int, budget: str, workers: int, *flags) -> dict:
    """``teralm_build`` inside a fresh memory cgroup of ``limit`` bytes, with ``--memory budget``."""
    group = MemoryCgroup(limit)
    try:
        return report(teralm_build(jsonl, out, workers, "--memory", budget, *flags, cgroup=group))
    finally:
        group.remove()


PROFILE_STAGES = ("read", "decode", "merge", "forward", "backward read", "backward")
PROFILE_STAGES += ("write features", "fsync")


def profile_rows(sizes: list[str], limit: int, budget: str, workers: int, *flags) -> list[dict]:
    """Capped builds of each size; where pass 3's time went, per token (its jobs' profile)."""
    rows = []
    for size in sizes:
        build = capped_build(make_corpus(size), WORK / "profile", limit, budget, workers, *flags)
        shutil.rmtree(WORK / "profile")
        n, profile = build["tokens"], build["features_profile"]
        row = {"corpus": size, "tokens": n, "jobs": build["features_jobs"]}
        row["features_ns_per_token"] = build["passes"]["features"]["wall_s"] / n * 1e9
        row |= {f"{s} ns": profile["seconds"].get(s, 0) / n * 1e9 for s in PROFILE_STAGES}
        counts = profile["counts"]
        row["reads per 1k tokens"] = counts["reads"] / n * 1e3
        row["read B/token"] = counts["read_bytes"] / n
        row["KiB per read"] = counts["read_bytes"] / counts["reads"] / 1024
        row["entries per round"] = counts["entries"] / counts["rounds"]
        rows.append(report({**row, "build": build}))
    return rows


def query_rows(jsonl: Path, shard_counts: list[int], workers: int, contexts: int) -> list[dict]:
    """Build ``jsonl`` with each shard count (timed) and time the lookups of the same contexts."""
    from teralm.index import Index

    rng = np.random.default_rng(0)
    docs = []
    with open(jsonl) as f:
        for i, line in enumerate(f):
            if i % 50 == 0:
                docs.append(json.loads(line)["text"].encode())
            if len(docs) >= 2000:
                break
    long_docs = [np.frombuffer(d, np.uint8) for d in docs if len(d) > CONTEXT]
    sets = {"in-corpus": [], "random": []}
    for _ in range(contexts):
        d = long_docs[int(rng.integers(len(long_docs)))]
        a = int(rng.integers(0, len(d) - CONTEXT))
        sets["in-corpus"].append(d[a : a + CONTEXT].astype(np.int64))
        sets["random"].append(rng.integers(32, 127, size=CONTEXT).astype(np.int64))
    rows = []
    n_bytes, _ = corpus_bytes(jsonl)
    for count in shard_counts:
        out = WORK / f"shards-{count}"
        shard_tokens = -(-n_bytes // count)
        built = teralm_build(jsonl, out, workers, "--shard-tokens", shard_tokens)
        ix = Index.open(out)
        ix.query.next_token_distribution([[1, 2, 3]])  # compile and warm up
        for name, batch in sets.items():
            ix.query.next_token_distribution(batch)  # touch the pages once
            shards = len(ix.manifest["shards"])
            rows.append(
                {
                    "shards": shards,
                    "contexts": name,
                    "build_s": built["wall_s"],
                    "build_ns_per_token": built["ns_per_token"],
                    **latency(ix.next_token_distribution, batch),
                }
            )
        del ix
        shutil.rmtree(out)
    return rows


def probe_lookups(index: Path, lookups: int, cgroup: MemoryCgroup | None, memory: int = 0) -> dict:
    """``lookup_probe.py`` on ``index`` in a fresh process (inside ``cgroup``, if any), with
    ``memory`` bytes of the index read into memory first."""
    cmd = [sys.executable, str(Path(__file__).with_name("lookup_probe.py")), str(index)]
    cmd += ["--lookups", str(lookups), "--memory", str(memory)]
    run = run_measured(cgroup.command(cmd) if cgroup else cmd)
    if run["returncode"]:
        raise SystemExit(f"lookup_probe failed:\n{run['output']}")
    return json.loads(run["output"].strip().splitlines()[-1])


def cold_rows(jsonl: Path, workers: int, lookups: int, *flags) -> list[dict]:
    """Lookups on the index of ``jsonl`` with all of it in the page cache, then from a memory
    cgroup of a quarter of its size after dropping the page cache (needs root)."""
    out = WORK / "cold"
    if not (out / "manifest.json").exists():
        report(teralm_build(jsonl, out, workers, *flags))
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    for p in out.rglob("*"):  # into the page cache, whole
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(1 << 24):
                    pass
    modes = {"in page cache": probe_lookups(out, lookups, None)}
    cap = size // 4
    for resident in (0, cap * 2 // 3):  # 2/3 of the group: the keys and the tokens
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        group = MemoryCgroup(cap)
        mode = f"cgroup {cap / 2**30:.2f} GiB" + (
            f", --memory {resident >> 20}M" if resident else ""
        )
        try:
            modes[mode] = probe_lookups(out, lookups, group, resident)
        finally:
            group.remove()
    rows = []
    for mode, found in modes.items():
        for name in ("in-corpus", "held-out", "random"):
            rows.append({"memory": mode, "contexts": name, **found[name]})
        rows.append({"memory": mode, "contexts": "FragmentSampler", **found["sampler"]})
        rows.append({"memory": mode, "contexts": "decode step x16", **found["decode"]})
        print(f"{mode}: resident {found['resident']}, opened in {found['open_s']:.1f} s")
    print(json.dumps({"index_gib": size / 2**30, "rows": rows}), flush=True)
    return rows


PASS1 = """
import sys, time
from pathlib import Path
from teralm.build_index import builder, sources, tokenize
from teralm.index.catalog import Catalog
from teralm.index.tokenizer import load_tokenizer
source, out, kind, workers = sources.resolve_source(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
catalog = Catalog(out / "catalog.lmdb")
began = time.perf_counter()
tokenize.tokenize_pass(source, load_tokenizer(out, kind), catalog, out, 1 << 23, False, builder._run_units, workers)
print(time.perf_counter() - began)
"""


def pass1_rows(corpus: dict[str, Path], workers: int) -> list[dict]:
    """Pass 1 alone on 1 and ``workers`` processes, per tokenizer: seconds and shard hashes."""
    from teralm.build_index.sources import resolve_source
    from teralm.build_index.tokenize import train_bpe

    rows = []
    for spec, jsonl in corpus.items():
        kind, size = spec.split(":")[0], corpus_bytes(jsonl)[0]
        tokens = {}
        for n in dict.fromkeys((1, workers)):
            out = WORK / f"pass1-{kind}-{n}"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            if kind == "bpe":  # one model for both runs, trained outside the timing
                if "model" not in tokens:
                    began = time.perf_counter()
                    train_bpe(resolve_source(str(jsonl)), int(spec.split(":")[1]), out)
                    tokens["model"] = (out / "tokenizer.json", time.perf_counter() - began)
                elif not (out / "tokenizer.json").exists():
                    shutil.copy(tokens["model"][0], out / "tokenizer.json")
            run = run_measured([sys.executable, "-c", PASS1, str(jsonl), str(out), kind, str(n)])
            if run["returncode"]:
                raise SystemExit(f"pass 1 failed:\n{run['output']}")
            seconds = float(run["output"].strip().splitlines()[-1])
            hashes = {p.name: sha256_file(p) for p in sorted(out.glob("shard-*.tokens"))}
            tokens[n] = hashes
            rows.append(
                {
                    "tokenizer": spec,
                    "workers": n,
                    "bytes": size,
                    "wall_s": seconds,
                    "mb_per_s": size / seconds / 1e6,
                    "ratio": seconds / rows[-1]["wall_s"] if n != 1 else 1.0,
                    "same_shards": str(hashes == tokens[1]),
                    "bpe_training_s": tokens["model"][1] if kind == "bpe" else None,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        for n in (1, workers):
            shutil.rmtree(WORK / f"pass1-{kind}-{n}", ignore_errors=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", default="1gb")
    parser.add_argument("--big", default="4gb")
    parser.add_argument("--cgroup", default="2G", help="memory of the capped build's cgroup")
    parser.add_argument("--parts", default="capped,identical,peers,shards,cold")
    parser.add_argument("--lookups", type=int, default=2000, help="per context set, cold part")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--contexts", type=int, default=5000)
    parser.add_argument("--bpe-corpus", default="256mb", help="the BPE corpus of the pass1 part")
    parser.add_argument("--pass1-tokenizers", default="bytes,bpe:8192", help="pass1 part's")
    parser.add_argument("--profile-sizes", default="1gb,2gb", help="the profile part's builds")
    parser.add_argument("--keep-cold", action="store_true", help="keep the cold part's index")
    parser.add_argument(
        "--shard-counts", default="1,8,58", help="the shard sweep's builds (1 needs ~30 GB RAM)"
    )
    parser.add_argument(
        "--shard-tokens", type=int, default=1 << 23, help="for the builds but the shard sweep"
    )
    args = parser.parse_args()
    from teralm.build_index.builder import parse_size

    parts = args.parts.split(",")
    shards = ("--shard-tokens", args.shard_tokens)
    limit = parse_size(args.cgroup)
    budget = f"{limit * 3 // 4 >> 20}M"
    small = make_corpus(args.small)
    results: dict = {"small": args.small, "big": args.big, "cgroup": limit, "memory": budget}
    results["shard_tokens"] = args.shard_tokens
    rows = []
    if {"capped", "identical"} & set(parts):
        row = teralm_build(small, WORK / "small", args.workers, *shards)
        rows.append(report({"run": f"{args.small} uncapped", **row}))
    if "identical" in parts:
        row = capped_build(small, WORK / "small-capped", limit, budget, args.workers, *shards)
        row["identical"] = content_digests(WORK / "small-capped") == content_digests(WORK / "small")
        print(f"byte-identical to the uncapped build: {row['identical']}", flush=True)
        rows.append({"run": f"{args.small} in {args.cgroup} cgroup", **row})
        shutil.rmtree(WORK / "small-capped")
    shutil.rmtree(WORK / "small", ignore_errors=True)  # disk for the big build
    if "peers" in parts:
        peer = bench_infini_gram(small, WORK / "infini-gram", args.workers)
        n = corpus_bytes(small)[0]
        row = {
            "run": f"{args.small} infini-gram",
            "wall_s": peer["wall_s"],
            "peak_rss": peer["peak_rss"],
            "ns_per_token": peer["wall_s"] / n * 1e9,
            "bytes_per_token": peer["bytes_per_token"].get("total"),
        }
        rows.append(report(row))
        shutil.rmtree(WORK / "infini-gram", ignore_errors=True)
    if "cold" in parts:
        results["cold"] = cold_rows(small, args.workers, args.lookups, *shards)
        print(f"\nlookups on the {args.small} index, in the page cache and 4x larger than memory")
        print(
            table(
                results["cold"],
                [
                    ("memory", "memory", "s"),
                    ("contexts", "contexts", "s"),
                    ("p50_us", "p50 µs", ".1f"),
                    ("p99_us", "p99 µs", ".0f"),
                    ("faults_per_lookup", "faults/lookup", ".2f"),
                    ("read_kib_per_lookup", "KiB read/lookup", ".1f"),
                    ("batched_per_s", "batched ctx/s", ",.0f"),
                    ("tokens_per_s", "sampler tok/s", ",.0f"),
                    ("step_p50_ms", "step p50 ms", ".2f"),
                    ("faults_per_step", "faults/step", ".1f"),
                ],
            )
        )
        if not args.keep_cold:
            shutil.rmtree(WORK / "cold")
    if "profile" in parts:
        sizes = args.profile_sizes.split(",")
        results["profile"] = profile_rows(sizes, limit, budget, args.workers, *shards)
        columns = [("corpus", "corpus", "s"), ("jobs", "jobs", "d")]
        columns += [("features_ns_per_token", "pass 3 ns/tok", ".0f")]
        columns += [(f"{s} ns", f"{s} ns/tok", ".1f") for s in PROFILE_STAGES]
        columns += [(k, k, ".2f") for k in ("reads per 1k tokens", "read B/token", "KiB per read")]
        columns += [("entries per round", "entries per round", ",.0f")]
        print(f"\npass 3's jobs, summed over the workers' time ({args.workers} workers, capped)")
        print(table(results["profile"], columns))
    if "pass1" in parts:
        specs = args.pass1_tokenizers.split(",")
        corpus = {s: small if s == "bytes" else make_corpus(args.bpe_corpus) for s in specs}
        results["pass1"] = pass1_rows(corpus, args.workers)
        print(f"\npass 1 alone (read, tokenize, write shards), 1 and {args.workers} processes")
        print(
            table(
                results["pass1"],
                [
                    ("tokenizer", "tokenizer", "s"),
                    ("workers", "processes", "d"),
                    ("bytes", "corpus bytes", ",d"),
                    ("wall_s", "wall s", ".1f"),
                    ("mb_per_s", "MB/s", ".1f"),
                    ("ratio", "÷ 1 process", ".2f"),
                    ("same_shards", "same shards", "s"),
                ],
            )
        )
    if "capped" in parts and "shards" not in parts:  # disk for the big build (15 B/token)
        shutil.rmtree(small.parent.parent)
    if "capped" in parts:
        row = capped_build(
            make_corpus(args.big), WORK / "big", limit, budget, args.workers, *shards
        )
        rows.append({"run": f"{args.big} in {args.cgroup} cgroup", **row})
        shutil.rmtree(WORK / "big")
    for r in rows:
        r["peak_gib"] = r["peak_rss"] / 2**30
        r["cgroup_gib"] = (r.get("cgroup_peak") or 0) / 2**30
    results["builds"] = rows
    if rows:
        print(f"\nbuilds ({args.workers} workers; capped runs use --memory {budget})")
        print(
            table(
                rows,
                [
                    ("run", "run", "s"),
                    ("wall_s", "wall s", ".1f"),
                    ("ns_per_token", "ns/token", ".0f"),
                    ("peak_gib", "peak RSS GiB", ".2f"),
                    ("cgroup_gib", "cgroup peak GiB", ".2f"),
                    ("disk_peak_per_token", "peak disk B/tok", ".1f"),
                    ("bytes_per_token", "B/tok", ".2f"),
                ],
            )
        )
    for r in rows:
        if "identical" in r:
            print(f"  {r['run']}: byte-identical to the uncapped build: {r['identical']}")
    if "shards" in parts:
        counts = [int(c) for c in args.shard_counts.split(",")]
        results["queries"] = query_rows(small, counts, args.workers, args.contexts)
        print(f"\nqueries on {args.small}: {args.contexts} contexts of {CONTEXT} bytes per set")
        print(
            table(
                results["queries"],
                [
                    ("shards", "shards", "d"),
                    ("build_s", "build s", ".1f"),
                    ("build_ns_per_token", "build ns/tok", ".0f"),
                    ("contexts", "contexts", "s"),
                    ("p50_us", "p50 µs", ".1f"),
                    ("p99_us", "p99 µs", ".0f"),
                    ("batched_per_s", "batched ctx/s", ",.0f"),
                ],
            )
        )
    print(f"\nwrote {save('bench_scale_' + '_'.join(parts), results)}")


if __name__ == "__main__":
    main()
