"""Crash-safe progress: the output files are the journal.

Every finished task is one appended line of the output (or errors) file, and a task is
"done" exactly when its line is complete in that file.  There is no second file that
could disagree with the output, so after a crash or Ctrl-C:

- a half-written last line (the process died mid-write) is cut off;
- the custom_ids of the complete lines are the done set; the reader skips them;
- nothing done is sent again and no line is ever written twice.

Lines start with ``{"custom_id": ..., "error": ...`` so recovery decodes only that string
and sees whether the line is an error line, not the whole response.  The done set is a
sorted numpy array of 64-bit hashes (8 bytes a task: 80 MB for 10 million), which keeps
resume of huge jobs in bounded memory.

``--retry-errors`` appends a new line for a task whose line is an error line (it names the
old line in ``supersedes``); the final line of an id is its success line if it has one,
else its last error line.  At the end of a finished run the superseded lines are removed
(``compact``: rewritten beside the file and renamed over it), so a finished output holds
exactly one line per id; a crash before that leaves both, read by the rule above.

The state file beside the output (``<output>.carpool.json``) records the input file, the
command and the run fingerprint (``carpool.jobs.fingerprint``): a resume of another input
warns, one that would answer another way is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path

import numpy as np

from carpool.journal.writer import Appender, ResultWriter
from carpool.redact import redact_argv

_DECODER = json.JSONDecoder()
_HEAD = '{"custom_id":'
_OK = ',"error":null,'
_ERR = ',"error":{'


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

    def __contains__(self, custom_id: str) -> bool:
        h = id_hash(custom_id)
        return h in self._new or self._old.has_hash(h)

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
    return scan_line(line)[0]


def scan_line(line: bytes) -> tuple[str | None, bool]:
    """(custom_id, is it an error line) of one output line.

    Cheap for the lines carpool writes (``{"custom_id": ..., "error": null, ...``): only the
    id is decoded.  A line in another key order (an older carpool, another tool) is decoded
    whole."""
    text = line.decode("utf-8", "replace")
    if text.startswith(_HEAD):
        try:
            value, end = _DECODER.raw_decode(text, len(_HEAD))
        except ValueError:
            value, end = None, 0
        if isinstance(value, str):
            if text.startswith(_OK, end):
                return value, False
            if text.startswith(_ERR, end):
                return value, True
    try:  # a line written by something else: decode it all
        obj = json.loads(text)
    except ValueError:
        return None, False
    if not isinstance(obj, dict):
        return None, False
    cid = obj.get("custom_id")
    return (cid if isinstance(cid, str) else None), obj.get("error") is not None


def _error_line_rid(line: bytes) -> str:
    try:
        rid = json.loads(line).get("id")
    except (ValueError, AttributeError):
        return ""
    return rid if isinstance(rid, str) else ""


def recover_file(path: Path, cut: bool = True) -> tuple[list[int], int]:
    """Cut a trailing partial line (unless ``cut`` is False); return (hashes of the ids of its
    complete lines, bytes cut, or that would be cut)."""
    hashes: list[int] = []
    size = _scan_file(path, lambda h, is_error, line: hashes.append(h), cut)
    return hashes, size


def _scan_file(path: Path, visit, cut: bool = True) -> int:
    """``visit(hash, is_error, line)`` for each complete line; cut the partial last line."""
    if not path.exists():
        return 0
    good_end = 0
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break
            good_end += len(line)
            cid, is_error = scan_line(line)
            if cid is not None:
                visit(id_hash(cid), is_error, line)
    size = path.stat().st_size
    if cut and size > good_end:
        with open(path, "r+b") as f:
            f.truncate(good_end)
            os.fsync(f.fileno())
    return size - good_end


@dataclass
class Recovered:
    """What the journal files say, for one run.

    An id's final line is its success line if it has one, else its last error line
    (``--retry-errors`` only ever adds lines after an error line, and success lines are
    never redone).  ``done``: the ids not to send again; ``failed``: how many of them end
    in an error line; ``retry``: the ids whose error lines are answered again this run,
    with the ``id`` of that error line (the new line names it in ``supersedes``);
    ``superseded``: lines that are no longer final (a finished run removes them)."""

    done: DoneSet
    failed: int = 0
    retry: dict[int, str] = dataclass_field(default_factory=dict)
    superseded: int = 0


def recover(paths: list[Path], *, retry_errors: bool = False, cut: bool = True) -> tuple[Recovered, int]:
    """The ``Recovered`` state of the files and the bytes of half-written last lines cut."""
    ok: list[int] = []
    err: list[int] = []
    last_rid: dict[int, str] = {}
    cut_bytes = 0

    def visit(h: int, is_error: bool, line: bytes) -> None:
        if not is_error:
            ok.append(h)
            return
        err.append(h)
        if retry_errors:
            last_rid[h] = _error_line_rid(line)

    for p in paths:
        cut_bytes += _scan_file(p, visit, cut)
    ok_h = np.unique(np.array(ok, dtype=np.uint64))
    err_all = np.array(err, dtype=np.uint64)
    err_h = np.unique(err_all)
    failed_h = np.setdiff1d(err_h, ok_h, assume_unique=True)  # ids whose final line is an error line
    superseded = len(ok) - len(ok_h) + len(err_all) - len(failed_h)
    if not retry_errors:
        return Recovered(DoneSet(np.union1d(ok_h, err_h)), failed=len(failed_h), superseded=superseded), cut_bytes
    retry = {int(h): last_rid.get(int(h), "") for h in failed_h}
    return Recovered(DoneSet(ok_h), retry=retry, superseded=superseded), cut_bytes


def compact(paths: list[Path]) -> int:
    """Remove lines that are no longer final (see ``Recovered``), keeping each final line at
    the place of its id's first line in that file, so an ``--ordered`` output stays in input
    order.  Each file is rewritten beside itself, fsync'd and renamed over the old one: a
    crash leaves either file whole.  Returns the lines removed."""
    every: list[int] = []
    for p in paths:
        _scan_file(p, lambda h, is_error, line: every.append(h), cut=False)
    uniq, n = np.unique(np.array(every, dtype=np.uint64), return_counts=True)
    dup_h = {int(h) for h in uniq[n > 1]}
    if not dup_h:
        return 0
    dups: dict[int, list[tuple[int, int, int, bool]]] = {}  # hash -> (file, offset, length, is_error)
    for i, p in enumerate(paths):
        if not p.exists():
            continue
        offset = 0
        with open(p, "rb") as f:
            for line in f:
                if line.endswith(b"\n"):
                    cid, is_error = scan_line(line)
                    if cid is not None and id_hash(cid) in dup_h:
                        dups.setdefault(id_hash(cid), []).append((i, offset, len(line), is_error))
                offset += len(line)
    final: dict[int, tuple[int, int, int, bool]] = {}
    for h, occ in dups.items():
        successes = [o for o in occ if not o[3]]
        final[h] = successes[-1] if successes else occ[-1]
    removed = 0
    for i, p in enumerate(paths):
        if not any(o[0] == i for occ in dups.values() for o in occ):
            continue
        tmp = p.with_name(p.name + ".compact")
        placed: set[int] = set()
        with open(p, "rb") as src, open(p, "rb") as pick, open(tmp, "wb") as out:
            offset = 0
            for line in src:
                here = offset
                offset += len(line)
                cid = scan_line(line)[0] if line.endswith(b"\n") else None
                lh = id_hash(cid) if cid is not None else None
                if lh is None or lh not in dups:
                    out.write(line)
                    continue
                fi, foff, flen, _ = final[lh]
                if fi == i and lh not in placed:  # the final line, at the first place of its id
                    placed.add(lh)
                    if foff == here:
                        out.write(line)
                    else:
                        pick.seek(foff)
                        out.write(pick.read(flen))
                    continue
                removed += 1
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, p)
    return removed


class Journal:
    """The output (and errors) file(s) of one job as its journal, and the sidecar state file.

    ``fingerprint``: this run's (``carpool.jobs.fingerprint``); a resume whose fingerprint
    differs from the one recorded is refused unless ``force``.  ``retry_errors``: ids whose
    final line is an error line are not done (they run again).  ``read_only`` (``--dry-run``):
    the files are read, never cut, written or removed."""

    def __init__(self, output: str | os.PathLike, errors: str | os.PathLike | None = None, *,
                 fingerprint: dict | None = None, force: bool = False, retry_errors: bool = False,
                 read_only: bool = False):
        self.output = str(output)
        self.paths = [Path(output)] + ([Path(errors)] if errors else [])
        self.state_path = Path(str(output) + ".carpool.json")
        self.fingerprint = fingerprint
        self.force = force
        self.retry_errors = retry_errors
        self.read_only = read_only
        self.done = DoneSet()
        self.recovered = Recovered(DoneSet())
        self.cut_bytes = 0
        self.compacted = 0  # superseded lines the last finished run removed

    @property
    def failed_before(self) -> int:
        """Tasks done before this run whose final line is an error line."""
        return self.recovered.failed

    def supersedes(self, custom_id: str) -> str | None:
        """For a task answered again by ``--retry-errors``: the ``id`` of its old error line."""
        if not self.recovered.retry:
            return None
        return self.recovered.retry.get(id_hash(custom_id))

    def open(self, input_path: str | None, *, fresh: bool, argv: list[str] | None) -> tuple[DoneSet, list[str]]:
        """Start a run into this journal: ``fresh`` deletes it, else the done set is recovered
        (a half-written last line cut).  Returns the done set and what the user should know.
        The state file records the input, the command and the fingerprint; a resume of
        another input warns, one with another fingerprint raises ``FingerprintMismatch``."""
        notes: list[str] = []
        done = DoneSet()
        if not self.read_only:
            self.check_directories()
        if fresh and not self.read_only:
            self.reset()
        elif self.exists() and not fresh:
            warning = self.check_state(input_path)
            if warning:
                notes.append("warning: " + warning)
            notes += self.check_fingerprint()
            done = self.recover()
            if self.cut_bytes:
                verb = "would cut" if self.read_only else "cut"
                notes.append(f"{verb} a half-written last line ({self.cut_bytes} bytes) from the output")
            if self.recovered.retry:
                notes.append(f"--retry-errors: {len(self.recovered.retry):,} tasks whose line is an error "
                             "line run again")
        if not self.read_only:
            self.write_state(input_path, finished=False, argv=argv)
        return done, notes

    def check_directories(self) -> None:
        """Refuse an output whose directory does not exist, as ``cp`` or ``tee`` do (a typo in
        ``-o`` should not create a tree): an ``OSError`` naming the file and the fix, raised
        before anything is written (exit code 5).  Without it the first error named the
        internal state file (``<output>.carpool.tmp``)."""
        for path in self.paths:
            parent = path.parent
            if not parent.exists():
                flag = "-o" if path == self.paths[0] else "--errors"
                raise OSError(f"{flag} {str(path)!r}: its directory {str(parent)!r} does not exist; create it "
                              f"(mkdir -p {shlex.quote(str(parent))}) or choose another {flag}")

    def check_fingerprint(self) -> list[str]:
        """Raise ``FingerprintMismatch`` when the recorded fingerprint differs (warn with ``force``)."""
        from carpool.jobs.fingerprint import FingerprintMismatch, differences, mismatch_message

        old = self.read_state().get("fingerprint")
        if self.fingerprint is None or not isinstance(old, dict):
            return []
        diffs = differences(old, self.fingerprint)
        if not diffs:
            return []
        if not self.force:
            raise FingerprintMismatch(mismatch_message(self.output, diffs))
        return [f"warning: --force: resuming {self.output}, started with another setup ({'; '.join(diffs)})"]

    def open_writer(self, ordered: bool) -> ResultWriter:
        """The appending writer of this journal's files (results, and errors if separate)."""
        errors = Appender(self.paths[1]) if len(self.paths) > 1 else None
        return ResultWriter(Appender(self.paths[0]), errors, ordered=ordered)

    def exists(self) -> bool:
        return any(p.exists() and p.stat().st_size > 0 for p in self.paths)

    def recover(self) -> DoneSet:
        self.recovered, self.cut_bytes = recover(self.paths, retry_errors=self.retry_errors, cut=not self.read_only)
        self.done = self.recovered.done
        return self.done

    def reset(self) -> None:
        """``--fresh``: start over (the old output is removed)."""
        for p in [*self.paths, self.state_path]:
            if p.exists():
                p.unlink()

    def read_state(self) -> dict:
        try:
            doc = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return {}
        return doc if isinstance(doc, dict) else {}

    def check_state(self, input_path: str | None) -> str | None:
        """A warning when the previous run used another input file, else None."""
        if input_path is None:
            return None
        old = self.read_state()
        if not old:
            return None
        st = os.stat(input_path)
        if old.get("input") != os.path.abspath(input_path) or old.get("input_size") != st.st_size:
            return (f"the previous run into this output used {old.get('input')} ({old.get('input_size')} bytes); "
                    f"now {os.path.abspath(input_path)} ({st.st_size} bytes). Tasks are matched by custom_id; "
                    "use --fresh to start over")
        return None

    def write_state(self, input_path: str | None, finished: bool, argv: list[str] | None = None) -> None:
        """``input_path`` None: the tasks did not come from a file (records in memory).

        At the end of a finished run, lines that are no longer final (error lines answered
        again by ``--retry-errors``) are removed first (``compact``), so the output holds
        exactly one line per id."""
        if self.read_only:
            return
        if finished and (self.recovered.retry or self.recovered.superseded):
            self.compacted = compact(self.paths)
            self.recovered = Recovered(self.done)
        doc: dict[str, object] = {"input": os.path.abspath(input_path) if input_path is not None else None,
               "input_size": os.stat(input_path).st_size if input_path is not None else None,
               "finished": finished, "argv": redact_argv(argv if argv is not None else sys.argv)}
        if self.fingerprint is not None:
            doc["fingerprint"] = self.fingerprint
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.state_path)
