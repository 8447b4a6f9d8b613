"""Durable file writes (atomic replace, positioned writes, fsync) and checksums."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from teralm.errors import ConfigError, FolderBusy, IndexDamaged

LOCK = ".lock"  # the file that names a folder's writer while it writes


def sha256_file(path: Path, bar=None) -> str:
    """The file's sha256 in hex (``bar``, a tqdm bar, counts the bytes read)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
            if bar is not None:
                bar.update(len(chunk))
    return digest.hexdigest()


def write_atomic(path: Path, data, sync: bool = True) -> None:
    """Write ``data`` (bytes or a numpy array) so readers see the old file or the whole new one.

    Temp name, fsync, rename; the temp file is removed if writing fails (e.g. a full disk), and
    the error names ``path``. ``sync=False`` leaves both fsyncs to the caller (``fsync_path`` of
    the file, then of its folder), which must not count on the file before them.
    """
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        write_at(tmp, [(0, data)], create=True, sync=sync)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        e.filename = str(path)
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if sync:
        fsync_path(path.parent)


def write_at(
    path: Path, pieces: Iterable[tuple[int, object]], create: bool = False, sync: bool = True
) -> None:
    """Write each ``(offset, data)`` piece (bytes or a numpy array) into ``path``, then fsync.

    Every byte is on disk when this returns, or it raises OSError naming ``path``: a short write
    (a disk that fills up part way through a piece) is continued, and that raises ENOSPC.
    ``create`` makes a new, empty file first. ``sync=False`` leaves the fsync to the caller
    (``fsync_path``), for many small writes into the same files.
    """
    flags = os.O_WRONLY | (os.O_CREAT | os.O_TRUNC if create else 0)
    try:
        fd = os.open(path, flags, 0o666)  # less the umask, as open() does
        try:
            for offset, data in pieces:
                view = memoryview(_as_bytes(data))
                while view:
                    written = os.pwrite(fd, view, offset)
                    view, offset = view[written:], offset + written
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        e.filename = str(path)
        raise


def _as_bytes(data):
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return data


def fsync_path(path: Path) -> None:
    """Flush ``path`` to disk: a file's data, or a directory's entries (a rename inside it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def folder_lock(directory: Path, job: str, name: str = LOCK) -> Iterator[None]:
    """Hold ``directory`` (which exists) for one writer while the block runs: an exclusive
    ``flock`` on its file ``name``, which names the holder while it holds it. FolderBusy at once,
    naming the holder, when another process holds it (on a shared filesystem too: Linux's NFS
    client turns ``flock`` into a lock the server keeps). No lock where there is no ``flock``."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    fd = os.open(Path(directory) / name, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            raise FolderBusy(
                f"{directory} is in use by {holder}; wait for it to end, or stop it, "
                "and run this again (or choose another --out)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{job} (pid {os.getpid()} on {socket.gethostname()})\n".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # named by no one; the file stays (removing it races a waiter)
    finally:
        os.close(fd)  # releases the lock


def _holder(fd: int, wait_s: float = 1.0) -> str:
    """Who holds the lock file ``fd``: the name it writes just after it takes the lock (waited
    for up to ``wait_s``, for a holder that has just taken it)."""
    deadline = time.monotonic() + wait_s
    while True:
        name = os.pread(fd, 256, 0).decode(errors="replace").strip()
        if name or time.monotonic() > deadline:
            return name or "another process"
        time.sleep(0.02)


def read_manifest_file(path: Path, kind: str, version: int, missing: str, rebuild: str) -> dict:
    """The JSON object in ``path`` whose ``format`` is ``kind`` and ``version`` is ``version``:
    ConfigError with ``missing`` when there is no such file, or with ``rebuild`` when it is of
    another version; IndexDamaged when it cannot be read or is not such a manifest."""
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(missing) from None
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON
        raise IndexDamaged(f"{path} cannot be read ({e}); {rebuild}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != kind:
        raise IndexDamaged(f"{path} is not a {kind} manifest; {rebuild}")
    if manifest.get("version") != version:
        raise ConfigError(
            f"{path.parent} has {kind} format version {manifest.get('version')}, this teralm "
            f"reads version {version}; {rebuild}"
        )
    return manifest


def format_bytes(n: float) -> str:
    """``n`` bytes as people read them: 1 B, 64 KiB, 401 MiB, 1.5 GiB."""
    units, i = ("B", "KiB", "MiB", "GiB", "TiB"), 0
    while n >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:,.0f} {units[i]}" if i < 3 else f"{n:,.1f} {units[i]}"
