"""The build-index job: four resumable passes over a corpus, then a manifest and a summary."""

from __future__ import annotations

import ctypes
import itertools
import json
import multiprocessing as mp
import os
import shutil
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from pathlib import Path

import psutil
from tqdm import tqdm

from teralm.build_index import features, prefix, tokenize, verify
from teralm.build_index.layout import Layout
from teralm.build_index.monitor import PassStats, measure
from teralm.build_index.sources import resolve_source
from teralm.errors import BuildError, ConfigError
from teralm.files import folder_lock, format_bytes, sha256_file, write_atomic
from teralm.index import format as fmt
from teralm.index.catalog import Catalog, unit_key
from teralm.index.tokenizer import ByteTokenizer, load_tokenizer, parse_tokenizer_spec


def default_memory() -> int:
    """Half of the memory this process may use: the RAM, or its memory cgroup's limit when
    lower (cgroup v2 or v1)."""
    limit = psutil.virtual_memory().total
    with suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, group = line.split(":", 2)
            if controllers == "":  # v2: the unified hierarchy, wherever it is mounted
                files = [
                    f"{root}{group}/memory.max"
                    for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
                ]
            elif "memory" in controllers.split(","):
                files = [f"/sys/fs/cgroup/memory{group}/memory.limit_in_bytes"]
            else:
                continue
            for name in files:
                with suppress(OSError, ValueError):  # "max": no limit
                    limit = min(limit, int(Path(name).read_text()))
    return limit // 2


def parse_size(text: str, flag: str = "--memory") -> int:
    """Bytes in ``"2G"``, ``"512M"``, ``"64k"`` or a plain number (above 0; errors name
    ``flag``)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    number, unit = text.strip().upper().rstrip("IB"), ""
    if number and number[-1] in units:
        number, unit = number[:-1], number[-1]
    try:
        size = int(float(number) * units[unit])
    except ValueError:
        raise ConfigError(f"{flag} {text!r} is not a size such as 2G or 512M") from None
    if size <= 0:
        raise ConfigError(f"{flag} {text!r} must be more than 0")
    return size


@dataclass
class BuildConfig:
    source: str
    out: Path
    tokenizer: str = "bytes"
    shard_tokens: int = 1 << 25
    max_match: int = 32
    workers: int = 1
    memory: int = field(default_factory=default_memory)
    force: bool = False
    text_field: str = "text"
    verify_samples: int = 16
    progress: bool = True
    cluster: str | None = None  # a Ray cluster's address: the units run there as its tasks

    def params(self, fingerprint: str) -> dict:
        """What decides the index's content (workers, memory, progress and cluster do not)."""
        return {
            "format": fmt.FORMAT_VERSION,
            "source": self.source,
            "fingerprint": fingerprint,
            "tokenizer": self.tokenizer,
            "shard_tokens": self.shard_tokens,
            "max_match": self.max_match,
            "text_field": self.text_field,
        }


@dataclass
class BuildResult:
    manifest: dict
    passes: list[PassStats] = field(default_factory=list)


def _index_files(out: Path) -> list[Path]:
    names = {fmt.MANIFEST, fmt.TOKENIZER, fmt.DOCUMENT_OFFSETS, fmt.CATALOG, fmt.BUILD_STATS}
    return [
        p
        for p in out.iterdir()
        if p.name in names or p.name.startswith(("shard-", "order.")) or ".tmp" in p.name
    ]


def _prepare_out(config: BuildConfig, params: dict) -> None:
    """Clear the folder for ``--force`` or when it holds an abandoned build of other ``params``,
    and what a killed run leaves; the caller holds the folder's lock."""
    out = config.out
    entries = fmt.folder_contents(out)
    ours = _index_files(out)
    if entries and not (out / fmt.CATALOG).exists():
        raise BuildError(
            f"--out {out} is not empty and holds no teralm index; choose another folder"
        )
    if config.force or (ours and _abandoned(out, params)):
        if len(ours) != len(entries):
            raise BuildError(f"--out {out} holds files that are not part of an index; not deleting")
        # the manifest first: a folder left half-deleted must not look complete
        for p in sorted(ours, key=lambda p: p.name != fmt.MANIFEST):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    for p in _index_files(out):  # leftovers of a killed run: never complete, never read
        if ".tmp" in p.name and p.exists():
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def _abandoned(out: Path, params: dict) -> bool:
    """Whether ``out`` holds a build of other ``params`` that finished nothing (not one shard of
    pass 1: a bad source or a wrong flag stopped it), which a new build takes over without
    ``--force``."""
    if (out / fmt.MANIFEST).exists() or not (out / fmt.CATALOG).exists():
        return False
    catalog = Catalog(out / fmt.CATALOG)
    try:
        shards = catalog.prefixed(tokenize.SHARD_KEY + "/")
        first_shard = next(shards, None)
        shards.close()  # its read transaction, before the catalog closes
        finished = first_shard is not None or catalog.get("p1/done") is not None
        return not finished and catalog.get("meta/params") not in (None, params)
    finally:
        catalog.close()


def _check_params(catalog: Catalog, params: dict, out: Path) -> None:
    """Record the build parameters, or refuse if a previous run's differ."""
    previous = catalog.get("meta/params")
    if previous is None:
        catalog.put({"meta/params": params})
    elif previous != params:
        changed = ", ".join(
            f"{k} {previous.get(k)!r} -> {v!r}" for k, v in params.items() if previous.get(k) != v
        )
        raise BuildError(
            f"{out} holds a different index ({changed}); use --force to replace it, "
            "or another --out"
        )


def _worker_init(build_pid: int) -> None:
    """Pool workers die with the build (Linux), and leave Ctrl-C to the parent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != build_pid:  # the build died before the line above: nobody will read us
        os._exit(1)


_cluster_runner: ContextVar[Callable | None] = ContextVar("cluster_runner", default=None)


@contextmanager
def _units_on_cluster(address: str | None) -> Iterator[None]:
    """Within the block, ``_run_units`` hands the units to the Ray cluster at ``address``, if any
    (connected before any work, so an unreachable cluster fails at once)."""
    if address is None:
        yield
        return
    from teralm.build_index import cluster  # Ray only when asked for

    with cluster.connect(address) as runner:
        token = _cluster_runner.set(runner)
        try:
            yield
        finally:
            _cluster_runner.reset(token)


def _run_units(fn: Callable, args: Iterable[tuple], workers: int, on_done: Callable) -> None:
    """Run ``fn(*a)`` for each ``a`` in-process, on a pool or on the cluster, calling
    ``on_done(result)`` in order of completion (in the parent, which alone writes the catalog).
    At most two units per worker are handed out ahead of the results read back.

    A worker's exception is raised here as itself. On any error the workers are killed at once:
    their unfinished units are not recorded, so the next run does them again.
    """
    args = list(args)
    if (on_cluster := _cluster_runner.get()) is not None:
        return on_cluster(fn, args, workers, on_done)
    if workers <= 1 or len(args) <= 1:
        for a in args:
            on_done(fn(*a))
        return
    pool = ProcessPoolExecutor(
        min(workers, len(args)),
        mp_context=mp.get_context("spawn"),
        initializer=_worker_init,
        initargs=(os.getpid(),),
    )
    waiting = iter(args)
    running = {pool.submit(fn, *a) for a in itertools.islice(waiting, 2 * workers)}
    try:
        while running:
            done, running = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                on_done(future.result())
                running |= {pool.submit(fn, *a) for a in itertools.islice(waiting, 1)}
    except BrokenProcessPool:
        raise BuildError(
            "a worker process died (killed, or out of memory?); run the same command again "
            "to resume, with fewer --workers if memory is short"
        ) from None
    except BaseException:
        _kill_workers(pool)
        raise
    finally:
        pool.shutdown(cancel_futures=True)


def _kill_workers(pool: ProcessPoolExecutor) -> None:
    """Stop the workers now rather than after their current unit (the pool then reports itself
    broken and shuts down without waiting on them)."""
    for process in list(pool._processes.values()):  # Python 3.14 has pool.kill_workers()
        process.kill()


def build(config: BuildConfig) -> BuildResult:
    """Build (or resume, or confirm) the index described by ``config``."""
    kind, vocab = parse_tokenizer_spec(config.tokenizer)
    _check_flags(config)
    if config.cluster is not None:  # the same path on every machine of the shared filesystem
        config = replace(config, out=config.out.absolute())
    source = resolve_source(config.source, config.text_field)
    out = config.out
    if out.exists() and not out.is_dir():
        raise BuildError(f"--out {out} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    params = config.params(source.fingerprint())
    with folder_lock(out, "build-index"):
        _prepare_out(config, params)
        catalog = Catalog(out / fmt.CATALOG)
        try:
            _check_params(catalog, params, out)
            if (out / fmt.MANIFEST).exists():
                return BuildResult(fmt.read_manifest(out), [])
            with _units_on_cluster(config.cluster):
                return _build_passes(config, source, kind, vocab, catalog, params)
        finally:
            catalog.close()


def _check_flags(config: BuildConfig) -> None:
    """Refuse out-of-range settings before any work is done."""
    if not 1 <= config.max_match <= fmt.MAX_MATCH_LIMIT:
        raise BuildError(f"--max-match must be 1..{fmt.MAX_MATCH_LIMIT}")
    if config.shard_tokens < 1 or config.shard_tokens > 2**32 - 1:
        raise BuildError("--shard-tokens must be 1..4294967295 (positions are uint32 in a shard)")
    if config.workers < 1:
        raise BuildError(f"--workers must be 1 or more, not {config.workers}")
    if config.verify_samples < 0:
        raise BuildError(f"--verify-samples must be 0 or more, not {config.verify_samples}")
    if config.memory <= MIN_MEMORY:
        raise BuildError(
            f"--memory {format_bytes(config.memory)} is less than a build needs at the least "
            f"(more than {format_bytes(MIN_MEMORY)}: two processes before any work)"
        )


def _build_passes(config, source, kind, vocab, catalog, params) -> BuildResult:
    stats = [PassStats(n) for n in ("tokenize", "sort", "features", "finalize")]
    with measure(stats[0]):
        stats[0].skipped = catalog.get("p1/done") is not None
        if not stats[0].skipped:
            _tokenize_pass(config, source, kind, vocab, catalog)
    p1 = catalog.get("p1/done")
    layout = Layout(
        str(config.out),
        config.shard_tokens,
        tuple(p1["sizes"]),
        p1["token_dtype"],
        p1["vocab_size"],
        p1["separator"],
        config.max_match,
    )
    if layout.num_shards > 1 << 16:
        raise BuildError(
            f"{layout.num_shards:,} shards are more than 65,536; give a larger --shard-tokens"
        )
    with measure(stats[1]):
        stats[1].skipped = not _sort_pass(layout, catalog, config)
    with measure(stats[2]):
        stats[2].skipped = catalog.get("p3/done") is not None
        if not stats[2].skipped:
            _features_pass(layout, catalog, config)
    with measure(stats[3]):
        manifest = _finalize(layout, catalog, config, params, stats)
    return BuildResult(manifest, stats)


def _tokenize_pass(config: BuildConfig, source, kind: str, vocab: int, catalog: Catalog) -> None:
    """Pass 1: the tokenizer (trained first for BPE), the token shards and the documents."""
    out = config.out
    if kind == "bytes":
        tokenizer = ByteTokenizer()
    elif (out / fmt.TOKENIZER).exists():
        tokenizer = load_tokenizer(out, kind)
    else:
        tokenizer = tokenize.train_bpe(source, vocab, out)
    tokenize.tokenize_pass(
        source,
        tokenizer,
        catalog,
        out,
        config.shard_tokens,
        config.progress,
        _run_units,
        config.workers,
    )
    summary = tokenize.finish_tokenize(catalog, out, tokenizer)
    summary.update(vocab_size=tokenizer.vocab_size, token_dtype=tokenizer.dtype.str)
    catalog.put({"p1/done": summary})


def _sort_pass(layout: Layout, catalog: Catalog, config: BuildConfig) -> bool:
    """Pass 2: sort the shards not sorted yet; whether there were any."""
    todo = [
        (layout, k)
        for k in range(layout.num_shards)
        if catalog.get(unit_key("p2/shard", k)) is None
    ]
    with tqdm(
        total=layout.num_shards,
        initial=layout.num_shards - len(todo),
        unit="shard",
        desc="pass 2/4 sort",
        disable=not config.progress,
    ) as bar:

        def sorted_done(result):
            k, seconds, written = result
            prefix.flush_shard(layout, k)
            catalog.put({unit_key("p2/shard", k): {"bytes": written}})
            bar.update()

        _run_units(prefix.sort_one_shard, todo, _sort_workers(layout, config), sorted_done)
    return bool(todo)


def _features_pass(layout: Layout, catalog: Catalog, config: BuildConfig) -> None:
    if catalog.get("p3/merged") is None:
        _merge_jobs(layout, catalog, config)
    features.remove_runs(layout)
    shards = [
        (layout, k)
        for k in range(layout.num_shards)
        if catalog.get(unit_key("p3/shard", k)) is None
    ]
    _run_units(
        features.write_match_file,
        shards,
        _sort_workers(layout, config),  # a shard's positions and features, in memory
        lambda result: catalog.put({unit_key("p3/shard", result[0]): {"tokens": result[1]}}),
    )
    catalog.put({"p3/done": {}})


def _merge_jobs(layout: Layout, catalog: Catalog, config: BuildConfig) -> None:
    """The merge jobs of pass 3: the global order, and the features in sorted order."""
    features.create_work_files(layout)
    firsts, starts = features.make_plan(layout)
    write_atomic(layout.order_path("buckets"), starts.astype(fmt.BUCKET_DTYPE))
    jobs = catalog.get("p3/jobs")
    if jobs is None:
        jobs = features.split_jobs(starts, _job_rows(layout, config))
        catalog.put({"p3/jobs": jobs})
    spans = features.run_spans(layout, jobs)
    chunk, read_memory = _merge_memory(layout, config)
    todo = [
        (i, spans[i], int(starts[b0]), chunk, read_memory)
        for i, (b0, _) in enumerate(jobs)
        if catalog.get(unit_key("p3/job", i)) is None
    ]
    remaining = sum(int(starts[jobs[i][1]] - starts[jobs[i][0]]) for i, *_ in todo)
    with tqdm(
        total=layout.num_tokens,
        initial=layout.num_tokens - remaining,
        unit="tok",
        unit_scale=True,
        desc="pass 3/4 features",
        disable=not config.progress,
    ) as bar:

        def job_done(result):
            i, (rows, profile) = result
            catalog.put({unit_key("p3/job", i): {"positions": rows, "profile": profile}})
            features.release_runs(layout, spans[i])
            bar.update(rows)

        _run_units(
            _numbered_job,
            [(i, layout, firsts, *job) for i, *job in todo],
            _merge_workers(layout, config),
            job_done,
        )
    catalog.put({"p3/merged": {"jobs": len(jobs)}})


def _numbered_job(i, layout, firsts, *job):
    return i, features.features_job(layout, firsts, *job)


WORKER_BYTES = 200 << 20  # a process before its work: Python, numpy, numba, teralm (~130 MB)
MIN_MEMORY = 2 * WORKER_BYTES  # the build and one worker, before any work


def _work_memory(config: BuildConfig, workers: int) -> int:
    """What the budget leaves each of ``workers`` worker processes for its work, beside the
    main process and the workers' own WORKER_BYTES."""
    return (config.memory - WORKER_BYTES) // workers - WORKER_BYTES


def _sort_workers(layout: Layout, config: BuildConfig) -> int:
    """How many shards the memory budget lets pass 2 sort at once (at most ``workers``)."""
    context = min(layout.shard_tokens + layout.overlap, layout.num_tokens)
    need = prefix.SORT_BYTES_PER_TOKEN * context
    if need > _work_memory(config, 1):
        raise BuildError(
            f"sorting one shard needs about {format_bytes(need + 2 * WORKER_BYTES)}, more "
            f"than --memory {format_bytes(config.memory)}; give a smaller --shard-tokens or "
            "more --memory"
        )
    return _workers_for(config, need)


def _workers_for(config: BuildConfig, need: int) -> int:
    """The most workers (at most ``config.workers``, at least one) that each get ``need``."""
    fits = [w for w in range(1, config.workers + 1) if _work_memory(config, w) >= need]
    return max(fits, default=1)


MAX_JOB_ROWS = 1 << 24  # a running job's work files: 14 bytes per entry (SWEEP_COLUMNS)


def _job_rows(layout: Layout, config: BuildConfig) -> int:
    """Entries per merge job: a quarter of the corpus per worker, between 2^12 and
    MAX_JOB_ROWS. A job's memory does not depend on its size (see ``_merge_memory``), but its
    work files and the keys it has not yet released do: at 2^26 entries, the two running jobs
    of a 1 GB build held 7.6 bytes of disk per token of the corpus beside pass 2's 14.6."""
    return min(max(layout.num_tokens // (4 * max(config.workers, 1)), 1 << 12), MAX_JOB_ROWS)


MIN_CHUNK = 2048  # entries a merge job reads from a shard at a time, at least (disk reads)


def _merge_bytes_per_chunk_row(layout: Layout) -> int:
    """A merge job's memory per entry of its per-shard chunk: every shard's buffered entries,
    and the copies a merge round makes of them."""
    return 2 * features.job_bytes_per_row(layout) * layout.num_shards


def _merge_workers(layout: Layout, config: BuildConfig) -> int:
    """How many merge jobs the memory budget lets run at once (at most ``workers``): each
    needs a worker and chunks of MIN_CHUNK entries of every shard."""
    return _workers_for(config, _merge_bytes_per_chunk_row(layout) * MIN_CHUNK)


ROUND_ROWS = 1 << 21  # entries a merge round takes from all shards together, at most
READ_SHARE = 4  # a merge job's memory for what it has read but not decoded: 1/READ_SHARE


def _merge_memory(layout: Layout, config: BuildConfig) -> tuple[int, int]:
    """A merge job's chunk (entries it decodes from each shard at a time) and its memory for
    read bytes not yet decoded. The chunk: what the memory budget leaves each merge worker
    beside its reads, over the shards (at least 16, for a budget below MIN_CHUNK's), and no
    more than ROUND_ROWS over all shards (or MIN_CHUNK each): larger rounds ran slower (a
    1 GB build's pass 3 took 416 s with rounds of 17M entries, 335 s with 1.4M)."""
    work = _work_memory(config, _merge_workers(layout, config))
    reads = max(work // READ_SHARE, 0)
    cap = max(ROUND_ROWS // layout.num_shards, MIN_CHUNK)
    return max(min((work - reads) // _merge_bytes_per_chunk_row(layout), cap), 16), reads


def _finalize(
    layout: Layout, catalog: Catalog, config: BuildConfig, params: dict, stats: list[PassStats]
) -> dict:
    """Checksums, verification on a sample, then the manifest (written last, atomically)."""
    out = config.out
    checksums, order_checksums = verify.file_checksums(layout, config.progress)
    problems = verify.verify(layout, config.verify_samples)
    if problems:
        raise BuildError("verification failed: " + "; ".join(problems[:3]))
    p1 = catalog.get("p1/done")
    n = layout.num_tokens
    kinds = {kind: sum(c[kind]["bytes"] for c in checksums) for kind in fmt.FILE_KINDS}
    kinds |= {kind: record["bytes"] for kind, record in order_checksums.items()}
    bytes_per_token = {kind: size / n for kind, size in kinds.items()}
    bytes_per_token["total"] = sum(kinds.values()) / n
    manifest = {
        "format": fmt.FORMAT_NAME,
        "version": fmt.FORMAT_VERSION,
        "tokenizer": parse_tokenizer_spec(config.tokenizer)[0],
        "vocab_size": layout.vocab_size,
        "token_dtype": layout.token_dtype,
        "max_match": layout.max_match,
        "separator": layout.separator,
        "context_overlap": layout.overlap,
        "num_tokens": n,
        "num_documents": p1["num_documents"],
        "shard_tokens": layout.shard_tokens,
        "shards": [
            {"num_tokens": size, "files": checksums[k]} for k, size in enumerate(layout.sizes)
        ],
        "order": {
            "width": layout.order_width,
            "depth": layout.sort_depth,
            "files": order_checksums,
        },
        "catalog": verify.catalog_checksum(catalog),
        "build": params,
        "bytes_per_token": bytes_per_token,
    }
    if manifest["tokenizer"] == "bpe":
        manifest["tokenizer_sha256"] = sha256_file(out / fmt.TOKENIZER)
    build_stats = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "passes": {
            s.name: {"wall_s": round(s.wall_s, 3), "peak_rss": s.peak_rss}
            for s in stats[:3]
            if not s.skipped
        },
        "features_jobs": len(catalog.get("p3/jobs") or []),
        "features_profile": _features_profile(catalog),
    }
    write_atomic(out / fmt.BUILD_STATS, json.dumps(build_stats, indent=1).encode())
    catalog.rewrite(_finished_records(catalog))
    write_atomic(out / fmt.MANIFEST, json.dumps(manifest, indent=1).encode())
    return manifest


def _features_profile(catalog: Catalog) -> dict:
    """Pass 3's jobs' ``JobProfile`` summed (those recorded by this teralm: a build resumed
    from an older one's pass 3 may lack some)."""
    total: dict[str, Counter] = {"seconds": Counter(), "counts": Counter()}
    for _, record in catalog.prefixed(b"p3/job/"):
        for part, values in record.get("profile", {}).items():
            total[part].update(values)
    return {part: {k: round(v, 3) for k, v in sorted(c.items())} for part, c in total.items()}


def _finished_records(catalog: Catalog) -> dict[bytes, object]:
    """The catalog of a finished build: its documents and progress records, without those of
    pass 3's plan (which depends on --workers and --memory); its end is recorded."""
    return {
        key: value
        for key, value in catalog.prefixed(b"")
        if not key.startswith(b"p3/") or key == b"p3/done"
    }


def format_summary(result: BuildResult, out: Path, wall_s: float) -> str:
    """One screen: what was built, bytes per token, and what each pass cost."""
    m = result.manifest
    bpt = m["bytes_per_token"]
    lines = [
        f"index      {m['build']['source']} -> {out}",
        f"tokens     {m['num_tokens']:,} ({m['tokenizer']}, vocab {m['vocab_size']})",
        f"documents  {m['num_documents']:,}",
        f"shards     {len(m['shards'])} of up to {m['shard_tokens']:,} tokens",
        "bytes/tok  " + "  ".join(f"{k} {v:.2f}" for k, v in bpt.items()),
    ]
    if result.passes:
        lines.append(f"{'pass':<10} {'wall s':>8} {'peak RSS':>10}")
        for s in result.passes:
            cost = "done earlier" if s.skipped else f"{s.wall_s:8.1f} {s.peak_rss / 2**30:8.2f} GiB"
            lines.append(f"{s.name:<10} {cost}")
        lines.append(f"{'total':<10} {wall_s:8.1f}  ({m['num_tokens'] / wall_s / 1e6:.2f} M tok/s)")
    else:
        lines.append("already complete: nothing to do")
    return "\n".join(lines)
