"""Reading a journal back: which ids it holds, after a crash as after a clean end.

Every finished task is one appended line of the output (or errors) file, and a task is
"done" exactly when its line is complete in that file.  There is no second file that
could disagree with the output, so after a crash or Ctrl-C:

- a half-written last line (the process died mid-write) is cut off;
- the custom_ids of the complete lines are the done set; the reader skips them;
- nothing done is sent again and no line is ever written twice.

Lines start with ``{"custom_id": ..., "error": ...`` so recovery decodes only that string
and sees whether the line is an error line, not the whole response.

``--retry-errors`` appends a new line for a task whose line is an error line (it names the
old line in ``supersedes``); the final line of an id is its success line if it has one,
else its last error line.  At the end of a finished run the superseded lines are removed
(``compact``: rewritten beside the file and renamed over it), so a finished output holds
exactly one line per id; a crash before that leaves both, read by the rule above.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path

import numpy as np

from carpool.journal.done import DoneSet, id_hash

_DECODER = json.JSONDecoder()
_HEAD = '{"custom_id":'
_OK = ',"error":null,'
_ERR = ',"error":{'

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
