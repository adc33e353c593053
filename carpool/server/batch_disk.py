"""Every byte the Files and Batches API writes goes through one ``BatchDisk``.

Uploads, a running batch's journal lines and the published output files are written here,
and only here, so that a disk that fills up or turns read-only is met in one place with one
rule (``OSError``: the batch waits and tries again, an upload gets a 507) -- and so that a
test can hand the server a disk that fails on purpose (``carpool.testing.faulty_disk``)
without root, a tmpfs or a loop device.  The SQLite store writes through SQLite.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Protocol

from carpool.jobs.writer import Appender


class NewFile(Protocol):
    """What an upload writes through: a binary file open for writing."""

    def write(self, data: bytes, /) -> int: ...

    def flush(self) -> None: ...

    def fileno(self) -> int: ...

    def close(self) -> None: ...


class BatchDisk:
    def appender(self, path: Path) -> Appender:
        """A journal file to append lines to; every line reaches the OS as it is written, so a
        killed server loses none (fsync'd at most every second)."""
        return Appender(path, flush_lines=1)

    def create(self, path: Path) -> NewFile:
        """A new file (an upload's bytes) open for writing; the caller closes it."""
        return open(path, "xb")

    def copy(self, source: Path, target: Path) -> None:
        """``target`` with the bytes of ``source``, hard-linked where the file system allows
        (nothing copied: the input of a batch, a journal being published), and on disk."""
        try:
            os.link(source, target)
        except OSError:
            shutil.copyfile(source, target)
        with open(target, "rb") as f:
            os.fsync(f.fileno())
