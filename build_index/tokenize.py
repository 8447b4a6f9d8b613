"""Pass 1: read the source, tokenize it into fixed-size shards and record its documents.

A shard is the unit of work: its token file is written atomically, then one catalog transaction
records it together with the documents that ended inside it and the point where the next shard
starts (document number and offset), so a re-run skips straight there.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from teralm.build_index.sources import Source, SourceError
from teralm.index import format as fmt
from teralm.index.catalog import Catalog, doc_key, unit_key
from teralm.index.tokenizer import BPETokenizer, Tokenizer

BPE_SAMPLE_BYTES = 64 << 20
BATCH_BYTES = 8 << 20
SHARD_KEY = "p1/shard"


def train_bpe(source: Source, vocab_size: int, out: Path) -> BPETokenizer:
    """Train the BPE model on the first BPE_SAMPLE_BYTES of the corpus and save it atomically."""

    def sample() -> Iterator[str]:
        seen = 0
        for (label, text), _ in source.documents():
            text = _as_text(label, text)
            yield text
            seen += len(text)
            if seen >= BPE_SAMPLE_BYTES:
                return

    tokenizer = BPETokenizer.train(sample(), vocab_size)
    fmt.write_atomic(out / fmt.TOKENIZER, tokenizer.to_json().encode())
    return tokenizer


def _as_text(label: str, text: str | bytes) -> str:
    if isinstance(text, str):
        return text
    try:
        return text.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SourceError(
            f"{label}: not valid UTF-8 (byte {e.start}); BPE needs UTF-8 text, "
            "use --tokenizer bytes to index raw bytes"
        ) from None


def _tokenized(source: Source, tokenizer: Tokenizer, skip: int, bar) -> Iterator[tuple]:
    """(doc number, label, tokens) for documents ``skip`` onwards, encoded in batches."""
    batch: list[tuple[int, str, str | bytes]] = []
    size = 0

    def flush():
        bpe = isinstance(tokenizer, BPETokenizer)
        texts = [_as_text(label, text) if bpe else text for _, label, text in batch]
        for (i, label, _), tokens in zip(batch, tokenizer.encode_batch(texts)):
            yield i, label, tokens

    for i, ((label, text), done) in enumerate(source.documents()):
        if done:
            bar.update(done - bar.n)
        if i < skip:
            continue
        batch.append((i, label, text))
        size += len(text)
        if size >= BATCH_BYTES:
            yield from flush()
            batch, size = [], 0
    yield from flush()


def tokenize_pass(
    source: Source,
    tokenizer: Tokenizer,
    catalog: Catalog,
    out: Path,
    shard_tokens: int,
    progress: bool,
) -> None:
    """Write every shard not yet recorded, resuming after the last recorded one."""
    last = None
    for _, record in catalog.prefixed(SHARD_KEY + "/"):
        last = record
    shard = 0 if last is None else last["shard"] + 1
    written = 0 if last is None else last["start"] + last["num_tokens"]
    next_doc = 0 if last is None else last["next_doc"]
    doc_offset = 0 if last is None else last["doc_offset"]
    docs = 0 if last is None else last["docs"]

    buf = np.empty(shard_tokens, dtype=tokenizer.dtype)
    fill = 0
    pending: dict[bytes, dict] = {}

    def commit(resume_doc: int, resume_offset: int) -> None:
        nonlocal shard, written, fill, pending
        fmt.write_atomic(fmt.shard_file(out, shard, "tokens"), buf[:fill])
        record = {
            "shard": shard,
            "start": written,
            "num_tokens": fill,
            "next_doc": resume_doc,
            "doc_offset": resume_offset,
            "docs": docs,
        }
        if tokenizer.dtype.itemsize == 1:
            record["histogram"] = np.bincount(buf[:fill], minlength=256).tolist()
        catalog.put({unit_key(SHARD_KEY, shard): record, **pending})
        shard, written, fill, pending = shard + 1, written + fill, 0, {}

    bar = tqdm(
        total=source.total_bytes(),
        unit="B",
        unit_scale=True,
        desc="pass 1/4 tokenize",
        disable=not progress,
    )
    last_doc = next_doc - 1
    with bar:
        for i, label, tokens in _tokenized(source, tokenizer, next_doc, bar):
            last_doc = i
            skip = doc_offset if i == next_doc else 0
            if len(tokens) == 0:
                continue
            start = written + fill - skip
            consumed = skip
            while consumed < len(tokens):
                take = min(len(tokens) - consumed, shard_tokens - fill)
                buf[fill : fill + take] = tokens[consumed : consumed + take]
                fill += take
                consumed += take
                if consumed == len(tokens):
                    pending[doc_key(docs)] = {
                        "start": start,
                        "length": len(tokens),
                        "source": label,
                    }
                    docs += 1
                if fill == shard_tokens:
                    done = consumed == len(tokens)
                    commit(i + 1 if done else i, 0 if done else consumed)
        if fill:
            commit(last_doc + 1, 0)


def finish_tokenize(catalog: Catalog, out: Path, tokenizer: Tokenizer) -> dict:
    """Summarise pass 1: shard sizes, document offsets file, separator value."""
    shards = [record for _, record in catalog.prefixed(SHARD_KEY + "/")]
    sizes = [s["num_tokens"] for s in shards]
    num_tokens = sum(sizes)
    if num_tokens == 0:
        raise SourceError("the corpus contains no text (0 tokens): nothing to index")
    starts = [record["start"] for _, record in catalog.prefixed(b"doc/")]
    offsets = np.array([*starts, num_tokens], dtype=fmt.OFFSET_DTYPE)
    fmt.write_atomic(out / fmt.DOCUMENT_OFFSETS, offsets)
    if tokenizer.dtype.itemsize == 1:
        histogram = np.sum([s["histogram"] for s in shards], axis=0)
        unused = np.flatnonzero(histogram == 0)
        separator = int(unused[0]) if len(unused) else 256
    else:
        separator = tokenizer.vocab_size
    return {
        "sizes": sizes,
        "num_tokens": num_tokens,
        "num_documents": len(starts),
        "separator": separator,
    }
