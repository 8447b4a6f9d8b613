"""Corpus sources read in bounded memory: enwik split in chunks, large text files in pieces,
enwik zips extracted in chunks, and a child process's peak memory on a 185 MB file."""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from teralm.build_index import sources
from teralm.build_index.sources import Source, resolve_source
from teralm.errors import SourceError

EXAMPLES = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
HEADER = b'<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.3/">\n  <siteinfo>x</siteinfo>\n'


def reference_split(data: bytes, name: str) -> list:
    """The enwik documents from the whole file at once: split before every ``  <page>``."""
    starts = [m.start() for m in re.finditer(rb"  <page>", data)]
    bounds = [0, *starts, len(data)] if starts and starts[0] > 0 else [*starts, len(data)]
    documents = []
    for a, b in zip(bounds, bounds[1:]):
        page = data[a:b]
        title = re.search(rb"<title>(.*?)</title>", page[:4096])
        label = title.group(1).decode("utf-8", "replace") if title else f"{name}@{a}"
        documents.append(((label, page), b))
    return documents


def enwik_like(pages: int) -> bytes:
    """A header, then pages with titles (one without, one non-ASCII), ending like enwik."""
    body = []
    for i in range(pages):
        title = b"" if i == 3 else f"<title>Page {i} \u00e9t\u00e9</title>".encode()
        text = b"<text>" + b"word <page> and  <pag " * (i % 5) + b"</text>"
        body.append(b"  <page>\n    " + title + b"\n    " + text + b"\n  </page>\n")
    return HEADER + b"".join(body) + b"</mediawiki>\n"


def streamed(path: Path, chunk: int) -> list:
    with mock.patch.object(sources, "ENWIK_CHUNK_BYTES", chunk):
        return list(Source("enwik8", "enwik", path).documents())


def test_enwik_split_matches_whole_file_split(tmp_path):
    data = enwik_like(40)
    path = tmp_path / "enwik8"
    path.write_bytes(data)
    starts = [m.start() for m in re.finditer(rb"  <page>", data)]
    straddle = starts[5] + 3  # the first chunk ends inside the sixth marker
    assert starts[5] < straddle < starts[5] + len(sources.PAGE_MARKER)
    expected = reference_split(data, "enwik8")
    assert len(expected) == 41 and expected[0][0][1] == HEADER
    assert expected[4][0][0] == f"enwik8@{starts[3]}"
    for chunk in (1, 7, 8, 9, 100, straddle, len(data) - 1, len(data), 1 << 24):
        assert streamed(path, chunk) == expected, chunk


@EXAMPLES
@given(
    parts=st.lists(
        st.sampled_from(
            [b"  <page>", b" ", b"  ", b"<", b"<page>", b"  <pag", b"e>", b"<title>", b"</title>"]
            + [b"T\xc3\xa9", b"\n", b"xyz"]
        ),
        max_size=40,
    ),
    marker_at=st.integers(0, 40),
    chunk=st.integers(1, 30),
)
def test_enwik_split_matches_on_random_markup(tmp_path, parts, marker_at, chunk):
    parts.insert(min(marker_at, len(parts)), b"  <page>")
    data = b"".join(parts)
    path = tmp_path / "enwik8"
    path.write_bytes(data)
    assert streamed(path, chunk) == reference_split(data, "enwik8")


def test_enwik_without_pages_is_refused(tmp_path):
    path = tmp_path / "enwik8"
    path.write_bytes(HEADER * 10)
    with pytest.raises(SourceError, match="not a Wikipedia XML dump"):
        streamed(path, 16)
    with (
        mock.patch.object(sources, "ENWIK_HEADER_BYTES", 100),
        pytest.raises(SourceError, match="no '  <page>' in its first"),
    ):
        streamed(path, 16)


def reference_pieces(data: bytes, piece: int) -> list[tuple[int, bytes]]:
    """Pieces of at most ``piece`` bytes, each but the last ending after its last newline, or
    else before the UTF-8 character that straddles its end."""
    out, offset = [], 0
    while offset < len(data):
        end = offset + piece
        if end >= len(data):
            end = len(data)
        elif (newline := data.rfind(b"\n", offset, end)) >= 0:
            end = newline + 1
        else:
            while data[end] & 0xC0 == 0x80:
                end -= 1
        out.append((offset, data[offset:end]))
        offset = end
    return out


def text_documents(path: Path, piece: int) -> list:
    with mock.patch.object(sources, "TEXT_PIECE_BYTES", piece):
        return list(resolve_source(str(path)).documents())


@EXAMPLES
@given(
    text=st.lists(
        st.sampled_from(["a", "bc", "\u00e9", "\u20ac", "\U0001d11e", "\n"]), max_size=80
    ),
    piece=st.integers(4, 24),
)
def test_large_text_file_is_read_in_pieces(tmp_path, text, piece):
    data = "".join(text).encode()
    path = tmp_path / "corpus.txt"
    path.write_bytes(data)
    got = text_documents(path, piece)
    if len(data) <= piece:
        assert got == [(("corpus.txt", data), len(data))]
        return
    expected = reference_pieces(data, piece)
    assert got == [((f"corpus.txt@{a}", p), a + len(p)) for a, p in expected]
    assert b"".join(p for (_, p), _ in got) == data
    for (_, p), _ in got:
        assert len(p) <= piece
        p.decode("utf-8")  # no piece splits a character


def test_folder_pieces_only_its_large_files(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    big = b"".join(b"line %d\n" % i for i in range(30))
    (folder / "a.txt").write_bytes(b"small\n")
    (folder / "sub" / "b.md").write_bytes(big)
    (folder / "sub" / "c.txt").write_bytes(b"x" * 64)
    got = text_documents(folder, 64)
    head = [(("a.txt", b"small\n"), 6)]
    pieces = [((f"sub/b.md@{a}", p), 6 + a + len(p)) for a, p in reference_pieces(big, 64)]
    tail = [(("sub/c.txt", b"x" * 64), 6 + len(big) + 64)]
    assert got == head + pieces + tail


def test_parquet_reads_text_and_label_columns_by_batch(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 3000
    table = pa.table(
        {"body": [f"doc {i}" for i in range(n)], "id": list(range(n)), "blob": [b"\0" * 100] * n}
    )
    pq.write_table(table, tmp_path / "c.parquet", row_group_size=700)
    got = list(resolve_source(str(tmp_path / "c.parquet"), text_field="body").documents())
    assert [document for document, _ in got] == [(str(i), f"doc {i}") for i in range(n)]


def test_enwik_zip_is_downloaded_and_extracted_in_chunks(tmp_path, monkeypatch):
    data = enwik_like(30)
    served = tmp_path / "served"
    served.mkdir()
    with zipfile.ZipFile(served / "enwik8.zip", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("enwik8", data)
    monkeypatch.setattr(sources, "ENWIK_URL", served.as_uri() + "/{name}.zip")
    pretend_enwik8_is(data, monkeypatch)
    monkeypatch.setenv("TERALM_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    reads = []
    read = zipfile.ZipExtFile.read
    monkeypatch.setattr(zipfile.ZipExtFile, "read", lambda f, n=-1: reads.append(n) or read(f, n))
    monkeypatch.setattr(sources, "ENWIK_CHUNK_BYTES", 500)
    source = resolve_source("enwik8")
    assert source.path == tmp_path / "cache" / "enwik8" and source.path.read_bytes() == data
    assert len(reads) > 2 and set(reads) == {500}
    assert list(source.documents()) == reference_split(data, "enwik8")
    assert sorted(p.name for p in source.path.parent.iterdir()) == ["enwik8"]


def test_a_local_enwik_file_is_checked_against_the_published_md5(tmp_path, monkeypatch):
    data = enwik_like(30)
    pretend_enwik8_is(data, monkeypatch)
    monkeypatch.setenv("TERALM_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    local = tmp_path / "enwik8"
    local.write_bytes(data)
    assert resolve_source("enwik8").path == local
    edited = data.replace(b"<title>", b"<TITLE>", 1)
    local.write_bytes(edited)  # the same size, other bytes
    with pytest.raises(SourceError, match="not the published enwik8 .md5 .*plain text"):
        resolve_source("enwik8")
    assert local.read_bytes() == edited  # refused, not touched


def pretend_enwik8_is(data: bytes, monkeypatch) -> None:
    monkeypatch.setitem(sources.ENWIK_SIZES, "enwik8", len(data))
    monkeypatch.setitem(sources.ENWIK_MD5, "enwik8", hashlib.md5(data).hexdigest())


class RangeServer(http.server.BaseHTTPRequestHandler):
    """Serves ``body`` at any path, taking ``Range: bytes=N-``; the first response stops after
    ``cut`` bytes (a dropped connection)."""

    body, cut, ranges = b"", None, []

    def do_GET(self):
        start = int(self.headers.get("Range", "bytes=0-")[6:-1])
        type(self).ranges.append(start)
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(self.body) - start))
        self.end_headers()
        stop = len(self.body) if self.cut is None else self.cut
        type(self).cut = None
        self.wfile.write(self.body[start:stop])

    def log_message(self, *args):
        pass


@pytest.fixture
def zip_server(tmp_path, monkeypatch):
    """A real HTTP server on 127.0.0.1 for enwik8.zip."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), RangeServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(sources, "ENWIK_URL", f"http://127.0.0.1:{server.server_port}/{{name}}.zip")
    monkeypatch.setenv("TERALM_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    RangeServer.ranges = []
    yield RangeServer
    server.shutdown()


def zipped(data: bytes) -> bytes:
    out = Path("served.zip")
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:  # stored: its bytes stay big
        z.writestr("enwik8", data)
    body = out.read_bytes()
    out.unlink()
    return body


def test_a_dropped_enwik_download_resumes_where_it_stopped(tmp_path, zip_server, monkeypatch):
    data = enwik_like(400)
    pretend_enwik8_is(data, monkeypatch)
    zip_server.body, zip_server.cut = zipped(data), 5000
    with pytest.raises(SourceError, match="ended early.*run again to resume"):
        resolve_source("enwik8")
    part = tmp_path / "cache" / "enwik8.zip.part"
    assert part.stat().st_size == 5000
    source = resolve_source("enwik8")
    assert zip_server.ranges == [0, 5000]  # the second request asked only for the rest
    assert source.path.read_bytes() == data
    assert sorted(p.name for p in source.path.parent.iterdir()) == ["enwik8"]


def test_an_enwik_download_of_other_content_is_refused_and_removed(
    tmp_path, zip_server, monkeypatch
):
    data = enwik_like(40)
    pretend_enwik8_is(data, monkeypatch)
    monkeypatch.setitem(sources.ENWIK_MD5, "enwik8", hashlib.md5(b"other").hexdigest())
    zip_server.body = zipped(data)
    with pytest.raises(SourceError, match="md5 .* expected"):
        resolve_source("enwik8")
    assert list((tmp_path / "cache").iterdir()) == []  # nothing half-made is left
    zip_server.body = b"not a zip"
    with pytest.raises(SourceError, match="expected zip archive"):
        resolve_source("enwik8")
    assert list((tmp_path / "cache").iterdir()) == []


CHILD = """
import json, sys
from pathlib import Path
from teralm.build_index import sources

def status(field):  # VmHWM, unlike ru_maxrss, is not inherited from the parent through exec
    line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
    return int(line.split()[1]) * 1024

kind, path, piece = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
sources.TEXT_PIECE_BYTES = piece
before = status("VmRSS")
documents = size = end = 0
for (label, text), end in sources.Source("enwik8", kind, path).documents():
    documents += 1
    size += len(text)
report = {"documents": documents, "size": size, "end": end, "before": before}
print(json.dumps({**report, "peak": status("VmHWM")}))
"""


@pytest.fixture(scope="module")
def large_enwik(tmp_path_factory) -> Iterator[Path]:
    """About 185 MB of enwik-like XML, written page by page (and removed after the tests)."""
    path = tmp_path_factory.mktemp("large") / "enwik8"
    with open(path, "wb") as f:
        f.write(HEADER)
        for i in range(40_000):
            words = b" ".join(b"w%d" % (i * 7 + j) for j in range(600))
            f.write(
                b"  <page>\n    <title>P%d</title>\n    <text>%s</text>\n  </page>\n" % (i, words)
            )
        f.write(b"</mediawiki>\n")
    yield path
    path.unlink()


@pytest.mark.parametrize("kind, piece", [("enwik", sources.TEXT_PIECE_BYTES), ("text", 8 << 20)])
def test_peak_memory_stays_well_under_the_file_size(large_enwik, kind, piece):
    if not Path("/proc/self/status").exists():
        pytest.skip("reads peak memory from /proc/self/status (Linux)")
    size = large_enwik.stat().st_size
    child = subprocess.run(
        [sys.executable, "-c", CHILD, kind, str(large_enwik), str(piece)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    report = json.loads(child.stdout)
    growth = report["peak"] - report["before"]
    print(f"{kind}: {size:,} bytes, peak RSS {report['peak']:,}, growth {growth:,} bytes")
    assert report["size"] == report["end"] == size
    if kind == "enwik":
        assert report["documents"] == 40_001
    else:
        assert report["documents"] >= size / piece
    assert growth < 0.4 * size
