"""Checks of a built index: checksums, sortedness of a sample, features against brute force."""

from __future__ import annotations

from pathlib import Path

import lmdb
import numpy as np
from tqdm import tqdm

from teralm.build_index.layout import Layout
from teralm.files import sha256_file
from teralm.index import format as fmt
from teralm.index.catalog import DOC_PREFIX, Catalog
from teralm.index.reader import decode_features, open_match
from teralm.kernels import match as km

COMPARE_LIMIT = 4096
BRUTE_FORCE_WINDOW = 1 << 26  # sampled positions lie in the first 2^26 tokens (memory, time)


def file_checksums(layout: Layout, progress: bool) -> tuple[list[dict], dict]:
    """``{kind: {"bytes", "sha256"}}`` for every shard file (None for a missing one), and the
    same for the files of the global order."""
    shards = [
        {kind: layout.path(k, kind) for kind in fmt.FILE_KINDS} for k in range(layout.num_shards)
    ]
    order = {kind: layout.order_path(kind) for kind in fmt.ORDER_KINDS}
    total = sum(p.stat().st_size for row in [*shards, order] for p in row.values() if p.exists())
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="checksums", disable=not progress
    ) as bar:

        def sums(row: dict[str, Path]) -> dict:
            return {
                kind: {"bytes": p.stat().st_size, "sha256": sha256_file(p, bar)}
                if p.exists()
                else None
                for kind, p in row.items()
            }

        return [sums(row) for row in shards], sums(order)


def check_checksums(layout: Layout, manifest: dict, progress: bool) -> list[str]:
    """Compare the checksum of every file the manifest records one for (all present)."""
    directory = Path(layout.directory)
    recorded, actual = {}, {}
    if manifest["tokenizer"] == "bpe":
        recorded[fmt.TOKENIZER] = manifest.get("tokenizer_sha256")
        actual[fmt.TOKENIZER] = sha256_file(directory / fmt.TOKENIZER)
    shards, order = file_checksums(layout, progress)
    for k, files in enumerate(shards):
        for kind, record in files.items():
            name = layout.path(k, kind).name
            recorded[name] = manifest["shards"][k]["files"][kind]["sha256"]
            actual[name] = record["sha256"]
    for kind, record in order.items():
        name = layout.order_path(kind).name
        recorded[name] = manifest["order"]["files"][kind]["sha256"]
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


def _order(layout: Layout) -> tuple[np.ndarray, int]:
    """``order.positions`` mapped as bytes, and its entry width."""
    return np.memmap(layout.order_path("positions"), dtype=np.uint8, mode="r"), layout.order_width


def _ranked(raw: np.ndarray, width: int, i: int, count: int = 1) -> np.ndarray:
    return fmt.positions(np.asarray(raw[i * width : (i + count) * width]), width)


def check_sorted(layout: Layout, samples: int, rng: np.random.Generator) -> list[str]:
    """Sample adjacent ranks of the global order and check their keys are in order: the first
    ``sort_depth`` elements, then the shard, then the whole key."""
    stream, offsets, problems = layout.stream(), layout.offsets(), []
    raw, width = _order(layout)
    depth, n = layout.sort_depth, layout.num_tokens
    for i in rng.integers(0, n - 1, size=samples if n > 1 else 0):
        a, b = (int(p) for p in _ranked(raw, width, int(i), 2))
        ka, kb = _context(stream, layout, offsets, a), _context(stream, layout, offsets, b)
        shard_a, shard_b = a // layout.shard_tokens, b // layout.shard_tokens
        m = min(len(ka), len(kb))
        if ka[:depth] != kb[:depth]:
            in_order = ka[:depth] < kb[:depth]
        else:
            in_order = shard_a < shard_b or (shard_a == shard_b and ka[:m] <= kb[:m])
        if not in_order:
            problems.append(f"positions {a} and {b} are out of order at rank {i}")
    return problems


def check_follow(layout: Layout, samples: int, rng: np.random.Generator) -> list[str]:
    """Sample ranks of ``order.follow`` and compare with the token after the ranked position."""
    stream, problems = layout.stream(), []
    bits = km.doc_start_bits(layout.offsets(), layout.num_tokens)
    dtype = fmt.sort_dtype(layout.token_dtype, layout.separator)
    follow = np.memmap(layout.order_path("follow"), dtype=dtype, mode="r")
    raw, width = _order(layout)
    for i in rng.integers(0, len(follow), size=samples if len(follow) else 0):
        p = int(_ranked(raw, width, int(i))[0])
        ends = p + 1 >= layout.num_tokens or km.is_doc_start(bits, p + 1)
        expected = layout.separator if ends else int(stream[p + 1 : p + 2][0])
        if int(follow[i]) != expected:
            problems.append(f"order.follow: follower {int(follow[i])} at rank {i}, not {expected}")
    return problems


def check_features(layout: Layout, samples: int, rng: np.random.Generator) -> list[str]:
    """Compare stored features of random positions with an O(t) brute force."""
    n = layout.num_tokens
    if samples <= 0:
        return []
    positions = np.unique(rng.integers(0, min(n, BRUTE_FORCE_WINDOW), size=samples))
    x = layout.stream()[0 : min(n, int(positions.max()) + 2)]
    offsets = layout.offsets()
    bits = km.doc_start_bits(np.append(offsets[offsets < len(x)], len(x)), len(x))
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
    """Document offsets in order, the bucket table in order, and every entry of the global order
    inside the corpus: what the query kernels rely on."""
    offsets, n = layout.offsets(), layout.num_tokens
    buckets = np.fromfile(layout.order_path("buckets"), dtype=fmt.BUCKET_DTYPE)
    problems = [fmt.offsets_problem(offsets, n), fmt.bucket_problem(buckets, n)]
    raw, width = _order(layout)
    step = (1 << 22) * width
    for at in range(0, len(raw), step):
        if fmt.positions(np.asarray(raw[at : at + step]), width).max() >= n:
            problems.append("order.positions: an entry lies outside the corpus")
            break
    return [p for p in problems if p]


def catalog_checksum(catalog: Catalog) -> dict:
    """The manifest's record of the catalog's documents (their number and one sha256)."""
    documents, sha256 = catalog.digest(DOC_PREFIX)
    return {"documents": documents, "sha256": sha256}


def check_catalog(directory: Path, manifest: dict) -> list[str]:
    """The catalog opens and its document records are those the manifest's checksum covers
    (an index of an older teralm has none: there, a record of the last document)."""
    try:
        catalog = Catalog(Path(directory) / fmt.CATALOG, readonly=True)
        try:
            if "catalog" not in manifest:
                last = manifest["num_documents"] - 1
                found = catalog.document(last) is not None
                return [] if found else [f"{fmt.CATALOG}: no record of document {last}"]
            if catalog_checksum(catalog) != manifest["catalog"]:
                return [f"{fmt.CATALOG}: the document records differ from the manifest's checksum"]
            return []
        finally:
            catalog.close()
    except lmdb.Error as e:
        return [f"{fmt.CATALOG}: {e}"]


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
    problems = contents + check_catalog(directory, manifest)
    if checksums:
        problems += check_checksums(layout, manifest, progress)
    if not contents:  # the sampled checks follow the order's entries and document starts
        problems += verify(layout, samples, seed)
    return problems
