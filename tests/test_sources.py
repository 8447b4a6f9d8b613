"""Corpus sources read in bounded memory: enwik split in chunks, enwik zips extracted in chunks,
and a child process's peak memory on a 185 MB file."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from teralm.build_index import sources
from teralm.build_index.sources import Source, SourceError, resolve_source

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


def test_enwik_zip_is_downloaded_and_extracted_in_chunks(tmp_path, monkeypatch):
    data = enwik_like(30)
    served = tmp_path / "served"
    served.mkdir()
    with zipfile.ZipFile(served / "enwik8.zip", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("enwik8", data)
    monkeypatch.setattr(sources, "ENWIK_URL", served.as_uri() + "/{name}.zip")
    monkeypatch.setitem(sources.ENWIK_SIZES, "enwik8", len(data))
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


CHILD = """
import json, sys
from pathlib import Path
from teralm.build_index import sources

def status(field):  # VmHWM, unlike ru_maxrss, is not inherited from the parent through exec
    line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
    return int(line.split()[1]) * 1024

kind, path = sys.argv[1], Path(sys.argv[2])
before = status("VmRSS")
documents = size = end = 0
for (label, text), end in sources.Source("enwik8", kind, path).documents():
    documents += 1
    size += len(text)
report = {"documents": documents, "size": size, "end": end, "before": before}
print(json.dumps({**report, "peak": status("VmHWM")}))
"""


@pytest.fixture(scope="module")
def large_enwik(tmp_path_factory) -> Path:
    """About 185 MB of enwik-like XML, written page by page."""
    path = tmp_path_factory.mktemp("large") / "enwik8"
    with open(path, "wb") as f:
        f.write(HEADER)
        for i in range(40_000):
            words = b" ".join(b"w%d" % (i * 7 + j) for j in range(600))
            f.write(
                b"  <page>\n    <title>P%d</title>\n    <text>%s</text>\n  </page>\n" % (i, words)
            )
        f.write(b"</mediawiki>\n")
    return path


def test_peak_memory_stays_well_under_the_file_size(large_enwik):
    if not Path("/proc/self/status").exists():
        pytest.skip("reads peak memory from /proc/self/status (Linux)")
    size = large_enwik.stat().st_size
    child = subprocess.run(
        [sys.executable, "-c", CHILD, "enwik", str(large_enwik)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    report = json.loads(child.stdout)
    growth = report["peak"] - report["before"]
    print(f"enwik: {size:,} bytes, peak RSS {report['peak']:,}, growth {growth:,} bytes")
    assert report["size"] == report["end"] == size
    assert report["documents"] == 40_001
    assert growth < 0.4 * size
