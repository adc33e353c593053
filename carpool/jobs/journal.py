"""Crash-safe progress: the output files are the journal.

Every finished task is one appended line of the output (or errors) file, and a task is
"done" exactly when its line is complete in that file.  There is no second file that
could disagree with the output, so after a crash or Ctrl-C:

- a half-written last line (the process died mid-write) is cut off;
- the custom_ids of the complete lines are the done set; the reader skips them;
- nothing done is sent again and no line is ever written twice.

Lines start with ``{"custom_id": ...`` so recovery decodes only that string, not the
whole response.  The done set is a sorted numpy array of 64-bit hashes (8 bytes a task:
80 MB for 10 million), which keeps resume of huge jobs in bounded memory.  A small state
file beside the output remembers the input file and the command, to warn when a resume
uses a different input.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

from carpool.jobs.writer import Appender, ResultWriter

_DECODER = json.JSONDecoder()
_HEAD = '{"custom_id":'


def id_hash(custom_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(custom_id.encode(), digest_size=8).digest(), "little")


class DoneSet:
    def __init__(self, hashes: np.ndarray | None = None):
        self._h = np.unique(hashes) if hashes is not None and len(hashes) else np.zeros(0, np.uint64)

    def __len__(self) -> int:
        return len(self._h)

    def __contains__(self, custom_id: str) -> bool:
        return self.has_hash(id_hash(custom_id))

    def has_hash(self, h: int) -> bool:
        if not len(self._h):
            return False
        i = int(np.searchsorted(self._h, np.uint64(h)))
        return i < len(self._h) and self._h[i] == h

    def merged(self, hashes: set[int]) -> DoneSet:
        return DoneSet(np.union1d(self._h, np.fromiter(hashes, np.uint64, len(hashes))))


class SeenIds:
    """The custom_ids read so far in this run, to refuse duplicates in bounded memory.

    Recent ids sit in a small Python set; when it fills, it is merged into a sorted
    numpy array of 64-bit hashes, so a long job costs about 8 bytes a task, as DoneSet.
    """

    def __init__(self, batch: int = 1 << 18):
        self._old = DoneSet()
        self._new: set[int] = set()
        self._batch = batch

    def add(self, custom_id: str) -> bool:
        """Remember the id; False when it was seen before."""
        h = id_hash(custom_id)
        if h in self._new or self._old.has_hash(h):
            return False
        self._new.add(h)
        if len(self._new) >= self._batch:
            self._old = self._old.merged(self._new)
            self._new.clear()
        return True


def line_id(line: bytes) -> str | None:
    """The custom_id of one output line (cheap: only that string is decoded when it comes first)."""
    text = line.decode("utf-8", "replace")
    if text.startswith(_HEAD):
        try:
            value, _ = _DECODER.raw_decode(text, len(_HEAD))
            return value if isinstance(value, str) else None
        except ValueError:
            pass
    try:  # a line written by something else: decode it all
        obj = json.loads(text)
        return obj.get("custom_id") if isinstance(obj, dict) else None
    except ValueError:
        return None


def recover_file(path: Path) -> tuple[list[int], int]:
    """Cut a trailing partial line; return (hashes of done custom_ids, bytes cut)."""
    if not path.exists():
        return [], 0
    hashes: list[int] = []
    good_end = 0
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break
            good_end += len(line)
            cid = line_id(line)
            if cid is not None:
                hashes.append(id_hash(cid))
    size = path.stat().st_size
    if size > good_end:
        with open(path, "r+b") as f:
            f.truncate(good_end)
            os.fsync(f.fileno())
    return hashes, size - good_end


class Journal:
    def __init__(self, output: str | os.PathLike, errors: str | os.PathLike | None = None):
        self.paths = [Path(output)] + ([Path(errors)] if errors else [])
        self.state_path = Path(str(output) + ".carpool.json")
        self.done = DoneSet()
        self.cut_bytes = 0

    def open(self, input_path: str | None, *, fresh: bool, argv: list[str] | None) -> tuple[DoneSet, list[str]]:
        """Start a run into this journal: ``fresh`` deletes it, else the done set is recovered
        (a half-written last line cut).  Returns the done set and what the user should know.
        The state file records the input and the command (a resume of another input warns)."""
        notes: list[str] = []
        done = DoneSet()
        if fresh:
            self.reset()
        elif self.exists():
            warning = self.check_state(input_path)
            if warning:
                notes.append("warning: " + warning)
            done = self.recover()
            if self.cut_bytes:
                notes.append(f"cut a half-written last line ({self.cut_bytes} bytes) from the output")
        self.write_state(input_path, finished=False, argv=argv)
        return done, notes

    def open_writer(self, ordered: bool) -> ResultWriter:
        """The appending writer of this journal's files (results, and errors if separate)."""
        errors = Appender(self.paths[1]) if len(self.paths) > 1 else None
        return ResultWriter(Appender(self.paths[0]), errors, ordered=ordered)

    def exists(self) -> bool:
        return any(p.exists() and p.stat().st_size > 0 for p in self.paths)

    def recover(self) -> DoneSet:
        all_hashes: list[int] = []
        for p in self.paths:
            hashes, cut = recover_file(p)
            all_hashes.extend(hashes)
            self.cut_bytes += cut
        self.done = DoneSet(np.array(all_hashes, dtype=np.uint64))
        return self.done

    def reset(self) -> None:
        """``--fresh``: start over (the old output is removed)."""
        for p in [*self.paths, self.state_path]:
            if p.exists():
                p.unlink()

    def check_state(self, input_path: str | None) -> str | None:
        """A warning when the previous run used another input file, else None."""
        if input_path is None:
            return None
        try:
            old = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return None
        st = os.stat(input_path)
        if old.get("input") != os.path.abspath(input_path) or old.get("input_size") != st.st_size:
            return (f"the previous run into this output used {old.get('input')} ({old.get('input_size')} bytes); "
                    f"now {os.path.abspath(input_path)} ({st.st_size} bytes). Tasks are matched by custom_id; "
                    "use --fresh to start over")
        return None

    def write_state(self, input_path: str | None, finished: bool, argv: list[str] | None = None) -> None:
        """``input_path`` None: the tasks did not come from a file (records in memory)."""
        doc = {"input": os.path.abspath(input_path) if input_path is not None else None,
               "input_size": os.stat(input_path).st_size if input_path is not None else None,
               "finished": finished, "argv": argv if argv is not None else sys.argv}
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.state_path)
