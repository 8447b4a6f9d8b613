"""Corpus sources for build-index: enwik8/9, the Python stdlib, text files, folders, JSONL, Parquet
and Hugging Face datasets. Each yields documents in a fixed order, as (label, text) pairs.

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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm


class SourceError(Exception):
    """A problem with the corpus source that the user can fix; the message says how."""


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
PAGE_MARKER = b"  <page>"
LABEL_FIELDS = ("title", "path", "url", "id")

Document = tuple[str, "str | bytes"]


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
        """Yield ((label, text), bytes_read_so_far) in a fixed order."""
        reader = {
            "enwik": self._enwik_pages,
            "folder": self._folder,
            "text": self._text_file,
            "jsonl": self._jsonl,
            "parquet": self._parquet,
            "hf": self._hf_dataset,
            "hf_disk": self._hf_saved,
        }[self.kind]
        return reader()

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

    def _folder(self):
        done = 0
        for f in self._files():
            if f.name.endswith((".jsonl", ".jsonl.gz")):
                for document, _ in self._jsonl_records(f):
                    yield document, done
                done += f.stat().st_size
                continue
            for document, end in _text_documents(f, str(f.relative_to(self.path))):
                yield document, done + end
            done += f.stat().st_size

    def _text_file(self):
        yield from _text_documents(self.path, self.path.name)

    def _enwik_pages(self):
        """Split the Wikipedia XML dump into its <page> elements (the header is one document)."""
        for start, page, end in _split_pages(self.path, ENWIK_CHUNK_BYTES):
            title = re.search(rb"<title>(.*?)</title>", page[:4096])
            label = title.group(1).decode("utf-8", "replace") if title else f"{self.name}@{start}"
            yield (label, page), end

    def _jsonl(self):
        yield from self._jsonl_records(self.path)

    def _jsonl_records(self, path: Path):
        """Records of a JSON-lines file (gzip when it ends in .gz); a label per line."""
        try:
            with open(path, "rb") as raw:
                f = gzip.GzipFile(fileobj=raw) if path.suffix == ".gz" else raw
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise SourceError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
                    except UnicodeDecodeError as e:
                        raise SourceError(
                            f"{path}:{lineno}: not UTF-8 (byte {e.start} of the line); "
                            "JSON lines must be UTF-8 text"
                        ) from None
                    label, text = self._record(record, f"{path.name}:{lineno}")
                    _check_no_surrogates(text, f"{path}:{lineno}", self.text_field)
                    yield (label, text), raw.tell()
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise SourceError(f"{path}: damaged or truncated gzip file ({e})") from None
        except OSError as e:
            raise SourceError(f"cannot read {path}: {e.strerror or e}") from None

    def _record(self, record, fallback: str) -> Document:
        if not isinstance(record, dict) or self.text_field not in record:
            raise SourceError(
                f"{fallback}: no '{self.text_field}' field; choose the field with --text-field"
            )
        text = record[self.text_field]
        if not isinstance(text, str):
            raise SourceError(f"{fallback}: field '{self.text_field}' is not a string")
        label = next((str(record[k]) for k in LABEL_FIELDS if k in record), fallback)
        return label, text

    def _parquet(self):
        import pyarrow.parquet as pq

        table = pq.ParquetFile(self.path)
        names = table.schema_arrow.names
        if self.text_field not in names:
            raise SourceError(
                f"{self.path}: no column '{self.text_field}'; choose one with --text-field "
                f"(columns: {', '.join(names)})"
            )
        columns = [c for c in dict.fromkeys((self.text_field, *LABEL_FIELDS)) if c in names]
        row = 0
        for batch in table.iter_batches(batch_size=1024, columns=columns):
            for record in batch.to_pylist():
                row += 1
                yield self._record(record, f"{self.path.name}:{row}"), 0

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
        yield from _guarded(
            self.name, ((self._record(r, f"{name}:{row}"), 0) for row, r in enumerate(dataset, 1))
        )

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
        for row, record in enumerate(dataset, 1):
            yield self._record(record, f"{self.path.name}:{row}"), 0


def _check_no_surrogates(text: str, where: str, field: str) -> None:
    """JSON can spell a lone surrogate (``"\\ud800"``), which is not Unicode text: refuse it."""
    if text.isascii():  # constant time for a str
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise SourceError(
            f"{where}: field '{field}' holds a lone surrogate {text[e.start]!r} at character "
            f"{e.start}, which is not valid Unicode; fix or remove that record"
        ) from None


def _guarded(name: str, records):
    """Re-raise a dataset library's errors while streaming as a SourceError."""
    try:
        yield from records
    except SourceError:
        raise
    except Exception as e:
        raise SourceError(f"reading dataset '{name}' failed: {_first_line(e)}") from None


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _split_pages(path: Path, chunk_bytes: int) -> Iterator[tuple[int, bytes, int]]:
    """(start, bytes, end) of each document of an enwik file: the header before the first
    PAGE_MARKER (when not empty), then each page up to the next marker or the end of the file.
    Read ``chunk_bytes`` at a time; only the unfinished document is carried over, so memory is
    a chunk plus the longest page."""
    buf = bytearray()
    start = 0  # file offset of buf[0], the start of the unfinished document
    scan = 0  # where in buf the next marker may start
    pages = False
    try:
        with open(path, "rb") as f:
            while chunk := f.read(chunk_bytes):
                buf += chunk
                while (cut := buf.find(PAGE_MARKER, scan)) >= 0:
                    if cut:
                        yield start, bytes(buf[:cut]), start + cut
                    del buf[:cut]
                    start, scan, pages = start + cut, len(PAGE_MARKER), True
                scan = max(scan, len(buf) - len(PAGE_MARKER) + 1)
                if not pages and len(buf) > ENWIK_HEADER_BYTES:
                    break
    except OSError as e:
        raise SourceError(f"cannot read {path}: {e.strerror or e}") from None
    if not pages:
        raise SourceError(
            f"{path} is not a Wikipedia XML dump: no {PAGE_MARKER.decode()!r} in its first "
            f"{len(buf):,} bytes"
        )
    yield start, bytes(buf), start + len(buf)


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
