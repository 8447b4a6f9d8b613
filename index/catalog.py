"""The LMDB catalog of an index: documents and the build's progress records."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import lmdb

from teralm.files import fsync_path

MAP_SIZE = 1 << 40  # address space only; the file grows with its content


def unit_key(kind: str, i: int) -> str:
    """Key of a build progress record, e.g. ``p2/shard/0000000003`` (sorts numerically)."""
    return f"{kind}/{i:010d}"


DOC_PREFIX = b"doc/"


def doc_key(doc_id: int) -> bytes:
    return DOC_PREFIX + doc_id.to_bytes(8, "big")


class Catalog:
    """Key -> JSON records in one LMDB environment. Writes are transactions (all or nothing)."""

    def __init__(self, path: Path, readonly: bool = False):
        self.path = Path(path)
        self.readonly = readonly
        self.env = self._open(self.path, readonly)
        if readonly:
            self._check_length()

    @staticmethod
    def _open(path: Path, readonly: bool) -> lmdb.Environment:
        return lmdb.open(
            str(path),
            map_size=MAP_SIZE,
            readonly=readonly,
            lock=not readonly,
            subdir=True,
            max_dbs=0,
        )

    def _check_length(self) -> None:
        """Refuse a data file shorter than the pages its header counts: reading past its end
        would kill the process (SIGBUS)."""
        needed = (self.env.info()["last_pgno"] + 1) * self.env.stat()["psize"]
        size = (self.path / "data.mdb").stat().st_size
        if size < needed:
            self.env.close()
            raise lmdb.CorruptedError(f"data.mdb is {size} bytes, its header counts {needed}")

    def close(self) -> None:
        """Close it; a writer also removes LMDB's lock file (it holds process ids, and is made
        again by the next writer), so that a finished folder's files depend on its content only."""
        self.env.close()
        if not self.readonly:
            (self.path / "lock.mdb").unlink(missing_ok=True)

    def rewrite(self, records: dict[bytes, object]) -> None:
        """Replace the whole content by ``records``, written in key order in one transaction
        into a fresh data file that then replaces the old one at once: the same records always
        give the same bytes, whatever writes came before."""
        fresh = self.path.with_name(self.path.name + ".tmp")
        shutil.rmtree(fresh, ignore_errors=True)
        env = self._open(fresh, False)
        with env.begin(write=True) as txn:
            for key in sorted(records):
                txn.put(key, json.dumps(records[key]).encode(), append=True)
        env.sync(True)
        env.close()
        self.env.close()
        os.replace(fresh / "data.mdb", self.path / "data.mdb")
        fsync_path(self.path)
        shutil.rmtree(fresh)
        self.env = self._open(self.path, self.readonly)

    def get(self, key: str | bytes):
        with self.env.begin() as txn:
            raw = txn.get(key.encode() if isinstance(key, str) else key)
        return None if raw is None else json.loads(raw)

    def put(self, records: dict[str | bytes, object]) -> None:
        """Write several records in one transaction."""
        with self.env.begin(write=True) as txn:
            for key, value in records.items():
                txn.put(key.encode() if isinstance(key, str) else key, json.dumps(value).encode())

    def prefixed(self, prefix: str | bytes) -> Iterator[tuple[bytes, object]]:
        """All records whose key starts with ``prefix``, in key order."""
        prefix = prefix.encode() if isinstance(prefix, str) else prefix
        with self.env.begin() as txn:
            cursor = txn.cursor()
            if not cursor.set_range(prefix):
                return
            for key, raw in cursor:
                if not key.startswith(prefix):
                    break
                yield key, json.loads(raw)

    def digest(self, prefix: bytes) -> tuple[int, str]:
        """How many records have keys starting with ``prefix``, and one sha256 of their keys
        and values as stored, in key order."""
        digest, count = hashlib.sha256(), 0
        with self.env.begin() as txn:
            cursor = txn.cursor()
            if cursor.set_range(prefix):
                for key, raw in cursor:
                    if not key.startswith(prefix):
                        break
                    for part in (key, raw):
                        digest.update(len(part).to_bytes(8, "little") + part)
                    count += 1
        return count, digest.hexdigest()

    def document(self, doc_id: int) -> dict | None:
        """``{"start", "length", "source"}`` of one document."""
        return self.get(doc_key(doc_id))
