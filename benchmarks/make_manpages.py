"""Build the second evaluation corpus: the English manual pages installed on this machine, as text.

    python benchmarks/make_manpages.py [--out benchmarks/cache/manpages.jsonl.gz] [--workers N]

Renders every page under /usr/share/man/man1 ... man8 (the English ones: localised pages live in
other folders) with groff to plain UTF-8 text, one document per page, and writes them sorted by
path as gzipped JSON lines ``{"id", "path", "text"}``, the layout of pydocs.jsonl.gz. Skipped:
pages that only include another (``.so``), links to a page already taken, and the Google Cloud
SDK's generated reference (``gcloud*``: thousands of pages from one template, which would make
this corpus as repetitive as the one it is meant to contrast with). What it holds depends on the
Debian packages installed (``apt-get install`` more for a bigger corpus); the summary gives its
size and checksum, so runs on two machines can tell whether they scored the same text.
"""

from __future__ import annotations

import argparse
import gzip
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import CACHE, write_documents
from tqdm import tqdm

MAN = Path("/usr/share/man")
SECTIONS = [f"man{n}" for n in range(1, 9)]
SKIPPED_PREFIXES = ("gcloud",)
DEFAULT_OUT = CACHE / "manpages.jsonl.gz"
# no hyphenation: words stay whole, as in prose
RENDER = ["groff", "-t", "-e", "-man", "-Tutf8", "-P-cbou", "-rLL=80n", "-rHY=0"]


def page_paths(root: Path) -> list[Path]:
    """The pages to render: one path per real file, sorted, without includes or generated
    gcloud pages."""
    seen, pages = set(), []
    for section in SECTIONS:
        folder = root / section
        if not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            real = path.resolve()
            if path.name.startswith(SKIPPED_PREFIXES) or real in seen or not real.is_file():
                continue
            seen.add(real)
            pages.append(path)
    return pages


def source(path: Path) -> bytes:
    data = path.read_bytes()
    return gzip.decompress(data) if path.suffix == ".gz" else data


def render(path: Path) -> str | None:
    """The page as plain text (runs of blank lines made one, trailing spaces dropped), or None
    for an include, a page groff cannot read, or one that renders to nothing."""
    try:
        roff = source(path)
    except (OSError, EOFError, gzip.BadGzipFile):
        return None
    if roff.lstrip().startswith(b".so "):
        return None
    env = {**os.environ, "LC_ALL": "C.UTF-8"}
    try:
        out = subprocess.run(RENDER, input=roff, capture_output=True, timeout=60, env=env)
    except subprocess.TimeoutExpired:
        return None
    text = out.stdout.decode("utf-8", errors="replace")
    text = "\n".join(line.rstrip() for line in text.splitlines())
    text = re.sub(r"\n{3,}", "\n\n", text).strip("\n")
    return text + "\n" if out.returncode == 0 and text.strip() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--man", type=Path, default=MAN, help="the manual pages' root folder")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    pages = page_paths(args.man)
    if not pages:
        sys.exit(
            f"no manual pages under {args.man}/man1..man8: install some (apt-get install man-db)"
        )
    with ThreadPoolExecutor(args.workers) as pool:
        texts = list(tqdm(pool.map(render, pages), total=len(pages), desc="render", unit="page"))
    kept = [(str(p.relative_to(args.man)), t) for p, t in zip(pages, texts) if t is not None]
    print(write_documents(args.out, kept) + f" (of {len(pages):,} pages)")


if __name__ == "__main__":
    main()
