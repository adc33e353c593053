"""The embedded exact cache: one SQLite file, WAL mode, shared safely by several processes.

Each process (and each store object) opens its own connection; WAL lets readers run
while one writer commits, and ``busy_timeout`` makes a second writer wait instead of
failing.  Every ``put`` is its own short transaction, so a crash loses at most the entry
being written.  Entries may expire (TTL): an expired entry is never served, and it is
deleted when looked up or swept.  With ``max_bytes`` the least recently used entries are
evicted once the file's payload passes the cap.

Beside each entry: the model name and the ``--cache-namespace`` it was stored for, so
``carpool cache clear --model NAME`` can delete one model's entries.  A file written
before they existed gets the two columns added on open; its old entries are still read,
but they have neither, so only a full ``clear`` removes them.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

from carpool.compat import Self
from carpool.paths import cache_dir

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    key         TEXT PRIMARY KEY,
    value       TEXT NOT NULL,
    size        INTEGER NOT NULL,
    created     REAL NOT NULL,
    expires     REAL,              -- NULL: never
    last_access REAL NOT NULL,
    model       TEXT,              -- NULL: stored before the column existed
    namespace   TEXT
);
CREATE INDEX IF NOT EXISTS entries_last_access ON entries(last_access);
CREATE INDEX IF NOT EXISTS entries_expires ON entries(expires);
CREATE TABLE IF NOT EXISTS counters (
    name  TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
"""

_COUNTERS = ("hits", "misses", "expired", "puts", "evicted")
_MAINTAIN_EVERY = 128  # puts between sweeps of expired entries / size checks
_FLUSH_EVERY = 256  # counted events between writes of the lifetime counters


def default_cache_dir() -> Path:
    return cache_dir()


def default_cache_path() -> Path:
    return default_cache_dir() / "results.sqlite"


class SQLiteStore:
    """Exact cache in one SQLite file.  Thread-safe; several processes may share the file."""

    backend = "sqlite"

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        ttl_s: float | None = None,
        max_bytes: int | None = None,
        busy_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``clock``: the time entries are stamped and expired by (tests pass their own)."""
        self.clock = clock
        self.path = Path(path) if path is not None else default_cache_path()
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(
            str(self.path), timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
        )
        self._init_db()
        # This object's own counts; the file keeps lifetime counts for `carpool cache stats`.
        self._session = dict.fromkeys(_COUNTERS, 0)
        self._unflushed = dict.fromkeys(_COUNTERS, 0)
        self._puts_since_maintain = 0
        self._closed = False

    def _init_db(self) -> None:
        # Switching to WAL takes a lock; several processes opening a new file at once may
        # see SQLITE_BUSY even with a timeout, so retry briefly.
        for attempt in range(50):
            try:
                self._conn.execute("PRAGMA busy_timeout = 30000")
                mode = self._conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                self._conn.execute("PRAGMA synchronous = NORMAL")
                self._conn.executescript(_SCHEMA)
                self._add_columns()
                break
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) and "busy" not in str(exc):
                    raise
                time.sleep(0.05 * (attempt + 1))
        else:
            raise sqlite3.OperationalError(f"cache file {self.path} stayed locked; is another process stuck?")
        if str(mode).lower() != "wal":
            raise sqlite3.OperationalError(
                f"cache file {self.path}: SQLite refused WAL mode (got {mode!r}); "
                "use a local file system, not a network share"
            )

    def _add_columns(self) -> None:
        """A file from before the model/namespace columns: add them (its entries stay readable)."""
        have = {row[1] for row in self._conn.execute("PRAGMA table_info(entries)")}
        for name in ("model", "namespace"):
            if name not in have:
                try:
                    self._conn.execute(f"ALTER TABLE entries ADD COLUMN {name} TEXT")
                except sqlite3.OperationalError as exc:  # another process added it first
                    if "duplicate column" not in str(exc):
                        raise

    # -- counters ---------------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        # Called with the lock held.
        self._session[name] += n
        self._unflushed[name] += n
        if sum(self._unflushed.values()) >= _FLUSH_EVERY:
            self._flush_counters()

    def _flush_counters(self) -> None:
        pending = {k: v for k, v in self._unflushed.items() if v}
        if not pending:
            return
        self._conn.executemany(
            "INSERT INTO counters(name, value) VALUES (?, ?) "
            "ON CONFLICT(name) DO UPDATE SET value = value + excluded.value",
            list(pending.items()),
        )
        self._unflushed = dict.fromkeys(_COUNTERS, 0)

    # -- the store interface ----------------------------------------------------------

    def get(self, key: str) -> dict | None:
        now = self.clock()
        with self._lock:
            row = self._conn.execute("SELECT value, expires FROM entries WHERE key = ?", (key,)).fetchone()
            if row is None:
                self._count("misses")
                return None
            value, expires = row
            if expires is not None and expires <= now:
                self._conn.execute("DELETE FROM entries WHERE key = ? AND expires <= ?", (key, now))
                self._count("expired")
                self._count("misses")
                return None
            if self.max_bytes is not None:  # recency matters only when something gets evicted
                self._conn.execute("UPDATE entries SET last_access = ? WHERE key = ?", (now, key))
            self._count("hits")
        return json.loads(value)

    def put(self, key: str, response: dict, ttl_s: float | None = None, *, model: str | None = None,
            namespace: str = "") -> None:
        """Store ``response`` (a JSON-serialisable dict).  ``ttl_s`` None: the store's default;
        ``model`` / ``namespace``: what ``clear`` can select the entry by."""
        ttl = self.ttl_s if ttl_s is None else ttl_s
        value = json.dumps(response, ensure_ascii=False, separators=(",", ":"))
        now = self.clock()
        expires = now + ttl if ttl is not None else None
        with self._lock:
            self._conn.execute(
                "INSERT OR REPLACE INTO entries(key, value, size, created, expires, last_access, model, namespace) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (key, value, len(key) + len(value.encode()), now, expires, now, model, namespace),
            )
            self._count("puts")
            self._puts_since_maintain += 1
            if self._puts_since_maintain >= _MAINTAIN_EVERY:
                self._maintain_locked(now)

    def _maintain_locked(self, now: float) -> None:
        self._puts_since_maintain = 0
        gone = self._conn.execute("DELETE FROM entries WHERE expires IS NOT NULL AND expires <= ?", (now,))
        if gone.rowcount > 0:
            self._count("expired", gone.rowcount)
        if self.max_bytes is not None:
            total = self._conn.execute("SELECT COALESCE(SUM(size), 0) FROM entries").fetchone()[0]
            if total > self.max_bytes:
                self._evict_locked(total - self.max_bytes)
        self._flush_counters()

    def _evict_locked(self, excess: int) -> None:
        """Drop the least recently used entries until ``excess`` bytes are freed."""
        freed = evicted = 0
        rows = self._conn.execute("SELECT key, size FROM entries ORDER BY last_access").fetchall()
        doomed = []
        for key, size in rows:
            if freed >= excess:
                break
            doomed.append((key,))
            freed += size
            evicted += 1
        self._conn.executemany("DELETE FROM entries WHERE key = ?", doomed)
        self._count("evicted", evicted)

    def maintain(self) -> None:
        """Sweep expired entries, enforce ``max_bytes`` and write counters to the file now."""
        with self._lock:
            self._maintain_locked(self.clock())

    def stats(self) -> dict:
        now = self.clock()
        with self._lock:
            self._flush_counters()
            entries, payload, live_expired = self._conn.execute(
                "SELECT COUNT(*), COALESCE(SUM(size), 0), "
                "COALESCE(SUM(expires IS NOT NULL AND expires <= ?), 0) FROM entries",
                (now,),
            ).fetchone()
            lifetime = dict(self._conn.execute("SELECT name, value FROM counters").fetchall())
            by_model = self._conn.execute(
                "SELECT model, namespace, COUNT(*) FROM entries GROUP BY model, namespace "
                "ORDER BY COUNT(*) DESC LIMIT 50").fetchall()
        file_bytes = sum(
            p.stat().st_size for p in (self.path, Path(f"{self.path}-wal")) if p.exists()
        )
        lookups = self._session["hits"] + self._session["misses"]
        return {
            "backend": self.backend,
            "location": str(self.path),
            "entries": entries,
            "bytes": payload,  # keys + JSON values
            "file_bytes": file_bytes,
            "entries_expired_not_swept": live_expired,
            "ttl_s": self.ttl_s,
            "max_bytes": self.max_bytes,
            **self._session,
            "hit_rate": self._session["hits"] / lookups if lookups else 0.0,
            "lifetime": {name: lifetime.get(name, 0) for name in _COUNTERS},
            # The 50 largest (model, namespace) groups; model None: entries from before the column.
            "by_model": [{"model": m, "namespace": ns, "entries": n} for m, ns, n in by_model],
        }

    def clear(self, model: str | None = None, namespace: str | None = None) -> int:
        """Delete the entries of ``model`` and/or ``namespace`` (both None: every entry, and the
        lifetime counters); the file stays.  Returns how many entries were deleted."""
        where, args = [], []
        for column, value in (("model", model), ("namespace", namespace)):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        with self._lock:
            if where:
                gone = self._conn.execute("DELETE FROM entries WHERE " + " AND ".join(where), args).rowcount
            else:
                gone = self._conn.execute("DELETE FROM entries").rowcount
                self._conn.execute("DELETE FROM counters")
                self._unflushed = dict.fromkeys(_COUNTERS, 0)
            self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return max(gone, 0)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._flush_counters()
            finally:
                self._conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        with self._lock:
            return self._conn.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
