"""Prefix-aware order over a whole JSONL file, in bounded memory.

A server's prefix cache holds the shared start of a prompt (a long document, a long
system prompt) only for a while: tasks sharing it pay its prefill once when they reach
the server close together, and again for each task when they are spread over the file.
A window of the tasks in memory sees only the groups that happen to fall inside it, so
``PlannedSource`` looks at the whole file first: one pass keeps, per line, its byte
offset, its line number and a few 64-bit hashes of its prompt's start (the messages
before a chat's last one, then growing lengths), 72 bytes a line with the order, whatever the
prompt size, never a task.  Sorting those rows by the first appearance of each prefix
group (coarse to fine, then by line) gives the order; the tasks are then read again one at a time from their offsets.

The order changes nothing but when a task is sent: each line keeps its line number,
custom_id and metadata, so the journal, resume (done ids are skipped wherever they
are), dedup and the caches work as before.  A custom_id repeated later in the file is
sent after every first occurrence, so the later line is still the one refused.  A job
that needs its output in input order (``--ordered``) does not use it: the writer would
have to hold every line sent ahead of its turn.

Per job it decides whether to plan at all: a sample of the first records must hold
prompts long enough to share a prefix worth ordering (``MIN_SHARED_CHARS``), and the
pass must find groups sharing at least that much that the file does not already keep
together; otherwise the file is streamed as it is (a no-op beyond the sample).
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from carpool.client.affinity import h64, prompt_text
from carpool.jobs.input.readers import Reader, TooLong, cr_only, file_lines, numbered_lines, parse_jsonl_lines
from carpool.jobs.input.tasks import BadLine, Task

if TYPE_CHECKING:
    from carpool.jobs.options import RunOptions

# Prompt starts hashed per line, coarse to fine, in characters (about 4 to a token): tasks
# sharing fewer than the first level's characters are not worth moving (a short shared
# instruction costs little prefill), and a prompt shorter than a level is hashed whole there.
LEVELS = (512, 2048, 8192, 32768)
MIN_SHARED_CHARS = LEVELS[0]
SAMPLE_RECORDS = 512  # records looked at before deciding to read the whole file twice


def _body(obj: object) -> dict | None:
    if not isinstance(obj, dict):
        return None
    inner = obj.get("body")
    return inner if isinstance(inner, dict) else obj


def conversation_head(obj: object, min_chars: int) -> str | None:
    """A chat's messages before its last one (a system prompt, a shared document, a few-shot
    preamble): the natural shared prefix of a task family, whatever its length in characters.
    None when there is none, or it is shorter than ``min_chars``."""
    body = _body(obj)
    msgs = body.get("messages") if body is not None else None
    if not isinstance(msgs, list) or len(msgs) < 2:
        return None
    head = prompt_text({"messages": msgs[:-1]})
    return head if head is not None and len(head) >= min_chars else None


def _record_id(obj: object, line_no: int) -> str:
    cid = obj.get("custom_id") if isinstance(obj, dict) else None
    return cid if isinstance(cid, str) and cid else f"line-{line_no}"


@dataclass
class PlanInfo:
    """What the plan found, for the summary."""

    mode: str = "off"  # planned | file order (nothing to gain) | short prompts | off
    lines: int = 0
    groups: int = 0  # prefix groups (first level) with more than one task
    grouped_tasks: int = 0  # tasks in those groups
    moved: int = 0  # tasks sent at another position than their line's
    bytes_held: int = 0  # the plan's arrays, whatever the prompts' size

    def to_dict(self) -> dict:
        return {"mode": self.mode, "lines": self.lines, "groups": self.groups,
                "grouped_tasks": self.grouped_tasks, "moved": self.moved, "bytes_held": self.bytes_held}


class _Rows:
    """The pass's per-line rows in typed arrays (8 bytes a field, no Python object a line)."""

    def __init__(self) -> None:
        self.offset = array("q")
        self.line_no = array("q")
        self.id_hash = array("Q")
        self.head = array("Q")
        self.levels = [array("Q") for _ in LEVELS]

    def add(self, offset: int, line_no: int, cid: str, text: str | None, head: str | None) -> None:
        self.offset.append(offset)
        self.line_no.append(line_no)
        self.id_hash.append(h64(cid))
        self.head.append(h64(head) if head is not None else 0)
        row = len(self.offset) - 1
        for lv, arr in zip(LEVELS, self.levels, strict=True):
            # A line without a prompt is a group of its own: its row number cannot collide
            # with a 64-bit hash in practice, and it keeps the line in place.
            arr.append(h64(text[:lv]) if text is not None else row)

    def nbytes(self) -> int:
        return sum(a.itemsize * len(a) for a in (self.offset, self.line_no, self.id_hash, self.head, *self.levels))


def _first_seen(values: np.ndarray) -> np.ndarray:
    """For each row, the row where its value first appears (a group's rank by first appearance)."""
    _, first, inverse = np.unique(values, return_index=True, return_inverse=True)
    return first[inverse]


def plan_order(rows: _Rows, info: PlanInfo) -> np.ndarray | None:
    """The rows' send order, or None when it would be the file's own (nothing to gain)."""
    n = len(rows.offset)
    if n < 2:
        return None
    idx = np.arange(n)
    ids = np.frombuffer(rows.id_hash, dtype=np.uint64)
    repeat = _first_seen(ids) != idx  # a later line with an earlier line's custom_id
    ranks = [_first_seen(np.frombuffer(a, dtype=np.uint64)) for a in (rows.head, *rows.levels)]
    coarse = ranks[1]
    sizes = np.bincount(coarse, minlength=n)
    info.groups = int(np.count_nonzero(sizes > 1))
    info.grouped_tasks = int(sizes[sizes > 1].sum())
    # np.lexsort sorts by its last key first: repeats last, then coarse to fine, then the line.
    order = np.lexsort((idx, *reversed(ranks), repeat))
    moved = int(np.count_nonzero(order != idx))
    info.moved = moved
    return order if moved else None


class PlannedSource:
    """A JSONL ``Reader``'s tasks, grouped by shared prompt prefix over the whole file.

    ``prepare()`` (the pass; run it off the event loop) decides and builds the order;
    iterating before it prepares first.  ``force``: plan whatever the sample shows
    (``--prefix-order``).  ``held`` counts the task objects alive in this source (at
    most one: a task is parsed when it is handed out)."""

    def __init__(self, reader: Reader, force: bool = False):
        self.reader = reader
        self.force = force
        self.info = PlanInfo()
        self._order: np.ndarray | None = None
        self._rows: _Rows | None = None
        self._prepared = False
        self.held = 0
        self.max_held = 0

    @staticmethod
    def usable(reader: Reader) -> bool:
        """Only a JSONL file with LF/CRLF lines can be read again at a line's byte offset."""
        if reader.fmt not in ("jsonl", "batch"):
            return False
        with open(reader.path, "rb") as f:
            return not cr_only(f)

    def count(self) -> int | None:
        return self.reader.count()

    def prepare(self) -> None:
        if self._prepared:
            return
        self._prepared = True
        if not self.force and not self._sample_long():
            self.info.mode = "short prompts"
            return
        rows = self._pass()
        self.info.lines = len(rows.offset)
        self.info.bytes_held = rows.nbytes()
        order = plan_order(rows, self.info)
        if order is None:
            self.info.mode = "file order"
            return
        self._rows, self._order = rows, order
        self.info.mode = "planned"
        self.info.bytes_held += order.nbytes

    def _sample_long(self) -> bool:
        """Whether any of the first records has a prompt long enough to share a prefix that matters."""
        for i, (_, raw) in enumerate(file_lines(self.reader.path)):
            if i >= SAMPLE_RECORDS:
                return False
            text = self._text(raw)
            if text is not None and len(text) >= MIN_SHARED_CHARS:
                return True
        return False

    @staticmethod
    def _text(raw: bytes | TooLong) -> str | None:
        obj = PlannedSource._obj(raw)
        return prompt_text(obj) if obj is not None else None

    @staticmethod
    def _obj(raw: bytes | TooLong) -> Any:
        if isinstance(raw, TooLong) or not raw.strip():
            return None
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):
            return None

    def _pass(self) -> _Rows:
        rows = _Rows()
        offset = 0
        for line_no, raw in file_lines(self.reader.path):
            size = int(raw) if isinstance(raw, TooLong) else len(raw)
            if isinstance(raw, TooLong) or raw.strip():  # blank lines are no records
                obj = self._obj(raw)
                text = prompt_text(obj) if obj is not None else None
                rows.add(offset, line_no, _record_id(obj, line_no), text,
                         conversation_head(obj, 1 if self.force else MIN_SHARED_CHARS))
            offset += size
        return rows

    def __iter__(self) -> Iterator[Task | BadLine]:
        self.prepare()
        if self._order is None or self._rows is None:
            yield from self.reader
            return
        rows, defaults = self._rows, self.reader.defaults
        with open(self.reader.path, "rb") as f:
            for i in self._order:
                f.seek(rows.offset[int(i)])
                line = next(numbered_lines(f, first_line=rows.line_no[int(i)]))
                for item in parse_jsonl_lines([line], defaults):
                    self.held += 1
                    self.max_held = max(self.max_held, self.held)
                    yield item
                    self.held -= 1


class WindowOrder:
    """The bounded fallback for sources that cannot be planned (another format, ``--ordered``,
    a shard): tasks sharing a prefix are sorted together within windows of the tasks in
    memory.  In the default mode it starts only once a task with a long prompt was read, so
    a job of short prompts is sent exactly as read."""

    def __init__(self, opts: RunOptions, planned: bool):
        self.size = max(1, min(opts.prefix_window, opts.max_pending))
        auto = opts.prefix_order is None and not opts.echo
        self.on = not planned and opts.prefix_order is True
        self.auto = not planned and not self.on and auto

    def wants(self, task: Task) -> bool:
        """Whether this task goes through the window (switches the default mode on when its prompt is long)."""
        if self.auto and not self.on:
            text = prompt_text(task.request.body, MIN_SHARED_CHARS)
            self.on = text is not None and len(text) >= MIN_SHARED_CHARS
        return self.on
