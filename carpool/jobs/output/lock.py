"""One run at a time per output file: an exclusive lock held for the whole job.

The output file is the job's journal, so two runs on it would each send every task the
other has not finished yet (and pay for it twice) and write a line per id each.  The lock
is ``flock`` on a file beside the output (``<output>.carpool.lock``): the OS releases it
when the process ends however it ends (a crash, SIGKILL), so a lock is never stale.

The holder removes the file when it lets go, so nothing is left in the user's directory
after a job (a killed process cannot, and its file then holds nothing: the next run takes it
and removes it in turn).  Removing a lock file is safe only with a second look: a run may
have opened the file just before the holder removed it and lock it once the holder lets go,
holding a file that no longer has a name while a third run creates and locks a new one.  So
a run that got the lock checks that the path still names the file it locked, and starts
over when it does not; the holder removes the name while it still holds the lock.

The file holds who holds the lock (pid, host, start time) so the run that is refused can
say whom it waits for.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from carpool.errors import OutputLocked
from carpool.jobs.options import FLAGS, Naming

LOCK_SUFFIX = ".carpool.lock"


def lock_path(output: str | os.PathLike) -> Path:
    return Path(str(output) + LOCK_SUFFIX)


def _holder(text: str) -> str:
    """Who holds the lock, in words, from the lock file's text (it may be empty or cut: the
    holder writes it right after taking the lock)."""
    try:
        doc = json.loads(text)
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(doc["started"])))
        return f"pid {int(doc['pid'])} on {doc['host']}, started {started}"
    except (ValueError, KeyError, TypeError):
        return "its pid is not known yet"


class OutputLock:
    """``acquire`` before the job reads its journal, ``release`` once it wrote its last line.

    ``OutputLocked`` when another process holds it.  Where the file system cannot lock
    (some network file systems), the job runs unlocked and ``note`` says so."""

    def __init__(self, output: str | os.PathLike, naming: Naming = FLAGS):
        """``naming``: how the refusal names the output setting (``-o``, ``output=``)."""
        self.output = Path(output)
        self.naming = naming
        self.path = lock_path(output)
        self.note: str | None = None
        self._fd: int | None = None

    def acquire(self) -> None:
        if self._fd is not None:
            return
        if not self.path.parent.is_dir():
            return  # nothing can be written there: the journal refuses the start, naming the fix
        while True:
            fd = self._lock_file()
            if fd is None or _still_named(fd, self.path):
                break
            os.close(fd)  # its holder removed it as we waited: lock the file the name holds now
        if fd is None:
            return
        self._fd = fd
        me = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})
        with contextlib.suppress(OSError):  # who holds it is for messages; the lock is what counts
            os.ftruncate(fd, 0)
            os.pwrite(fd, me.encode(), 0)

    def _lock_file(self) -> int | None:
        """A descriptor of the lock file, locked; None where the file system cannot lock
        (``note`` says so); ``OutputLocked`` when another run holds it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = _holder(os.pread(fd, 4096, 0).decode("utf-8", "replace"))
            os.close(fd)
            raise OutputLocked(
                f"{str(self.output)!r} is being written by another carpool run ({who}; lock file "
                f"{str(self.path)!r}). Two runs on one output would send its tasks twice: wait for "
                f"that run to end (the same command then resumes), or write to another {self.naming('output')}"
            ) from None
        except OSError as e:
            os.close(fd)
            with contextlib.suppress(OSError):  # nothing can hold it: it only litters the directory
                self.path.unlink()
            self.note = (f"could not lock {str(self.output)!r} ({e.strerror or e}): nothing stops a second "
                         "run on the same output from sending its tasks again")
            return None
        return fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            # The name goes first, while the lock is held: a run that opened the file before
            # this sees, once it gets the lock, that the name is gone, and starts over.
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # should the name stay, it names no holder
            with contextlib.suppress(OSError):
                if _still_named(fd, self.path):
                    self.path.unlink()
            os.close(fd)  # closing the last descriptor releases the lock


def _still_named(fd: int, path: Path) -> bool:
    """Whether ``path`` names the file ``fd`` is open on (and not another, or none)."""
    try:
        now = path.stat()
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)
