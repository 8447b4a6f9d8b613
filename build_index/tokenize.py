"""Pass 1: read the source, tokenize it into fixed-size shards and record its documents.

A shard is the unit of work: its token file is written atomically, then one catalog transaction
records it together with the documents that ended inside it and the point where the next shard
starts (document number and offset), so a re-run skips straight there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from teralm.build_index.sources import LineNumbers, Piece, Source
from teralm.errors import SourceError
from teralm.files import write_atomic
from teralm.index import format as fmt
from teralm.index.catalog import Catalog, doc_key, unit_key
from teralm.index.tokenizer import BPETokenizer, Tokenizer, load_tokenizer
from teralm.kernels.sort import byte_histogram

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
    write_atomic(out / fmt.TOKENIZER, tokenizer.to_json().encode())
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


@dataclass
class PieceTokens:
    """One piece's documents tokenized (see ``tokenize_piece``)."""

    index: int
    labels: list[str | int]
    tokens: list[np.ndarray]
    lines: int


_tokenizers: dict[tuple, Tokenizer] = {}  # a worker's, loaded once per model file


def _tokenizer(kind: str, out: Path) -> Tokenizer:
    """The build's tokenizer, loaded once per process (again when its model file changed)."""
    path = out / fmt.TOKENIZER
    stamp = (path.stat().st_mtime_ns, path.stat().st_size) if kind != "bytes" else None
    key = (kind, str(out), stamp)
    if key not in _tokenizers:
        _tokenizers[key] = load_tokenizer(out, kind)
    return _tokenizers[key]


def tokenize_piece(source: Source, piece: Piece, index: int, kind: str, out: Path, skip: int):
    """Read ``piece`` (the ``index``-th) of ``source`` and tokenize its documents (those before the
    ``skip``-th as empty) in batches of about BATCH_BYTES; any process can run it."""
    tokenizer = _tokenizer(kind, out)
    bpe = isinstance(tokenizer, BPETokenizer)
    result, lines = PieceTokens(index, [], [], 0), []

    def documents():
        lines.append((yield from source.read(piece)))

    batch, size = [], 0
    for (label, text), _ in documents():
        result.labels.append(label)
        if len(result.labels) <= skip:
            result.tokens.append(np.empty(0, tokenizer.dtype))
            continue
        batch.append(_as_text(str(label), text) if bpe else text)
        size += len(text)
        if size >= BATCH_BYTES:
            result.tokens += tokenizer.encode_batch(batch)
            batch, size = [], 0
    result.tokens += tokenizer.encode_batch(batch)
    result.lines = lines[0] or 0
    return result


class _ShardWriter:
    """Pass 1's one writer: appends the pieces' documents, in order, to fixed-size shards; a full
    shard is written atomically, then recorded with its documents and where to resume. That
    happens on the ``saver`` thread (one shard at a time) while the next shard fills."""

    def __init__(
        self,
        catalog: Catalog,
        out: Path,
        shard_tokens: int,
        dtype,
        last: dict | None,
        saver: ThreadPoolExecutor,
    ):
        self.catalog, self.out, self.saver = catalog, out, saver
        self.saving: Future | None = None
        last = last or {"shard": -1, "start": 0, "num_tokens": 0, "next_doc": 0, "docs": 0}
        self.shard, self.written = last["shard"] + 1, last["start"] + last["num_tokens"]
        self.next_doc, self.docs = last["next_doc"], last["docs"]  # next: of all, even empty
        self.piece, self.piece_doc = last.get("piece", 0), last.get("piece_doc", 0)
        self.doc_offset = last.get("doc_offset", 0)
        path = last.get("path")
        self.lines = LineNumbers(None if path is None else Path(path), last.get("first_line", 1))
        self.buf, self.spare = (
            np.empty(shard_tokens, dtype=dtype),
            np.empty(shard_tokens, dtype=dtype),
        )
        self.fill = 0
        self.pending: dict[bytes, dict] = {}

    def add(self, piece: Piece, result: PieceTokens) -> None:
        """Append the documents of the next piece (of a resumed one, from where it stopped)."""
        for j in range(self.piece_doc, len(result.tokens)):
            tokens, consumed = result.tokens[j], self.doc_offset
            start = self.written + self.fill - consumed
            while consumed < len(tokens):
                take = min(len(tokens) - consumed, len(self.buf) - self.fill)
                self.buf[self.fill : self.fill + take] = tokens[consumed : consumed + take]
                self.fill += take
                consumed += take
                if consumed == len(tokens):
                    self.pending[doc_key(self.docs)] = {
                        "start": start,
                        "length": len(tokens),
                        "source": self.lines.label(piece, result.labels[j]),
                    }
                    self.docs += 1
                if self.fill == len(self.buf):
                    done = consumed == len(tokens)
                    self._commit(j + done, 0 if done else consumed)
            self.next_doc += 1
            self.piece_doc, self.doc_offset = j + 1, 0
        self.lines.passed(piece, result.lines)
        self.piece, self.piece_doc = self.piece + 1, 0

    def finish(self) -> None:
        """Write the last, partly filled shard, and wait until every shard is recorded."""
        if self.fill:
            self._commit(self.piece_doc, 0)
        self._saved()

    def _saved(self) -> None:
        """Wait for the shard being saved (raising its error)."""
        if self.saving is not None:
            self.saving.result()
            self.saving = None

    def _commit(self, piece_doc: int, offset: int) -> None:
        """Write and record the shard, to resume at document ``piece_doc`` of the current piece
        (``offset`` tokens into it)."""
        record = {
            "shard": self.shard,
            "start": self.written,
            "num_tokens": self.fill,
            "next_doc": self.next_doc + piece_doc - self.piece_doc,
            "doc_offset": offset,
            "docs": self.docs,
            "piece": self.piece,
            "piece_doc": piece_doc,
            "path": None if self.lines.path is None else str(self.lines.path),
            "first_line": self.lines.first,
        }
        self._saved()
        self.saving = self.saver.submit(self._save, self.buf[: self.fill], record, self.pending)
        self.buf, self.spare = self.spare, self.buf
        self.shard, self.written = self.shard + 1, self.written + self.fill
        self.fill, self.pending = 0, {}

    def _save(self, tokens: np.ndarray, record: dict, documents: dict) -> None:
        """Write one shard's tokens, then record it with its documents."""
        write_atomic(fmt.shard_file(self.out, record["shard"], "tokens"), tokens)
        if tokens.dtype.itemsize == 1:
            record["histogram"] = byte_histogram(tokens).tolist()
        self.catalog.put({unit_key(SHARD_KEY, record["shard"]): record, **documents})


def tokenize_pass(
    source: Source,
    tokenizer: Tokenizer,
    catalog: Catalog,
    out: Path,
    shard_tokens: int,
    progress: bool,
    run_units: Callable,
    workers: int,
) -> None:
    """Write every shard not yet recorded, resuming after the last recorded one. The source's
    pieces are read and tokenized by ``run_units`` (``builder._run_units``' interface) on
    ``workers`` processes, and appended to the shards here, in order."""
    last = None
    for _, record in catalog.prefixed(SHARD_KEY + "/"):
        last = record
    if last is not None and "piece" not in last:
        raise SourceError(
            f"pass 1 in {out} was started by an older teralm; delete the folder (or give --force) "
            "to build it again"
        )
    pieces = source.pieces()
    ready: dict[int, PieceTokens] = {}
    saver = ThreadPoolExecutor(1)  # waited for on the way out, whatever happens
    writer = _ShardWriter(catalog, out, shard_tokens, tokenizer.dtype, last, saver)
    bar = tqdm(
        total=source.total_bytes(),
        initial=sum(p.size for p in pieces[: writer.piece]),
        unit="B",
        unit_scale=True,
        desc="pass 1/4 tokenize",
        disable=not progress,
    )

    def piece_done(result: PieceTokens) -> None:
        ready[result.index] = result
        while writer.piece in ready:
            piece = pieces[writer.piece]
            writer.add(piece, ready.pop(writer.piece))
            bar.update(piece.size)

    units = [
        (source, pieces[i], i, tokenizer.name, out, writer.piece_doc if i == writer.piece else 0)
        for i in range(writer.piece, len(pieces))
    ]
    with saver, bar:
        run_units(tokenize_piece, units, workers, piece_done)
        writer.finish()


def finish_tokenize(catalog: Catalog, out: Path, tokenizer: Tokenizer) -> dict:
    """Summarise pass 1: shard sizes, document offsets file, separator value."""
    shards = [record for _, record in catalog.prefixed(SHARD_KEY + "/")]
    sizes = [s["num_tokens"] for s in shards]
    num_tokens = sum(sizes)
    if num_tokens == 0:
        raise SourceError("the corpus contains no text (0 tokens): nothing to index")
    starts = [record["start"] for _, record in catalog.prefixed(b"doc/")]
    offsets = np.array([*starts, num_tokens], dtype=fmt.OFFSET_DTYPE)
    write_atomic(out / fmt.DOCUMENT_OFFSETS, offsets)
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
