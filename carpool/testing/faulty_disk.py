"""A disk for the Files and Batches API that fails on purpose: full, or read-only.

    disk = FaultyDisk()
    with start_server(config, engine=engine, batch_disk=disk) as srv:
        disk.fill(5_000)      # 5,000 bytes left: then writes fail with ENOSPC
        ...
        disk.free()           # room again: the stalled batch goes on by itself

It stands where a full tmpfs or a read-only mount would, without root: every byte the API
writes goes through a ``BatchDisk`` (``carpool.server.batch_disk``), and this one counts
them.  A journal line that does not fit is written in part and then refused, as a real full
disk leaves it, so the recovery of a half-written line is exercised too.  SQLite writes are
not counted (they are not the API's bytes).
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

from carpool.jobs.writer import Appender
from carpool.server.batch_disk import BatchDisk, NewFile


def _error(code: int, path: Path) -> OSError:
    return OSError(code, os.strerror(code), str(path))


class FaultyDisk(BatchDisk):
    def __init__(self) -> None:
        self._lock = threading.Lock()  # journals are written on the loop and on worker threads
        self._left: int | None = None  # bytes that still fit; None: as many as the real disk takes
        self.read_only = False
        self.refused = 0  # writes refused so far

    def fill(self, left: int = 0) -> None:
        """From now on only ``left`` more bytes fit."""
        with self._lock:
            self._left = left

    def free(self) -> None:
        """Room again, and writable."""
        with self._lock:
            self._left = None
            self.read_only = False

    def take(self, n: int, path: Path) -> int:
        """Room for ``n`` bytes of ``path``: how many fit (all of them, or fewer and then
        the caller raises ``refuse``); raises at once when read-only or full."""
        with self._lock:
            if self.read_only:
                self.refused += 1
                raise _error(errno.EROFS, path)
            if self._left is None:
                return n
            room = min(n, self._left)
            self._left -= room
            if room == 0 and n > 0:
                self.refused += 1
                raise _error(errno.ENOSPC, path)
            return room

    def refuse(self, path: Path) -> OSError:
        with self._lock:
            self.refused += 1
        return _error(errno.ENOSPC, path)

    def appender(self, path: Path) -> Appender:
        self.take(0, path)
        return _CountedAppender(self, path)

    def create(self, path: Path) -> NewFile:
        self.take(0, path)
        return _CountedFile(self, path)

    def copy(self, source: Path, target: Path) -> None:
        """A hard link takes no room (as on a real disk); a copy takes the file's size."""
        self.take(0, target)
        try:
            os.link(source, target)
            return
        except OSError:
            pass
        size = source.stat().st_size
        if self.take(size, target) < size:
            raise self.refuse(target)
        super().copy(source, target)


class _CountedAppender(Appender):
    def __init__(self, disk: FaultyDisk, path: Path) -> None:
        super().__init__(path, flush_lines=1)
        self.disk = disk

    def write(self, line: bytes) -> None:
        room = self.disk.take(len(line), self.path)
        if room < len(line):
            self.flush()
            with open(self.path, "ab") as f:  # the part that fit, as a full disk leaves it
                f.write(line[:room])
            raise self.disk.refuse(self.path)
        super().write(line)


class _CountedFile:
    """An upload's file whose writes count against the disk."""

    def __init__(self, disk: FaultyDisk, path: Path) -> None:
        self.disk = disk
        self.path = path
        self._f = open(path, "xb")  # noqa: SIM115 - closed by close()

    def write(self, data: bytes) -> int:
        room = self.disk.take(len(data), self.path)
        self._f.write(data[:room])
        if room < len(data):
            raise self.disk.refuse(self.path)
        return len(data)

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self) -> None:
        self._f.close()
