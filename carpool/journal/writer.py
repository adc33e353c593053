"""Output lines (OpenAI Batch output shape) and the appending writers.

Each line: ``{"custom_id", "error": {"code", "message", "line", "field"?} | null, "id",
"response": {"status_code", "request_id", "body"} | null}`` and, when there are any, the
task's ``metadata`` and ``supersedes`` (the ``id`` of the error line a ``--retry-errors``
run answered again); a success line of a task that asked for JSON (``response_format``)
also has ``parsed`` or ``parse_error`` (``carpool.jobs.output.structured``).  ``custom_id`` and
``error`` come first so the journal can tell a success line from an error line without
decoding the response (key order does not matter to JSON readers).

Lines are flushed to the OS every ``flush_lines`` lines or ``flush_s`` seconds (a
killed process loses at most those, and they are simply redone on resume) and fsync'd
at most every ``fsync_s`` seconds (batched: one fsync per many lines).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


# Characters that Python's str.splitlines() (and JavaScript's line terminators, for the last two)
# end a line at, which JSON leaves unescaped with ensure_ascii=False: a custom_id or an answer
# holding one came back as two broken lines to a reader that splits the decoded file that way.
_LINE_BREAKS = ("\x85", "\u2028", "\u2029")


def _encode_line(doc: dict) -> bytes:
    text = _dumps(doc)
    for ch in _LINE_BREAKS:
        if ch in text:  # rare: a scan each, where translate() would rebuild every line
            text = text.replace(ch, f"\\u{ord(ch):04x}")  # only inside strings: the same value
    # A lone surrogate (a server that cut a multi-byte character, a "\ud800" escape in its
    # JSON) has no UTF-8 form: written back as the same JSON escape, the line stays valid
    # JSON and says exactly what was received; a strict encode would raise and lose the line.
    return (text + "\n").encode("utf-8", "backslashreplace")


def _rid() -> str:
    return "batch_req_" + os.urandom(12).hex()


def success_line(custom_id: str, status: int, request_id: str, body: dict | None,
                 semantic: dict | None = None, structured: dict | None = None) -> bytes:
    """``semantic``: for an answer the semantic cache served, {"similarity", "matched_id"};
    ``structured``: for a task that asked for JSON, {"parsed"} or {"parse_error"}
    (``carpool.jobs.output.structured.check_answer``)."""
    doc = {"custom_id": custom_id, "error": None, "id": _rid(),
           "response": {"status_code": status, "request_id": request_id, "body": body}}
    if semantic is not None:
        doc["semantic"] = semantic
    if structured:
        doc.update(structured)
    return _encode_line(doc)


def error_line(custom_id: str, code: str, message: str, line_no: int | None = None, field: str | None = None,
               status: int | None = None, body: dict | None = None, attempts: int | None = None) -> bytes:
    err: dict = {"code": code, "message": message}
    if line_no is not None:
        err["line"] = line_no
    if field:
        err["field"] = field
    if attempts is not None:
        err["attempts"] = attempts
    response = None
    if status:
        response = {"status_code": status, "request_id": "", "body": body}
    doc = {"custom_id": custom_id, "error": err, "id": _rid(), "response": response}
    return _encode_line(doc)


def line_tail(metadata: dict | None = None, supersedes: str | None = None) -> bytes:
    """The fields a task's line ends with (``metadata``, ``supersedes``), encoded to go before
    its closing brace; empty when it has neither."""
    doc: dict = {}
    if metadata:
        doc["metadata"] = metadata
    if supersedes:
        doc["supersedes"] = supersedes
    if not doc:
        return b""
    return b"," + _encode_line(doc)[1:-2]


def with_tail(line: bytes, tail: bytes) -> bytes:
    """``line`` (one encoded line, ending in ``}\n``) with ``tail`` added before its brace."""
    return line[:-2] + tail + b"}\n" if tail else line


class Appender:
    """An append-only file with batched flush and fsync."""

    def __init__(self, path: str | os.PathLike, flush_lines: int = 256, flush_s: float = 0.2, fsync_s: float = 1.0):
        self.path = Path(path)
        if self.path.parent and not self.path.parent.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "ab", buffering=1 << 20)  # noqa: SIM115  (open for the whole job)
        self.flush_lines, self.flush_s, self.fsync_s = flush_lines, flush_s, fsync_s
        self._pending = 0
        self._last_flush = self._last_fsync = time.monotonic()
        self.lines = 0

    def write(self, line: bytes) -> None:
        self._f.write(line)
        self.lines += 1
        self._pending += 1
        if self._pending >= self.flush_lines:
            self.flush()

    def flush(self, fsync: bool = False) -> None:
        now = time.monotonic()
        self._f.flush()
        self._pending = 0
        self._last_flush = now
        if fsync or now - self._last_fsync >= self.fsync_s:
            os.fsync(self._f.fileno())
            self._last_fsync = now

    def tick(self) -> None:
        """Called periodically: flush what waited longer than ``flush_s``."""
        if self._pending and time.monotonic() - self._last_flush >= self.flush_s:
            self.flush()

    def close(self) -> None:
        if not self._f.closed:
            try:
                self.flush(fsync=True)
            finally:
                with contextlib.suppress(OSError):  # the flush above failed already (disk full): that counts
                    self._f.close()


class ResultWriter:
    """Routes lines to the output (and the errors file if any), in input order when ``ordered``.

    ``emit(seq, line, is_error, done)`` takes the line of the ``seq``-th output of this run;
    ``done()`` is called once the line is in the file (the runner frees the task's slot
    there, which bounds the reorder buffer in ordered mode).
    """

    def __init__(self, output: Appender, errors: Appender | None = None, ordered: bool = False):
        self.output, self.errors, self.ordered = output, errors, ordered
        # seq -> its line, or None for a task that ended without one (``skip``)
        self._held: dict[int, tuple[bytes, bool, Callable[[], None] | None] | None] = {}
        self._next = 0
        # The first failed write (disk full, I/O error) and its file; the runner polls it and
        # stops the job.  Lines after it are dropped (their tasks are redone on resume), but
        # ``done`` is still called so no slot stays taken and nothing waits forever.
        self.error: OSError | None = None
        self.error_path: str | None = None
        self.dropped = 0

    def emit(self, seq: int, line: bytes, is_error: bool = False, done: Callable[[], None] | None = None) -> None:
        if not self.ordered:
            self._write(line, is_error, done)
            return
        self._held[seq] = (line, is_error, done)
        self._release_in_order()

    def skip(self, seq: int, done: Callable[[], None]) -> None:
        """The ``seq``-th task of this run ends without a line (stopped or cancelled before it
        ran; a resume runs it): in order, the lines after it are not held back for it."""
        done()
        if self.ordered:
            self._held[seq] = None
            self._release_in_order()

    def _release_in_order(self) -> None:
        while self._next in self._held:
            held = self._held.pop(self._next)
            if held is not None:
                self._write(*held)
            self._next += 1

    def _write(self, line: bytes, is_error: bool, done: Callable[[], None] | None) -> None:
        target = self.errors if is_error and self.errors is not None else self.output
        if self.error is None:
            try:
                target.write(line)
            except OSError as e:
                self._failed(target, e)
        if self.error is not None:
            self.dropped += 1
        if done is not None:
            done()

    def _failed(self, target: Appender, e: OSError) -> None:
        if self.error is None:
            self.error, self.error_path = e, str(target.path)

    @property
    def held(self) -> int:
        return sum(1 for h in self._held.values() if h is not None)

    def _each_file(self, op: Callable[[Appender], None]) -> None:
        """``op`` on the output and the errors file; a failure is recorded, never raised."""
        for f in [self.output] + ([self.errors] if self.errors is not None else []):
            try:
                op(f)
            except OSError as e:
                self._failed(f, e)

    def tick(self) -> None:
        self._each_file(Appender.tick)

    def close(self) -> None:
        self._each_file(Appender.close)
