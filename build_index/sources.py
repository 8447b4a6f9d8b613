"""Corpus sources for build-index: enwik8/9, the Python stdlib, text files, folders, JSONL, Parquet
and Hugging Face datasets. Each yields documents in a fixed order, as (label, text) pairs.

A source is a list of pieces that separate processes can read on their own (``Source.pieces``):
the files of a folder, the row groups of a Parquet file, and ranges of PIECE_BYTES of a plain JSON
lines file or an enwik dump (the lines, or the pages, that start in the range); other sources are
one piece. Reading the pieces in order gives the documents in order (``Source.documents``).

Every source is streamed, so memory stays flat however large the corpus: the enwik XML is read in
chunks of ENWIK_CHUNK_BYTES and split at its ``  <page>`` markers; JSON lines one line at a time;
Parquet by record batches; Hugging Face datasets by iterating them. A text file (alone or in a folder)
of up to TEXT_PIECE_BYTES is one document, labelled with its name; a larger one is read in pieces of at
most TEXT_PIECE_BYTES, each cut after its last newline (at the piece boundary if it has none, moved
back to the start of a UTF-8 character), and each piece is one document labelled ``name@offset``.
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import json
import os
import re
import socket
import sysconfig
import urllib.error
import urllib.request
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from teralm.errors import SourceError

ENWIK_URL = "http://mattmahoney.net/dc/{name}.zip"
ENWIK_SIZES = {"enwik8": 100_000_000, "enwik9": 1_000_000_000}
ENWIK_MD5 = {  # of the unzipped files, as the Large Text Compression Benchmark publishes them
    "enwik8": "a1fa5ffddb56f4953e226637dabbb36a",
    "enwik9": "e206c3450ac99950df65bf70ef61a12d",
}
TEXT_SUFFIXES = {
    ".txt",
    ".md",
    ".rst",
    ".py",
    ".html",
    ".xml",
    ".csv",
    ".tex",
    ".c",
    ".h",
    ".jsonl",
    ".gz",
}
COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".zip", ".lz4", ".7z")
ENWIK_CHUNK_BYTES = 16 << 20
ENWIK_HEADER_BYTES = 1 << 20  # the XML before the first page; enwik's is about 1 KB
TEXT_PIECE_BYTES = 64 << 20
PIECE_BYTES = 16 << 20  # of a JSON lines file or an enwik dump, per piece (see Source.pieces)
PAGE_MARKER = b"  <page>"
LABEL_FIELDS = ("title", "path", "url", "id")

Document = tuple[str, "str | bytes"]
# a piece's document: its label, or for a JSON line without a label field the line's number
# counted from the piece's first line (0); see Source.read
PieceDocument = tuple["str | int", "str | bytes"]


@dataclass(frozen=True)
class Piece:
    """A part of a source that one process reads alone: the documents of ``path`` (``None``: of
    the whole source) that start in ``[start, stop)`` (bytes; row groups for Parquet, ``stop``
    -1: to the end), ``size`` bytes of it."""

    path: Path | None
    start: int = 0
    stop: int = -1
    size: int = 0


LOCAL_FORMATS = (
    "give a local copy instead: a folder written by datasets' save_to_disk (DIR, or DIR:split), "
    "a Parquet file, JSON lines (.jsonl, .jsonl.gz), a text file or a folder of text files"
)
HUB = ("huggingface.co", 443)


def _hub_offline() -> str | None:
    """Why the Hugging Face Hub cannot be used now (None: it answers): HF_HUB_OFFLINE or
    HF_DATASETS_OFFLINE set, or no connection within 3 s (instead of datasets' own retries)."""
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(variable, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{variable} is set"
    try:
        socket.create_connection(HUB, timeout=3).close()
    except OSError as e:
        return f"no connection to {HUB[0]}: {e.strerror or e}"
    return None


def cache_dir() -> Path:
    """Where downloads are kept: $TERALM_CACHE, else ~/.cache/teralm."""
    return Path(os.environ.get("TERALM_CACHE", Path.home() / ".cache" / "teralm"))


@dataclass
class Source:
    """A resolved corpus: how to describe it, fingerprint it and read its documents."""

    name: str
    kind: str
    path: Path | None = None
    text_field: str = "text"
    split: str | None = None  # of a saved dataset (``DIR:split``)

    def fingerprint(self) -> str:
        """Identity of the source's content, to refuse resuming a build over a changed corpus."""
        if self.path is None:
            return f"{self.kind}:{self.name}"
        if self.kind == "enwik":
            return f"enwik:{self.name}:{self.path.stat().st_size}"
        files = sorted(self._files()) if self.path.is_dir() else [self.path]
        digest = hashlib.sha256()
        for f in files:
            st = f.stat()
            digest.update(f"{f}:{st.st_size}:{st.st_mtime_ns}\n".encode())
        return f"{self.kind}:{self.path}:{digest.hexdigest()[:16]}"

    def total_bytes(self) -> int | None:
        """Bytes to read (for the progress bar), when known."""
        if self.path is None:
            return None
        if self.path.is_dir():
            return sum(f.stat().st_size for f in self._files())
        return self.path.stat().st_size

    def documents(self) -> Iterator[tuple[Document, int]]:
        """Yield ((label, text), bytes_read_so_far) in a fixed order: the pieces' documents."""
        done, lines = 0, LineNumbers()
        for piece in self.pieces():
            reader = self.read(piece)
            while True:
                try:
                    (label, text), end = next(reader)
                except StopIteration as stop:
                    lines.passed(piece, stop.value)
                    break
                yield (lines.label(piece, label), text), done + end
            done += piece.size

    def pieces(self) -> list[Piece]:
        """The source's pieces, in order; the same for the same source, whoever asks."""
        if self.kind == "folder":
            return [Piece(f, size=f.stat().st_size) for f in self._files()]
        if self.kind == "parquet":
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(self.path).metadata
            return [
                Piece(self.path, g, g + 1, meta.row_group(g).total_byte_size)
                for g in range(meta.num_row_groups)
            ] or [Piece(self.path, 0, 0)]
        size = self.total_bytes() or 0
        if self.kind == "enwik" or self.kind == "jsonl" and self.path.suffix != ".gz":
            return [
                Piece(self.path, a, min(a + PIECE_BYTES, size), min(PIECE_BYTES, size - a))
                for a in range(0, max(size, 1), PIECE_BYTES)
            ]
        return [Piece(self.path, size=size)]

    def read(self, piece: Piece) -> Iterator[tuple[PieceDocument, int]]:
        """Yield ((label, text), bytes of the piece read so far) of one piece's documents, a
        label being a line number for a JSON line without a label field (see PieceDocument);
        returns the number of lines of a JSON lines piece (else 0)."""
        path = piece.path
        if self.kind == "enwik":
            return (yield from self._enwik_pages(piece.start, piece.stop))
        if self.kind == "parquet":
            return (yield from self._parquet(piece.start, piece.stop))
        if self.kind in ("hf", "hf_disk"):
            return (yield from (self._hf_dataset() if self.kind == "hf" else self._hf_saved()))
        if path.name.endswith((".jsonl", ".jsonl.gz")) or self.kind == "jsonl":
            return (yield from self._jsonl_records(path, piece.start, piece.stop))
        label = str(path.relative_to(self.path)) if self.kind == "folder" else path.name
        return (yield from _text_documents(path, label))

    def _files(self) -> list[Path]:
        """Files of a folder source in a fixed order (text files only, for a plain folder)."""
        if self.kind == "folder":
            suffixes = {".py"} if self.name == "stdlib" else TEXT_SUFFIXES
        else:
            suffixes = None
        skip = {"site-packages", "__pycache__"}
        found = []
        for root, dirs, files in os.walk(self.path):
            dirs[:] = sorted(d for d in dirs if d not in skip and not d.startswith("."))
            found += [
                Path(root) / f
                for f in sorted(files)
                if suffixes is None
                or Path(f).suffix in suffixes
                and (not f.endswith(".gz") or f.endswith(".jsonl.gz"))
            ]
        return found

    def _enwik_pages(self, start: int, stop: int):
        """The pages of the Wikipedia XML dump that start in ``[start, stop)`` (the header before
        the first page is one document)."""
        for at, page, end in _split_pages(self.path, ENWIK_CHUNK_BYTES, start, stop):
            title = re.search(rb"<title>(.*?)</title>", page[:4096])
            label = title.group(1).decode("utf-8", "replace") if title else f"{self.name}@{at}"
            yield (label, page), end - start
        return 0

    def _jsonl_records(self, path: Path, start: int = 0, stop: int = -1):
        """Records of the lines of a JSON-lines file (gzip when it ends in .gz) that start in
        ``[start, stop)`` (the whole of a gzip file); returns how many lines start there."""
        lines = 0
        try:
            with open(path, "rb") as raw:
                f = gzip.GzipFile(fileobj=raw) if path.suffix == ".gz" else raw
                if start:
                    raw.seek(start - 1)
                    if raw.read(1) != b"\n":
                        raw.readline()  # the line that started before the piece is not ours
                first = at = raw.tell()
                for line in f:
                    if 0 <= stop <= at:
                        break
                    lines += 1
                    at += len(line)
                    if not line.strip():
                        continue
                    yield self._json_record(path, first, lines - 1, line), at - start
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise SourceError(f"{path}: damaged or truncated gzip file ({e})") from None
        except OSError as e:
            raise SourceError(f"cannot read {path}: {e.strerror or e}") from None
        return lines

    def _json_record(self, path: Path, first: int, line: int, data: bytes) -> PieceDocument:
        """The document of the ``line``-th line (from 0) after the line of ``path`` that starts
        at byte ``first``."""

        def where() -> str:
            return f"{path}:{_line_number(path, first) + line}"

        try:
            record = json.loads(data)
        except json.JSONDecodeError as e:
            raise SourceError(f"{where()}: invalid JSON ({e.msg})") from None
        except UnicodeDecodeError as e:
            raise SourceError(
                f"{where()}: not UTF-8 (byte {e.start} of the line); JSON lines must be UTF-8 text"
            ) from None
        label, text = self._record(record, where)
        return (line if label is None else label), text

    def _record(self, record, where: Callable[[], str]) -> tuple[str | None, str]:
        """(the value of its first label field, or None; its text) of one record, ``where()``
        naming it in an error."""
        if not isinstance(record, dict) or self.text_field not in record:
            raise SourceError(
                f"{where()}: no '{self.text_field}' field; choose the field with --text-field"
            )
        text = record[self.text_field]
        if not isinstance(text, str):
            raise SourceError(f"{where()}: field '{self.text_field}' is not a string")
        _check_no_surrogates(text, where, self.text_field)
        return next((str(record[k]) for k in LABEL_FIELDS if k in record), None), text

    def _labelled(self, records, name: str, first_row: int = 1):
        """Documents of ``records`` (dicts), labelled ``name:row`` where they have no label."""
        for row, record in enumerate(records, first_row):
            where = f"{name}:{row}"
            label, text = self._record(record, where.__str__)
            yield (where if label is None else label, text), 0
        return 0

    def _parquet(self, first: int, stop: int):
        """The rows of row groups ``[first, stop)``."""
        import pyarrow.parquet as pq

        table = pq.ParquetFile(self.path)
        names = table.schema_arrow.names
        if self.text_field not in names:
            raise SourceError(
                f"{self.path}: no column '{self.text_field}'; choose one with --text-field "
                f"(columns: {', '.join(names)})"
            )
        columns = [c for c in dict.fromkeys((self.text_field, *LABEL_FIELDS)) if c in names]
        groups = range(first, min(stop, table.num_row_groups))
        rows = (
            record
            for batch in table.iter_batches(1024, row_groups=groups, columns=columns)
            for record in batch.to_pylist()
        )
        before = sum(table.metadata.row_group(g).num_rows for g in range(first))
        return (yield from self._labelled(rows, self.path.name, before + 1))

    def _hf_dataset(self):
        import datasets

        name, _, split = self.name.partition(":")
        offline = _hub_offline()
        if offline:
            raise SourceError(
                f"'{self.name}' is not a file or folder, and the Hugging Face Hub cannot be "
                f"reached ({offline}); {LOCAL_FORMATS}"
            )
        try:
            dataset = datasets.load_dataset(name, split=split or "train", streaming=True)
        except Exception as e:  # datasets raises many types for "not found / offline"
            raise SourceError(
                f"'{self.name}' is not a file or folder, and loading it as a Hugging Face "
                f"dataset failed: {_first_line(e)}; {LOCAL_FORMATS}"
            ) from None
        return (yield from _guarded(self.name, self._labelled(dataset, name)))

    def _hf_saved(self):
        """A dataset written by ``datasets``' ``save_to_disk`` (its train split, if several)."""
        import datasets

        dataset = datasets.load_from_disk(str(self.path))
        if isinstance(dataset, datasets.DatasetDict):
            if not dataset:
                raise SourceError(f"{self.path}: the saved dataset has no splits")
            if self.split is not None and self.split not in dataset:
                raise SourceError(
                    f"{self.path} has no split '{self.split}' (it has: {', '.join(dataset)})"
                )
            split = self.split or ("train" if "train" in dataset else next(iter(dataset)))
            dataset = dataset[split]
        elif self.split is not None:
            raise SourceError(f"{self.path} is a saved dataset of one split; drop ':{self.split}'")
        return (yield from self._labelled(dataset, self.path.name))


def _check_no_surrogates(text: str, where: Callable[[], str], field: str) -> None:
    """JSON can spell a lone surrogate (``"\\ud800"``), which is not Unicode text: refuse it."""
    if text.isascii():  # constant time for a str
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise SourceError(
            f"{where()}: field '{field}' holds a lone surrogate {text[e.start]!r} at character "
            f"{e.start}, which is not valid Unicode; fix or remove that record"
        ) from None


def _guarded(name: str, records):
    """Re-raise a dataset library's errors while streaming as a SourceError."""
    try:
        return (yield from records)
    except SourceError:
        raise
    except Exception as e:
        raise SourceError(f"reading dataset '{name}' failed: {_first_line(e)}") from None


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _split_pages(
    path: Path, chunk_bytes: int, start: int = 0, stop: int = -1
) -> Iterator[tuple[int, bytes, int]]:
    """(start, bytes, end) of each document of an enwik file that starts in ``[start, stop)``
    (``stop`` -1: to the end): the header before the first PAGE_MARKER (when not empty), then
    each page up to the next marker or the end of the file. Read ``chunk_bytes`` at a time; only
    the unfinished document is carried over, so memory is a chunk plus the longest page."""
    buf = bytearray()
    base = start  # file offset of buf[0]
    doc = 0 if start == 0 else -1  # where in buf the unfinished document starts (-1: none yet)
    scan = 0  # where in buf the next marker may start
    pages = False
    try:
        with open(path, "rb") as f:
            f.seek(start)
            while chunk := f.read(chunk_bytes):
                buf += chunk
                while (cut := buf.find(PAGE_MARKER, scan)) >= 0:
                    if doc >= 0 and cut > doc:
                        yield base + doc, bytes(buf[doc:cut]), base + cut
                    if 0 <= stop <= base + cut:
                        return
                    del buf[:cut]
                    base, doc, scan, pages = base + cut, 0, len(PAGE_MARKER), True
                if doc < 0:  # nothing of ours yet: keep what may begin a marker
                    keep = len(PAGE_MARKER) - 1
                    base += max(0, len(buf) - keep)
                    del buf[:-keep]
                    scan = 0
                else:
                    scan = max(scan, len(buf) - len(PAGE_MARKER) + 1)
                if start == 0 and not pages and len(buf) > ENWIK_HEADER_BYTES:
                    break
    except OSError as e:
        raise SourceError(f"cannot read {path}: {e.strerror or e}") from None
    if start == 0 and not pages:
        raise SourceError(
            f"{path} is not a Wikipedia XML dump: no {PAGE_MARKER.decode()!r} in its first "
            f"{len(buf):,} bytes"
        )
    if doc >= 0:
        yield base + doc, bytes(buf[doc:]), base + len(buf)


def _line_number(path: Path, offset: int) -> int:
    """The number (from 1) of the line of ``path`` that starts at byte ``offset``."""
    lines = 1
    with open(path, "rb") as f:
        while offset > 0 and (data := f.read(min(offset, 1 << 24))):
            lines += data.count(b"\n")
            offset -= len(data)
    return lines


class LineNumbers:
    """Turns the line numbers of a source's pieces' documents (see PieceDocument) into labels
    ``file:line``: fed each piece's line count in order (``passed``), it knows where each piece
    of a file starts."""

    def __init__(self, path: Path | None = None, first: int = 1):
        self.path, self.first = path, first  # the first line of the next piece of ``path``

    def label(self, piece: Piece, label: str | int) -> str:
        """The label of a document of ``piece``, the piece after the last one ``passed``."""
        if isinstance(label, str):
            return label
        first = self.first if piece.path == self.path else 1
        return f"{piece.path.name}:{first + label}"

    def passed(self, piece: Piece, lines: int | None) -> None:
        """Count the lines of a piece read whole."""
        self.first = (self.first if piece.path == self.path else 1) + (lines or 0)
        self.path = piece.path


def _text_documents(path: Path, label: str) -> Iterator[tuple[Document, int]]:
    """A text file as one document, or in pieces labelled ``label@offset`` when it is larger
    than TEXT_PIECE_BYTES; each with the file offset it ends at."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size <= TEXT_PIECE_BYTES:
                data = f.read()
                yield (label, data), len(data)
                return
            for offset, piece in _pieces(f, size, TEXT_PIECE_BYTES):
                yield (f"{label}@{offset}", piece), offset + len(piece)
    except OSError as e:
        raise SourceError(f"cannot read {path}: {e.strerror or e}") from None


def _pieces(f, size: int, piece_bytes: int) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) pieces of at most ``piece_bytes`` of a file of ``size`` bytes, each but the
    last cut after its last newline, or at the end if it has none (not inside a UTF-8 character);
    the next piece is read from the cut."""
    offset = 0
    while data := f.read(piece_bytes):
        if offset + len(data) < size:
            data = data[: data.rfind(b"\n") + 1 or _utf8_cut(data)]
            f.seek(offset + len(data))
        yield offset, data
        offset += len(data)


def _utf8_cut(data: bytes) -> int:
    """``len(data)``, or the start of the UTF-8 character that the end of ``data`` splits."""
    end = len(data)
    for i in range(end - 1, max(end - 4, 0), -1):
        lead = data[i]
        if lead & 0xC0 != 0x80:  # not a continuation byte
            length = 1 if lead < 0xC0 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
            return i if i + length > end else end
    return end


def resolve_source(spec: str, text_field: str = "text", download: bool = True) -> Source:
    """Turn the SOURCE argument into a Source, downloading enwik8/9 when needed."""
    if spec in ENWIK_SIZES:
        return Source(spec, "enwik", fetch_enwik(spec, download))
    if spec == "stdlib":
        return Source(spec, "folder", Path(sysconfig.get_paths()["stdlib"]))
    path = Path(spec).expanduser()
    if path.is_dir():
        kind = "hf_disk" if _saved_dataset(path) else "folder"
        return Source(spec, kind, path.resolve(), text_field)
    folder, colon, split = spec.rpartition(":")
    if colon and split and _saved_dataset(Path(folder).expanduser()):
        return Source(spec, "hf_disk", Path(folder).expanduser().resolve(), text_field, split)
    if path.is_file():
        if not os.access(path, os.R_OK):
            raise SourceError(f"cannot read {path}: permission denied")
        name = path.name.lower()
        if name.endswith((".jsonl", ".jsonl.gz", ".json", ".json.gz", ".ndjson")):
            kind = "jsonl"
        elif name.endswith(".parquet"):
            kind = "parquet"
        elif name.endswith(COMPRESSED):
            raise SourceError(
                f"{spec}: compressed files other than .jsonl.gz are not read; decompress it first"
            )
        else:
            kind = "text"
        return Source(spec, kind, path.resolve(), text_field)
    if path.exists():
        raise SourceError(f"{spec} is not a regular file or folder")
    if spec.startswith((".", "/", "~")) or path.suffix:
        raise SourceError(f"{spec}: no such file or folder")
    return Source(spec, "hf", None, text_field)


def _saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a folder written by datasets' ``save_to_disk``."""
    return path.is_dir() and any((path / f).exists() for f in ("state.json", "dataset_dict.json"))


def fetch_enwik(name: str, download: bool = True) -> Path:
    """Path of enwik8/enwik9: a local file of that name, the cache, or a fresh download; a file
    found is checked against the published size and md5."""
    expected = ENWIK_SIZES[name]
    for candidate in (Path(name), cache_dir() / name):
        if candidate.is_file():
            if candidate.stat().st_size != expected:
                raise SourceError(
                    f"{candidate} has {candidate.stat().st_size:,} bytes, {name} has "
                    f"{expected:,}; delete it and run again to download it"
                )
            digest = _file_md5(candidate, f"check {name}")
            if digest != ENWIK_MD5[name]:
                raise SourceError(
                    f"{candidate} is not the published {name} (md5 {digest}, expected "
                    f"{ENWIK_MD5[name]}); delete it and run again to download it, or index it "
                    f"as plain text by its path ({candidate.resolve()})"
                )
            return candidate.resolve()
    target = cache_dir() / name
    url = ENWIK_URL.format(name=name)
    if not download:
        raise SourceError(f"{name} not found; download {url}, unzip it and put {name} at {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    archive = target.with_suffix(".zip.part")  # kept when a download stops: the next resumes it
    try:
        _download(url, archive)
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        reason = getattr(e, "reason", None) or e
        raise SourceError(
            f"cannot download {url} ({reason}); run again to resume, or download it by hand, "
            f"unzip it and put {name} at {target} (or in the current folder)"
        ) from None
    tmp = target.with_suffix(".part")
    try:
        digest = _unzip(archive, name, tmp)
    except (zipfile.BadZipFile, KeyError) as e:
        problem = f"{url} did not give the expected zip archive ({e})"
    else:
        size, problem = tmp.stat().st_size, None
        if size != expected:
            problem = f"{url} unpacked to {size:,} bytes, expected {expected:,}"
        elif digest != ENWIK_MD5[name]:
            problem = f"{url} unpacked to a file of md5 {digest}, expected {ENWIK_MD5[name]}"
    if problem:
        tmp.unlink(missing_ok=True)
        archive.unlink(missing_ok=True)
        raise SourceError(
            f"{problem}; try again, or download it by hand and put the unzipped {name} at {target}"
        )
    os.replace(tmp, target)
    archive.unlink()
    return target


def _file_md5(path: Path, desc: str) -> str:
    """The md5 of a file, read in chunks behind a progress bar."""
    digest = hashlib.md5(usedforsecurity=False)
    with (
        open(path, "rb") as f,
        tqdm(total=path.stat().st_size, unit="B", unit_scale=True, desc=desc, leave=False) as bar,
    ):
        while chunk := f.read(ENWIK_CHUNK_BYTES):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _unzip(archive: Path, name: str, out_path: Path) -> str:
    """Unpack member ``name`` of ``archive`` to ``out_path`` in chunks; its md5."""
    digest = hashlib.md5(usedforsecurity=False)
    with zipfile.ZipFile(archive) as z, z.open(name) as member, open(out_path, "wb") as out:
        while chunk := member.read(ENWIK_CHUNK_BYTES):
            out.write(chunk)
            digest.update(chunk)
    return digest.hexdigest()


def _download(url: str, dest: Path) -> None:
    """``url`` to ``dest`` with a progress bar, resuming after the bytes ``dest`` already has
    where the server takes a range request (else from the start)."""
    have = dest.stat().st_size if dest.exists() else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        response = urllib.request.urlopen(request, timeout=30)
    except urllib.error.HTTPError as e:
        if e.code != 416 or not have:  # 416: nothing past what we have (a stale part file)
            raise
        dest.unlink()
        return _download(url, dest)
    with response:
        if response.status != 206:  # the whole file
            have = 0
        left = int(response.headers.get("Content-Length") or 0) or None
        total = None if left is None else have + left
        name = url.rsplit("/", 1)[-1]
        with (
            open(dest, "ab" if have else "wb") as out,
            tqdm(
                total=total, initial=have, unit="B", unit_scale=True, desc=f"download {name}"
            ) as bar,
        ):
            while chunk := response.read(1 << 20):
                out.write(chunk)
                bar.update(len(chunk))
    if total is not None and dest.stat().st_size != total:
        raise OSError(f"download ended early ({dest.stat().st_size:,} of {total:,} bytes)")
