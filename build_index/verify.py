"""Checks of a built index: checksums, sortedness of a sample, features against brute force."""

from __future__ import annotations

from pathlib import Path

import lmdb
import numpy as np
from tqdm import tqdm

from teralm.build_index.layout import Layout
from teralm.index import format as fmt
from teralm.index.catalog import Catalog
from teralm.index.reader import decode_features, open_match
from teralm.kernels import match as km

COMPARE_LIMIT = 4096
BRUTE_FORCE_WINDOW = 1 << 28  # sampled positions lie in the first 2^28 tokens (memory, time)


def shard_checksums(layout: Layout, progress: bool) -> list[dict]:
    """``{kind: {"bytes", "sha256"}}`` for every shard file (None for a missing one)."""
    paths = [[layout.path(k, kind) for kind in fmt.FILE_KINDS] for k in range(layout.num_shards)]
    total = sum(p.stat().st_size for row in paths for p in row if p.exists())
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="checksums", disable=not progress
    ) as bar:
        return [
            {
                kind: {"bytes": p.stat().st_size, "sha256": fmt.sha256_file(p, bar)}
                if p.exists()
                else None
                for kind, p in zip(fmt.FILE_KINDS, row)
            }
            for row in paths
        ]


def check_checksums(layout: Layout, manifest: dict, progress: bool) -> list[str]:
    """Compare the checksum of every file the manifest records one for (all present)."""
    directory = Path(layout.directory)
    recorded = {fmt.BUCKETS: manifest["buckets_sha256"]}
    if manifest["tokenizer"] == "bpe":
        recorded[fmt.TOKENIZER] = manifest.get("tokenizer_sha256")
    actual = {name: fmt.sha256_file(directory / name) for name in recorded}
    for k, files in enumerate(shard_checksums(layout, progress)):
        for kind, record in files.items():
            name = layout.path(k, kind).name
            recorded[name] = manifest["shards"][k]["files"][kind]["sha256"]
            actual[name] = record["sha256"]
    return [
        f"{name}: checksum differs from the manifest"
        for name in recorded
        if actual[name] != recorded[name]
    ]


def _context(stream, layout: Layout, offsets: np.ndarray, p: int) -> list[int]:
    """Reversed context of ``p`` as sorted in its shard: back to its bound, then the separator."""
    k = p // layout.shard_tokens
    doc_start = int(offsets[np.searchsorted(offsets, p, side="right") - 1])
    bound = max(doc_start, layout.shard_start(k) - layout.overlap)
    lo = max(bound, p - COMPARE_LIMIT + 1)
    key = stream[lo : p + 1][::-1].tolist()
    return key + [layout.separator] if lo == bound else key


def check_sorted(layout: Layout, samples: int, rng: np.random.Generator) -> list[str]:
    """Sample adjacent pairs of every ``.prefix`` and check their contexts are in order."""
    stream, offsets, problems = layout.stream(), layout.offsets(), []
    for k in range(layout.num_shards):
        prefix = np.memmap(layout.path(k, "prefix"), dtype=fmt.PREFIX_DTYPE, mode="r")
        if len(prefix) < 2:
            continue
        for i in rng.integers(0, len(prefix) - 1, size=samples):
            a, b = (layout.shard_start(k) + int(x) for x in prefix[i : i + 2])
            ka, kb = _context(stream, layout, offsets, a), _context(stream, layout, offsets, b)
            n = min(len(ka), len(kb))
            if ka[:n] > kb[:n]:
                problems.append(f"shard {k}: positions {a} and {b} are out of order at rank {i}")
    return problems


def check_follow(layout: Layout, samples: int, rng: np.random.Generator) -> list[str]:
    """Sample ranks of every ``.follow`` and compare with the token after the ranked position."""
    stream, problems = layout.stream(), []
    bits = km.doc_start_bits(layout.offsets(), layout.num_tokens)
    dtype = fmt.sort_dtype(layout.token_dtype, layout.separator)
    for k in range(layout.num_shards):
        prefix = np.memmap(layout.path(k, "prefix"), dtype=fmt.PREFIX_DTYPE, mode="r")
        follow = np.memmap(layout.path(k, "follow"), dtype=dtype, mode="r")
        for i in rng.integers(0, len(prefix), size=samples if len(prefix) else 0):
            p = layout.shard_start(k) + int(prefix[i])
            ends = p + 1 >= layout.num_tokens or km._is_doc_start(bits, p + 1)
            expected = layout.separator if ends else int(stream[p + 1 : p + 2][0])
            if int(follow[i]) != expected:
                problems.append(f"shard {k}: follower {int(follow[i])} at rank {i}, not {expected}")
    return problems


def check_features(layout: Layout, samples: int, rng: np.random.Generator) -> list[str]:
    """Compare stored features of random positions with an O(t) brute force."""
    n = layout.num_tokens
    if samples <= 0:
        return []
    positions = np.unique(rng.integers(0, min(n, BRUTE_FORCE_WINDOW), size=samples))
    stream = layout.stream()
    x = stream[0 : min(n, int(positions.max()) + 2)]
    bits = km.doc_start_bits(layout.offsets(), n)
    # room for every value the token dtype holds: a damaged token must not index past the end
    valid = np.zeros(
        max(layout.vocab_size + 1, 1 << 8 * np.dtype(layout.token_dtype).itemsize), np.bool_
    )
    problems = []
    for t in positions:
        k, q = divmod(int(t), layout.shard_tokens)
        raw_len, raw_next = open_match(
            layout.directory, k, layout.sizes[k], layout.token_dtype, "r"
        )
        stored = decode_features(raw_len[q : q + 1], raw_next[q : q + 1], layout.vocab_size)
        length, nxt = int(stored.match_len[0]), int(stored.next_token[0])
        valid[:] = False
        expected = km.brute_force_at(x, bits, int(t), layout.max_match, valid)
        if length != expected:
            problems.append(f"position {t}: match length {length}, brute force says {expected}")
        elif nxt == layout.vocab_size and valid.any():
            problems.append(f"position {t}: no next token stored, but one exists")
        elif nxt != layout.vocab_size and not valid[nxt]:
            problems.append(f"position {t}: next token {nxt} never follows a longest match")
    return problems


def verify(layout: Layout, samples: int, seed: int = 0) -> list[str]:
    """Sortedness, follower and feature checks on ``samples`` random positions (per shard for sorting)."""
    rng = np.random.default_rng(seed)
    return (
        check_sorted(layout, samples, rng)
        + check_follow(layout, samples, rng)
        + check_features(layout, samples, rng)
    )


def check_contents(layout: Layout) -> list[str]:
    """Document offsets in order, bucket table rows in order, and every ``.prefix`` entry
    inside its shard: what the query kernels rely on."""
    directory, offsets = Path(layout.directory), layout.offsets()
    buckets = np.fromfile(directory / fmt.BUCKETS, dtype=fmt.BUCKET_DTYPE)
    problems = [
        fmt.offsets_problem(offsets, layout.num_tokens),
        fmt.bucket_problem(buckets.reshape(layout.num_shards, -1), list(layout.sizes)),
    ]
    for k, size in enumerate(layout.sizes):
        prefix = np.memmap(layout.path(k, "prefix"), dtype=fmt.PREFIX_DTYPE, mode="r")
        if prefix.max() >= size:
            problems.append(f"{layout.path(k, 'prefix').name}: an entry lies outside the shard")
    return [p for p in problems if p]


def check_catalog(directory: Path, num_documents: int) -> list[str]:
    """The catalog opens and holds a record of the last document."""
    last = num_documents - 1
    try:
        catalog = Catalog(Path(directory) / fmt.CATALOG, readonly=True)
        try:
            found = catalog.document(last) is not None
        finally:
            catalog.close()
    except lmdb.Error as e:
        return [f"{fmt.CATALOG}: {e}"]
    return [] if found else [f"{fmt.CATALOG}: no record of document {last}"]


def verify_index(
    directory: Path,
    manifest: dict,
    samples: int,
    seed: int = 0,
    checksums: bool = True,
    progress: bool = False,
) -> list[str]:
    """Every check of a complete index (``teralm verify-index``): the files readers open (present,
    of the right size), their contents, checksums, then ``verify`` on ``samples`` positions."""
    problems = fmt.file_problems(directory, manifest)
    if problems:  # the checks below read these files whole
        return problems
    layout = Layout.from_manifest(directory, manifest)
    contents = check_contents(layout)
    problems = contents + check_catalog(directory, manifest["num_documents"])
    if checksums:
        problems += check_checksums(layout, manifest, progress)
    if not contents:  # the sampled checks follow .prefix entries and document starts
        problems += verify(layout, samples, seed)
    return problems
