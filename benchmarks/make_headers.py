"""Build the third evaluation corpus: this machine's C and C++ headers, as text.

    python benchmarks/make_headers.py [--out benchmarks/cache/headers.jsonl.gz]
                                      [--root /usr/include] [--max-bytes 64M]

Source code, where the other two corpora are prose (pydocs, manpages). Takes every regular file
under ``--root`` that decodes as UTF-8 and holds no NUL byte, one document per file, sorted by
path, up to ``--max-bytes`` of text spread over the top-level folders (each folder's files in
path order, round-robin, so no one library fills the corpus), and writes them as gzipped JSON
lines ``{"id", "path", "text"}``, the layout of pydocs.jsonl.gz. What it holds depends on the
Debian packages installed (``apt-get install`` more ``-dev`` packages for a bigger corpus); the
summary gives its size and checksum, so runs on two machines can tell whether they scored the
same text.
"""

from __future__ import annotations

import argparse
import sys
from collections import deque
from pathlib import Path

from common import CACHE, write_documents

from teralm.build_index.builder import parse_size

ROOT = Path("/usr/include")
DEFAULT_OUT = CACHE / "headers.jsonl.gz"


def header_text(path: Path) -> str | None:
    """The file as text, or None for one that is not UTF-8 text (or cannot be read)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if not data.strip() or b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def by_folder(root: Path) -> list[deque[Path]]:
    """The regular files under ``root``, one queue per top-level entry, each in path order."""
    queues = []
    for top in sorted(root.iterdir()):
        if top.is_symlink():
            continue
        files = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
        files = [p for p in files if not p.is_symlink()]
        if files:
            queues.append(deque(files))
    return queues


def documents(root: Path, max_bytes: int) -> list[tuple[str, str]]:
    """Up to ``max_bytes`` of text, one file from each folder in turn, sorted by path."""
    queues, taken, size = by_folder(root), [], 0
    while queues and size < max_bytes:
        queue = queues.pop(0)
        path = queue.popleft()
        text = header_text(path)
        if text is not None and size + len(text.encode()) <= max_bytes:
            taken.append((str(path.relative_to(root)), text))
            size += len(text.encode())
        if queue:
            queues.append(queue)
    return sorted(taken)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--root", type=Path, default=ROOT, help="the headers' root folder")
    parser.add_argument("--max-bytes", default="64M", help="text to take at most (64M)")
    args = parser.parse_args()
    if not args.root.is_dir():
        sys.exit(f"{args.root} is not a folder: install some -dev packages (apt-get install ...)")
    taken = documents(args.root, parse_size(args.max_bytes, "--max-bytes"))
    if not taken:
        sys.exit(f"no text files under {args.root}")
    print(write_documents(args.out, taken))


if __name__ == "__main__":
    main()
