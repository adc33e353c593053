"""Where the Files and Batches API keeps its state: one SQLite database and a directory of files.

Layout under the batch directory (``--batch-dir``, default ``<cache dir>/batches``)::

    store.sqlite             files and batches (one row each, the batch as its JSON record)
    files/<file_id>          the bytes of every uploaded or produced file
    work/<batch_id>/         the journal of a running batch (output.jsonl, errors.jsonl)

SQLite runs in WAL mode with ``synchronous=FULL``: a status change the server answered
with survives a kill -9 of the server, so a restart knows exactly which batches were
still running.  A file's bytes are written (and fsync'd) before its row is inserted, so
a row always names a whole file; a file without a row (an upload the kill cut short) is
removed at the next start.

Every row has an ``owner``: the project of the API key that created it (``owners.py``; ''
when the server takes no key).  Reads given an owner see that owner's rows and the rows of
no owner; reads given none (the server's own, resuming batches, and every request when the
server takes no key) see every row.

Every method runs on the server's event loop thread (SQLite calls here take well under a
millisecond); nothing else touches the connection.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from carpool.server.batch_object import Batch

T = TypeVar("T")

FILE_PURPOSES = ("assistants", "assistants_output", "batch", "batch_output", "fine-tune",
                 "fine-tune-results", "vision", "user_data", "evals")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    owner TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    status TEXT NOT NULL,
    doc TEXT NOT NULL,
    owner TEXT NOT NULL DEFAULT ''
);
"""


def new_id(prefix: str) -> str:
    return prefix + os.urandom(12).hex()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _visible(owner: str | None) -> tuple[str | None, tuple]:
    """The WHERE clause (and its parameters) of the rows ``owner`` may see."""
    return (None, ()) if owner is None else ("owner IN ('', ?)", (owner,))


class BatchStore:
    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.files_dir = self.root / "files"
        self.work_dir = self.root / "work"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.root / "store.sqlite", isolation_level=None, check_same_thread=False)
        try:
            self.db.row_factory = sqlite3.Row
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self.db.executescript(_SCHEMA)
            self._add_owner_columns()
            self._remove_orphans()
        except BaseException:
            self.db.close()
            raise

    def close(self) -> None:
        self.db.close()

    def _add_owner_columns(self) -> None:
        """A store written before rows had owners: its rows get the owner '' (seen by every key)."""
        for table in ("files", "batches"):
            names = {r["name"] for r in self.db.execute(f"PRAGMA table_info({table})")}
            if "owner" not in names:
                self.db.execute(f"ALTER TABLE {table} ADD COLUMN owner TEXT NOT NULL DEFAULT ''")

    def _remove_orphans(self) -> None:
        """Bytes with no row: an upload or a publish cut short by a crash."""
        known = {r["id"] for r in self.db.execute("SELECT id FROM files")}
        for path in self.files_dir.iterdir():
            if path.name not in known:
                path.unlink(missing_ok=True)

    # -- files

    def file_path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def upload_path(self) -> Path:
        """Where an upload streams to before it has an id (renamed by ``add_file``)."""
        return self.files_dir / new_id("upload-")

    def add_file(self, source: Path, filename: str, purpose: str, owner: str,
                 file_id: str | None = None) -> dict:
        """Move ``source`` (whole, fsync'd) under its id and record it; returns the file object.
        With ``file_id`` given and already recorded, the existing object is returned (a publish
        run again after a crash)."""
        if file_id is not None:
            old = self.get_file(file_id)
            if old is not None:
                return old
        file_id = file_id or new_id("file-")
        target = self.file_path(file_id)
        os.replace(source, target)
        _fsync_dir(self.files_dir)
        size = target.stat().st_size
        self.db.execute("INSERT INTO files (id, bytes, created_at, filename, purpose, owner) VALUES (?, ?, ?, ?, ?, ?)",
                        (file_id, size, int(time.time()), filename, purpose, owner))
        found = self.get_file(file_id)
        assert found is not None
        return found

    def get_file(self, file_id: str, owner: str | None = None) -> dict | None:
        """The file object, if ``owner`` may see it (None: whoever owns it)."""
        where, args = _visible(owner)
        sql = "SELECT * FROM files WHERE id = ?" + (f" AND {where}" if where else "")
        row = self.db.execute(sql, (file_id, *args)).fetchone()
        return _file_object(row) if row is not None else None

    def list_files(self, *, after: str | None, limit: int, order: str, purpose: str | None,
                   owner: str | None) -> tuple[list[dict], bool]:
        """A page of the files ``owner`` may see (``order`` by creation, ``after`` a file id) and
        whether more follow."""
        where, args = _visible(owner)
        clauses = [c for c in (where, "purpose = ?" if purpose else None) if c]
        return self._page("files", after, limit, order, " AND ".join(clauses) or None,
                          (*args, *((purpose,) if purpose else ())), _file_object)

    def delete_file(self, file_id: str) -> bool:
        cur = self.db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        self.file_path(file_id).unlink(missing_ok=True)
        return cur.rowcount > 0

    # -- batches

    def add_batch(self, batch: Batch) -> None:
        self.db.execute("INSERT INTO batches (id, status, doc, owner) VALUES (?, ?, ?, ?)",
                        (batch.id, batch.status, json.dumps(batch.to_record()), batch.owner))

    def save_batch(self, batch: Batch) -> None:
        self.db.execute("UPDATE batches SET status = ?, doc = ? WHERE id = ?",
                        (batch.status, json.dumps(batch.to_record()), batch.id))

    def get_batch(self, batch_id: str, owner: str | None = None) -> Batch | None:
        """The batch, if ``owner`` may see it (None: whoever owns it)."""
        where, args = _visible(owner)
        sql = "SELECT doc, owner FROM batches WHERE id = ?" + (f" AND {where}" if where else "")
        row = self.db.execute(sql, (batch_id, *args)).fetchone()
        return _batch(row) if row is not None else None

    def list_batches(self, *, after: str | None, limit: int, owner: str | None) -> tuple[list[Batch], bool]:
        """The batches ``owner`` may see, newest first (as OpenAI lists them)."""
        where, args = _visible(owner)
        return self._page("batches", after, limit, "desc", where, args, _batch)

    def unfinished_batches(self, statuses: tuple[str, ...]) -> list[Batch]:
        marks = ",".join("?" * len(statuses))
        rows = self.db.execute(f"SELECT doc, owner FROM batches WHERE status IN ({marks}) ORDER BY seq", statuses)
        return [_batch(r) for r in rows]

    def count_batches(self) -> dict[str, int]:
        """How many batches the store holds, by status (a scrape of /metrics reads it)."""
        rows = self.db.execute("SELECT status, COUNT(*) AS n FROM batches GROUP BY status")
        return {r["status"]: r["n"] for r in rows}

    def batch_work_dir(self, batch_id: str) -> Path:
        return self.work_dir / batch_id

    def _page(self, table: str, after: str | None, limit: int, order: str, where: str | None,
              args: tuple, shape: Callable[[sqlite3.Row], T]) -> tuple[list[T], bool]:
        clauses = [where] if where else []
        params: list = list(args)
        direction = "DESC" if order == "desc" else "ASC"
        if after:
            row = self.db.execute(f"SELECT seq FROM {table} WHERE id = ?", (after,)).fetchone()
            if row is not None:
                clauses.append("seq < ?" if direction == "DESC" else "seq > ?")
                params.append(row["seq"])
        sql = f"SELECT * FROM {table}"
        if clauses:
            sql += " WHERE " + " AND ".join(clauses)
        sql += f" ORDER BY seq {direction} LIMIT ?"
        params.append(limit + 1)
        rows = self.db.execute(sql, params).fetchall()
        return [shape(r) for r in rows[:limit]], len(rows) > limit


def _batch(row: sqlite3.Row) -> Batch:
    batch = Batch.from_record(json.loads(row["doc"]))
    batch.owner = row["owner"]
    return batch


def _file_object(row: sqlite3.Row) -> dict:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed",
            "expires_at": None, "status_details": None}
