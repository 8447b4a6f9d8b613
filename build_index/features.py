"""Pass 3: causal longest-match features of every token against all earlier tokens of the corpus,
and the global sorted order that queries search.

The work is split by key bucket (leading 16 bits of the reversed context): a job takes a range of
buckets, reads that range of every shard's front-coded keys (pass 2's ``.run``, sequentially, a
chunk at a time), merges them (S-way, O(log S) per entry), writes its slice of the global order
and sweeps it forwards and backwards (see teralm.kernels.match). Jobs write disjoint parts of
the order files and of the shards' work files, so they run in any order and in parallel; a job
that was cut short is simply run again. Nothing reads tokens at random, and a job's memory is set
by its chunk size, whatever the size of the corpus or of the job.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from teralm.build_index.layout import Layout
from teralm.build_index.prefix import join_runs, read_run, run_bytes, run_index, split_run
from teralm.files import fsync_path, write_at, write_atomic
from teralm.index import format as fmt
from teralm.kernels import match as km

BUCKETS = fmt.NUM_BUCKETS


@dataclass(frozen=True)
class FirstOccurrences:
    """Per token value: first position, first position with a follower, that follower."""

    first: np.ndarray
    first_f: np.ndarray
    first_tok: np.ndarray


@dataclass
class JobProfile:
    """Where a features job's time went (seconds per stage) and what it read from pass 2's
    files (reads issued, bytes, merge rounds, entries). Build statistics, not index content."""

    seconds: Counter = field(default_factory=Counter)
    counts: Counter = field(default_factory=Counter)

    @contextmanager
    def stage(self, name: str):
        began = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - began

    def as_dict(self) -> dict:
        return {"seconds": dict(self.seconds), "counts": dict(self.counts)}


def job_bytes_per_row(layout: Layout) -> int:
    """Memory of a features job per buffered entry: its key words, plus the other arrays of
    the merge and the sweeps (about 100 bytes, rounded up)."""
    return 8 * km.key_words(layout.sort_depth, layout.elem_bits) + 128


def local_doc_bits(layout: Layout, offsets: np.ndarray, k: int) -> np.ndarray:
    """Bitmap of the document starts in shard ``k`` and at the position just after it (the
    offsets end with ``num_tokens``: nothing follows the corpus's last token)."""
    start, n = layout.shard_start(k), layout.sizes[k]
    inside = offsets[np.searchsorted(offsets, start) : np.searchsorted(offsets, start + n, "right")]
    local = inside.astype(np.int64) - start
    return km.doc_start_bits(np.append(local, n + 1), n + 1)  # it drops the closing entry


def make_plan(layout: Layout) -> tuple[FirstOccurrences, np.ndarray]:
    """One sequential scan of the corpus for the first-occurrence tables, and ``starts``
    [bucket + 1]: where each bucket starts in the global order (from pass 2's run indexes)."""
    offsets = layout.offsets()
    vocab = max(layout.vocab_size, 256)
    first = np.full(vocab, km.INF, dtype=np.int64)
    first_f = np.full(vocab, km.INF, dtype=np.int64)
    first_tok = np.zeros(vocab, dtype=np.int64)
    starts = np.zeros(BUCKETS + 1, dtype=np.int64)
    for k in range(layout.num_shards):
        starts += run_index(layout, k)[0].astype(np.int64)
        last = k + 1 == layout.num_shards  # nothing follows it
        km.first_occurrences(
            layout.read_tokens(k),
            np.zeros(1, layout.token_dtype) if last else layout.read_tokens(k + 1, 0, 1),
            layout.shard_start(k),
            local_doc_bits(layout, offsets, k),
            first,
            first_f,
            first_tok,
        )
    return FirstOccurrences(first, first_f, first_tok), starts


def split_jobs(starts: np.ndarray, target: int) -> list[tuple[int, int]]:
    """Consecutive bucket ranges of about ``target`` positions each (a bucket is never split)."""
    per_bucket = np.diff(starts)
    jobs, begin, acc = [], 0, 0
    for b in np.flatnonzero(per_bucket):
        acc += int(per_bucket[b])
        if acc >= target:
            jobs.append((begin, int(b) + 1))
            begin, acc = int(b) + 1, 0
    if acc:
        jobs.append((begin, BUCKETS))
    return jobs


def run_spans(layout: Layout, jobs: list[tuple[int, int]]) -> np.ndarray:
    """``[job, shard]``: the entries ``[lo, hi)`` and the elements ``[e0, e1)`` of the shard's
    run that hold the job's buckets (one read of each ``.runidx``)."""
    spans = np.zeros((len(jobs), layout.num_shards, 4), dtype=np.int64)
    first = np.array([b0 for b0, _ in jobs], dtype=np.int64)
    last = np.array([b1 for _, b1 in jobs], dtype=np.int64)
    for k in range(layout.num_shards):
        index = run_index(layout, k).astype(np.int64)
        spans[:, k] = np.stack(
            [index[0, first], index[0, last], index[1, first], index[1, last]], 1
        )
    return spans


SWEEP_COLUMNS = {  # what the forward sweep leaves the backward one, per entry (14 bytes; the
    "lcp": np.uint8,  # positions and followers it reads back from the order it wrote)
    "token": np.uint16,  # the entry's token (tokens and the separator fit 16 bits)
    "best_len": np.uint8,
    "best_pos": np.int64,
    "best_tok": np.uint16,
}


class _Arena:
    """The decoded entries that a job's readers hold, in one set of arrays allocated once: reader
    ``i`` keeps its entries in rows ``[i * chunk, (i + 1) * chunk)``, so that a merge round
    neither gathers them into new arrays nor gets new memory from the system."""

    def __init__(self, layout: Layout, readers: int, chunk: int):
        rows = readers * chunk
        self.keys = np.empty((rows, km.key_words(layout.sort_depth, layout.elem_bits)), np.uint64)
        self.depth = np.empty(rows, dtype=np.uint8)
        self.follow = np.empty(rows, dtype=layout.sort_dtype)
        self.pos = np.empty(rows, dtype=np.int64)

    def move(self, a: int, b: int, to: int) -> None:
        """Move rows ``[a, b)`` to start at row ``to`` (``to <= a``)."""
        if a in (to, b):
            return
        for x in (self.keys, self.depth, self.follow, self.pos):
            x[to : to + b - a] = x[a:b]


class _RunReader:
    """One shard's entries of a job. Pass 2's bytes are read ``read_rows`` entries at a time by
    a thread of the job's pool, the next read under way while the last is decoded, and decoded
    up to ``chunk`` entries at a time into the reader's rows of the arena: its decoded entries
    are rows ``[lo, hi)``."""

    def __init__(
        self, layout: Layout, k: int, span, arena: _Arena, base: int, chunk: int, read_rows: int
    ):
        self.layout, self.k, self.arena = layout, k, arena
        self.chunk, self.read_rows = chunk, max(read_rows, chunk)
        self.next, self.stop, self.element = int(span[0]), int(span[1]), int(span[2])
        self.to_decode = self.next  # the first entry not decoded yet
        self.base = self.lo = self.hi = base
        self.current = np.zeros(arena.keys.shape[1] * 64 // layout.elem_bits, dtype=np.int64)
        self.reading: Future | None = None  # the read under way
        self.undecoded: dict | None = None  # read, not yet decoded

    @property
    def ahead(self) -> int:
        """Entries not yet decoded: read, being read or on disk."""
        return self.stop - self.to_decode

    @property
    def buffered(self) -> int:
        return self.hi - self.lo

    def read_ahead(self, pool: ThreadPoolExecutor) -> None:
        """Start reading the next entries from disk, unless a read is under way or all are."""
        if self.reading is None and self.next < self.stop:
            end = min(self.next + self.read_rows, self.stop)
            self.reading = pool.submit(read_run, self.layout, self.k, self.next, end, self.element)
            self.next = end

    def top_up(self, pool: ThreadPoolExecutor, profile: JobProfile) -> None:
        """Decode entries after the buffered ones, up to ``chunk`` (reading as needed), once
        half of them are used: a round takes few of each shard's entries when there are many
        shards, and topping up every round moved the rest (``_Arena.move``) each time."""
        if 2 * self.buffered > self.chunk:
            return
        take = min(self.chunk - self.buffered, self.ahead)
        if take <= 0:
            return
        while self.undecoded is None or len(self.undecoded["lcp"]) < take:
            self._land(pool, profile)
        run, self.undecoded = split_run(self.undecoded, take)
        self.to_decode += take
        with profile.stage("decode"):
            self._decode(run)

    def _land(self, pool: ThreadPoolExecutor, profile: JobProfile) -> None:
        """Wait for the read under way (started now if none is), keep what it read, and start
        the next."""
        self.read_ahead(pool)
        with profile.stage("read"):
            run = self.reading.result()
        self.reading = None
        self.element += len(run["elements"])
        profile.counts["reads"] += len(run)
        profile.counts["read_bytes"] += sum(x.nbytes for x in run.values())
        self.undecoded = run if self.undecoded is None else join_runs(self.undecoded, run)
        self.read_ahead(pool)

    def _decode(self, run: dict) -> None:
        """Decode a read run after the buffered entries."""
        layout, arena = self.layout, self.arena
        arena.move(self.lo, self.hi, self.base)
        self.lo, self.hi = self.base, self.base + self.buffered
        a, b = self.hi, self.hi + len(run["lcp"])
        km.decode_run(
            run["lcp"],
            run["depth"],
            run["elements"],
            layout.separator,
            layout.elem_bits,
            layout.sort_depth,
            self.current,
            arena.keys[a:b],
        )
        arena.depth[a:b], arena.follow[a:b] = run["depth"], run["follow"]
        np.add(run["prefix"], layout.shard_start(self.k), out=arena.pos[a:b], casting="unsafe")
        self.hi = b


READ_THREADS = 8  # shards read at once: the disk serves several reads faster than one by one


def _merge_round(
    readers: list[_RunReader], pool: ThreadPoolExecutor, profile: JobProfile
) -> np.ndarray | None:
    """The next entries of the merged order that no entry still to decode can precede: every
    decoded entry up to the smallest last decoded entry of a reader with more to come.
    Returns their rows of the arena in merged order (None when done); the readers give them
    up, and they stay in the arena until the next round."""
    for r in readers:
        r.top_up(pool, profile)
    live = [r for r in readers if r.buffered]
    if not live:
        return None
    profile.counts["rounds"] += 1
    with profile.stage("merge"):
        return _merged_order(live)


def _merged_order(live: list[_RunReader]) -> np.ndarray:
    """The merge of a round: see ``_merge_round``."""
    keys = live[0].arena.keys
    counts = [r.buffered for r in live]
    waiting = [r for r in live if r.ahead]
    if waiting:
        bound = min(waiting, key=lambda r: (tuple(keys[r.hi - 1]), r.k))
        last = keys[bound.hi - 1]
        counts = [km.count_not_above(keys[r.lo : r.hi], r.k, last, bound.k) for r in live]
    starts = np.array([r.lo for r in live], dtype=np.int64)
    ends = starts + np.array(counts, dtype=np.int64)
    for r, c in zip(live, counts):
        r.lo += c
    return km.merge_sorted(keys, starts, ends)


def features_job(
    layout: Layout,
    firsts: FirstOccurrences,
    spans: np.ndarray,
    global_start: int,
    chunk: int,
    read_memory: int,
) -> tuple[int, dict]:
    """Merge the entries in ``spans`` (a row of ``run_spans``: one range per shard), write
    their slice of the global order (it starts at rank ``global_start``) and their features.

    Streamed: pass 2's bytes are read in blocks that ``read_memory`` holds two of per shard,
    and the merge goes forwards ``chunk`` entries per shard at a time, writing the order
    and what the forward sweep found for each entry (``SWEEP_COLUMNS``), which the backward
    sweep then reads from the end. Those stay in memory up to ``chunk`` per shard and go to
    work files beyond that, so memory does not grow with the job. Returns the number of
    positions and the job's ``JobProfile`` (as a dict).
    """
    shards = [k for k, span in enumerate(spans) if span[1] > span[0]]
    arena = _Arena(layout, len(shards), chunk)
    read_rows = _read_rows(layout, spans, len(shards), read_memory)
    readers = [
        _RunReader(layout, k, spans[k], arena, i * chunk, chunk, read_rows)
        for i, k in enumerate(shards)
    ]
    budget = chunk * max(len(readers), 1)
    work = work_paths(layout, global_start)
    for path in work.values():  # left by a run of this job that was killed: it appends to them
        path.unlink(missing_ok=True)
    profile = JobProfile()
    try:
        with ThreadPoolExecutor(READ_THREADS) as pool:
            for r in readers:
                r.read_ahead(pool)
            rows, columns = _forward(
                layout, readers, arena, pool, global_start, work, budget, profile
            )
        _backward(layout, firsts, spans, global_start, rows, columns, budget, profile)
        # Its many small writes are flushed once, before the job may be recorded as done.
        with profile.stage("fsync"):
            for path in [layout.order_path(kind) for kind in ("positions", "follow", "keys")] + [
                sorted_features_path(layout, r.k) for r in readers
            ]:
                fsync_path(path)
        profile.counts["entries"] += rows
        return rows, profile.as_dict()
    finally:
        for path in work.values():
            path.unlink(missing_ok=True)


def _read_rows(layout: Layout, spans: np.ndarray, shards: int, read_memory: int) -> int:
    """Entries per read such that two reads of each of the job's ``shards`` fit ``read_memory``."""
    entries = int((spans[:, 1] - spans[:, 0]).sum())
    elements = int((spans[:, 3] - spans[:, 2]).sum())
    per_entry = run_bytes(layout, entries, elements) / max(entries, 1)
    return int(read_memory / (2 * max(shards, 1) * per_entry))


def work_paths(layout: Layout, global_start: int) -> dict[str, Path]:
    """The work files of the job whose slice of the order starts at ``global_start``: where its
    SWEEP_COLUMNS go when they do not fit its memory."""
    return {
        name: Path(layout.directory) / f"pass3-{global_start:012d}.tmp-{name}"
        for name in SWEEP_COLUMNS
    }


def _forward(
    layout: Layout,
    readers,
    arena: _Arena,
    pool,
    global_start: int,
    work: dict,
    budget: int,
    profile: JobProfile,
) -> tuple[int, dict]:
    """The merge and the forward sweep: writes the order's slice, and returns its number of
    entries and their SWEEP_COLUMNS (arrays, or the ``work`` files when there are more than
    ``budget`` entries)."""
    cap, elem_bits = layout.max_match, layout.elem_bits
    lows, state = km.sweep_state(cap)
    done, kept, spilled = 0, [], False
    last_key, last_depth = np.zeros(arena.keys.shape[1], np.uint64), np.array([-1])
    merged = _MergedRows(layout, len(arena.pos))
    while (order := _merge_round(readers, pool, profile)) is not None:
        began, n = time.perf_counter(), len(order)
        pos, follow, first_words, lcp = out = merged.rows(n)
        km.merged_rows(
            arena.keys, arena.depth, arena.follow, arena.pos, order,
            elem_bits, last_key, last_depth, out,
        )  # fmt: skip
        _write_order(layout, global_start + done, pos, follow, first_words)
        best = merged.best(n)
        km.sweep_chunk(pos, _followers(layout, follow), lcp, cap, lows, state, *best)
        token = first_words >> np.uint64(64 - elem_bits)
        block = dict(zip(SWEEP_COLUMNS, (lcp, token, *best)))
        kept.append({name: block[name].astype(dtype) for name, dtype in SWEEP_COLUMNS.items()})
        done += n
        if done > budget:  # from now on, to the work files
            for name in SWEEP_COLUMNS:
                with open(work[name], "ab") as f:
                    for part in kept:
                        f.write(part[name].tobytes())
            kept, spilled = [], True
        profile.seconds["forward"] += time.perf_counter() - began
    if spilled:
        return done, work
    return done, {
        name: np.concatenate([part[name] for part in kept] or [np.zeros(0, dtype)])
        for name, dtype in SWEEP_COLUMNS.items()
    }


class _MergedRows:
    """The forward sweep's arrays for the rows of a merge round, allocated once per job."""

    def __init__(self, layout: Layout, rows: int):
        self.out = (
            np.empty(rows, np.int64),  # position
            np.empty(rows, layout.sort_dtype),  # follow
            np.empty(rows, np.uint64),  # first key word
            np.empty(rows, np.uint8),  # lcp with the row before
        )
        self.best_len, self.best_pos, self.best_tok = (np.empty(rows, np.int64) for _ in range(3))

    def rows(self, n: int) -> tuple[np.ndarray, ...]:
        return tuple(x[:n] for x in self.out)

    def best(self, n: int) -> tuple[np.ndarray, ...]:
        """The sweep's best length, position and token, reset: nothing found yet."""
        best = self.best_len[:n], self.best_pos[:n], self.best_tok[:n]
        best[0].fill(0)
        best[1].fill(km.INF)
        best[2].fill(0)
        return best


def _column_rows(columns: dict, name: str, a: int, b: int) -> np.ndarray:
    """Entries ``[a, b)`` of a SWEEP_COLUMNS column, from memory or read from its work file
    (not mapped: the pages of a mapping count in the RSS once the sweep has read them)."""
    column = columns[name]
    if not isinstance(column, Path):
        return column[a:b]
    return fmt.read_rows(column, SWEEP_COLUMNS[name], a, b)


def _read_order(layout: Layout, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """Ranks ``[a, b)`` of the global order: positions, and followers (-1 for none)."""
    width = layout.order_width
    raw = fmt.read_rows(layout.order_path("positions"), np.uint8, a * width, b * width)
    follow = fmt.read_rows(layout.order_path("follow"), layout.sort_dtype, a, b)
    return fmt.positions(raw, width), _followers(layout, follow)


def _followers(layout: Layout, follow: np.ndarray) -> np.ndarray:
    """``order.follow`` entries as the sweep takes them: the next token, or -1 for none."""
    follower = follow.astype(np.int32)
    follower[follow == layout.separator] = -1
    return follower


def _backward(
    layout: Layout,
    firsts,
    spans: np.ndarray,
    global_start: int,
    rows: int,
    columns: dict,
    chunk: int,
    profile: JobProfile,
) -> None:
    """The backward sweep over the forward sweep's columns and the order's slice (ranks from
    ``global_start``), from the last entry, then the features of each entry, written in the
    shards' sorted order."""
    cap = layout.max_match
    lows, state = km.sweep_state(cap)
    ends = spans[:, 1].copy()  # per shard: the sorted entry after the last one written
    after = 0  # the LCP of the row visited just before a chunk (the one after it) with its last
    for stop in range(rows, 0, -chunk):
        a = max(0, stop - chunk)
        with profile.stage("backward read"):
            r = {name: _column_rows(columns, name, a, stop)[::-1].copy() for name in SWEEP_COLUMNS}
            pos, follower = (
                x[::-1].copy() for x in _read_order(layout, global_start + a, global_start + stop)
            )
        began = time.perf_counter()
        h = np.concatenate([[after], r["lcp"][:-1]]).astype(np.uint8)
        after = int(r["lcp"][-1])
        token = r["token"].astype(np.int64)
        length, best_pos, best_tok = (
            r["best_len"].astype(np.int64),
            r["best_pos"],
            r["best_tok"].astype(np.int64),
        )
        km.sweep_chunk(pos, follower, h, cap, lows, state, length, best_pos, best_tok)
        # One-token matches may lie in another bucket: take them from the first-occurrence table.
        short = length <= 1
        length[short] = firsts.first[token[short]] < pos[short]
        has_next = np.where(short, firsts.first_f[token] < pos, best_pos < km.INF) & (length > 0)
        len_byte = (length | np.where(has_next, 0, fmt.NO_FOLLOWER_BIT)).astype(np.uint8)
        next_tok = np.where(has_next, np.where(short, firsts.first_tok[token], best_tok), 0)
        shard = (pos // layout.shard_tokens).astype(np.uint16)
        profile.seconds["backward"] += time.perf_counter() - began
        with profile.stage("write features"):
            _write_sorted_features(layout, shard, ends, len_byte, next_tok)


def _write_sorted_features(layout: Layout, shard, ends, len_byte, next_tok) -> None:
    """Features of rows visited backwards: each shard's rows are the entries just before
    ``ends[k]`` of its sorted order, the last first (``ends`` moves down past them)."""
    width = np.dtype(layout.token_dtype).itemsize
    order = np.argsort(shard, kind="stable")
    for group in np.split(order, np.flatnonzero(np.diff(shard[order])) + 1):
        k = int(shard[group[0]])
        lo = int(ends[k]) - len(group)
        ends[k] = lo
        rows = group[::-1]  # back to the sorted order
        n = layout.sizes[k]
        next_rows = next_tok[rows].astype(layout.token_dtype)
        write_at(
            sorted_features_path(layout, k),
            [(lo, len_byte[rows]), (n + lo * width, next_rows)],
            sync=False,
        )


def _write_order(layout: Layout, start: int, pos, follow, first_words) -> None:
    """Ranks ``start..start + len(pos)`` of the global order: positions, followers and the
    sampled key words."""
    width = layout.order_width
    packed = pos.astype("<u8").view(np.uint8).reshape(-1, 8)[:, :width]
    packed = np.ascontiguousarray(packed)
    write_at(layout.order_path("positions"), [(start * width, packed)], sync=False)
    write_at(layout.order_path("follow"), [(start * follow.itemsize, follow)], sync=False)
    sample = fmt.KEY_SAMPLE
    first = -(-start // sample)  # the first sampled rank at or after start
    words = first_words[first * sample - start :: sample].astype(fmt.KEY_DTYPE)
    if len(words):
        offset = first * fmt.KEY_DTYPE.itemsize
        write_at(layout.order_path("keys"), [(offset, words)], sync=False)


def sorted_features_path(layout: Layout, k: int):
    """Pass 3's work file for shard ``k``: features in sorted order (removed at the end)."""
    return layout.path(k, "match").with_suffix(".match-sorted")


def _sparse(path: Path, size: int) -> None:
    """Create ``path`` as an empty file of ``size`` bytes, unless it is there with that size."""
    if path.exists() and path.stat().st_size == size:
        return
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.truncate(size)
    os.replace(tmp, path)


def create_work_files(layout: Layout) -> None:
    """Create the order files and the work files of the shards whose ``.match`` is not written
    yet. They are sparse: no space is taken until the jobs write into them (``write_at``,
    which raises ENOSPC on a full disk)."""
    sizes = fmt.order_file_bytes(
        {
            "num_tokens": layout.num_tokens,
            "token_dtype": layout.token_dtype,
            "separator": layout.separator,
        }
    )
    for kind, size in sizes.items():
        if kind != "buckets":
            _sparse(layout.order_path(kind), size)
    width = 1 + np.dtype(layout.token_dtype).itemsize
    for k, n in enumerate(layout.sizes):
        if not layout.path(k, "match").exists():
            _sparse(sorted_features_path(layout, k), n * width)
    fsync_path(Path(layout.directory))  # the jobs recorded in the catalog live in these files


_libc = ctypes.CDLL(None, use_errno=True)
PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
PAGE = 4096


def _punch(fd: int, start: int, stop: int) -> None:
    """Give back the disk space of the whole pages inside ``[start, stop)`` (they read as zeros
    after); the bytes of pages it shares with its neighbours stay."""
    a, b = -(-start // PAGE) * PAGE, stop // PAGE * PAGE
    if b > a and _libc.fallocate(fd, PUNCH_HOLE, ctypes.c_long(a), ctypes.c_long(b - a)) != 0:
        errno = ctypes.get_errno()
        if errno not in (95,):  # EOPNOTSUPP: a filesystem without holes keeps the space
            raise OSError(errno, os.strerror(errno))


def release_runs(layout: Layout, spans: np.ndarray) -> None:
    """Give back the disk space of the parts of pass 2's keys that a finished job merged
    (``spans``: its row of ``run_spans``). Called only after the job is recorded as done: what
    it frees is never read again."""
    width = layout.sort_dtype.itemsize
    for k, (n, (lo, hi, e0, e1)) in enumerate(zip(layout.sizes, spans.tolist())):
        path = layout.path(k, "run")
        if hi == lo or not path.exists():
            continue
        fd = os.open(path, os.O_WRONLY)
        try:
            for start, stop in (
                (lo, hi),
                (n + lo, n + hi),
                (2 * n + lo * width, 2 * n + hi * width),
                ((2 + width) * n + e0 * width, (2 + width) * n + e1 * width),
            ):
                _punch(fd, start, stop)
        finally:
            os.close(fd)


def remove_runs(layout: Layout) -> None:
    """Drop pass 2's keys once every job has merged them."""
    for k in range(layout.num_shards):
        for kind in ("run", "runidx"):
            layout.path(k, kind).unlink(missing_ok=True)


def write_match_file(layout: Layout, k: int) -> tuple[int, int]:
    """Scatter shard ``k``'s sorted-order features to position order (the ``.match`` file), then
    remove the shard's work files (``.prefix`` last: a re-run after a crash in between finds
    the ``.match`` and has nothing to do)."""
    work = sorted_features_path(layout, k)
    if layout.path(k, "match").exists():
        work.unlink(missing_ok=True)
        layout.path(k, "prefix").unlink(missing_ok=True)
        return k, layout.sizes[k]
    n, dtype = layout.sizes[k], np.dtype(layout.token_dtype)
    prefix = np.fromfile(layout.path(k, "prefix"), dtype=fmt.PREFIX_DTYPE)
    sorted_features = np.fromfile(work, dtype=np.uint8)
    out = np.empty(n * (1 + dtype.itemsize), dtype=np.uint8)
    out[:n][prefix] = sorted_features[:n]
    out[n:].view(dtype)[prefix] = sorted_features[n:].view(dtype)
    write_atomic(layout.path(k, "match"), out)
    work.unlink()
    layout.path(k, "prefix").unlink()
    return k, n
