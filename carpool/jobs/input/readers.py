"""Streamed readers: JSONL (plain or OpenAI Batch), CSV and Parquet.

Every reader yields ``Task | BadLine`` one at a time, so a file of any size is read in
bounded memory.  Line numbers are 1-based and count the file's lines (for CSV the line
where the record ends, the header being line 1; for Parquet the row number), so an error
can be found with ``sed -n Np``.

CSV/Parquet rows keep what is not part of the request: with ``--template`` every column
the template does not use is the task's metadata; without one (the columns are the
request: ``prompt``, ``messages``, ``max_tokens``...) a ``metadata`` column (an object,
or JSON text in a CSV) is.  Either way it lands in the output line, never in the request.

JSONL lines end in LF, CRLF or, in old Mac files, a lone CR (``file_lines`` tells them
apart); one splitter with one length limit serves this reader and the distributed shards.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import stat
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO, Protocol

from carpool.errors import StartRefused
from carpool.extras import require
from carpool.jobs.input.tasks import (
    BadLine,
    Task,
    TaskDefaults,
    Template,
    build_from_row,
    build_record,
    build_task,
    jsonable,
    parse_json_line,
)

FORMATS = ("jsonl", "batch", "csv", "parquet")

# A JSONL line longer than this is an error line, read past in pieces, never held whole:
# /dev/zero or a file without newlines would otherwise grow the process without bound.
# 32 MiB is the body limit of carpool serve (and far past any context window).
MAX_LINE_BYTES = 32 << 20


class TooLong(int):
    """Stands for a line that was longer than ``MAX_LINE_BYTES``: its length in bytes."""


class TaskSource(Protocol):
    """Where a job's tasks come from: ``Reader`` (a file), ``ShardReader`` (one shard of it),
    and any other iterable of tasks (a list of dicts, a DataFrame) that can say its size."""

    def __iter__(self) -> Iterator[Task | BadLine]: ...

    def count(self) -> int | None:
        """How many records, for the progress bar (None: unknown); called off the event loop."""
        ...


def detect_format(path: str | os.PathLike) -> str:
    suffix = Path(path).suffix.lower()
    if suffix in (".csv", ".tsv"):
        return "csv"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    return "jsonl"  # .jsonl, .json, .ndjson; Batch-format lines are recognised line by line


def numbered_lines(f: BinaryIO | CRLines, max_bytes: int = MAX_LINE_BYTES, *, first_line: int = 1,
                   limit: int | None = None) -> Iterator[tuple[int, bytes | TooLong]]:
    """(line number, raw line) from ``first_line``; a line past ``max_bytes`` is read past in
    pieces of that size and comes as ``TooLong(its length)``.  ``limit``: read at most that
    many bytes from where ``f`` stands (one shard of a file, ``carpool.distributed.shards``)."""
    left = limit

    def read(n: int) -> bytes:
        nonlocal left
        if left is None:
            return f.readline(n)
        if left <= 0:
            return b""
        raw = f.readline(min(n, left))
        left -= len(raw)
        return raw

    line_no = first_line - 1
    while raw := read(max_bytes + 1):
        line_no += 1
        if raw.endswith(b"\n") or len(raw) <= max_bytes:  # the newline may be the (max + 1)th byte
            yield line_no, raw
            continue
        n = len(raw)
        while not raw.endswith(b"\n") and (raw := read(max_bytes)):
            n += len(raw)
        yield line_no, TooLong(n)


class CRLines:
    """``readline`` over a binary file whose lines end in a lone CR (classic Mac OS), each line
    handed out ending in LF, so ``numbered_lines`` and the line-length limit work unchanged."""

    def __init__(self, f: BinaryIO, chunk: int = 1 << 16):
        self.f = f
        self.chunk = chunk
        self.buf = bytearray()
        self.pos = 0  # start of what is not handed out yet: no O(n) delete per line

    def readline(self, limit: int) -> bytes:
        while True:
            end = min(self.pos + limit, len(self.buf))
            cr = self.buf.find(b"\r", self.pos, end)
            if cr >= 0:
                line = bytes(self.buf[self.pos:cr]) + b"\n"
                self.pos = cr + 1
                return line
            if end - self.pos >= limit:
                line = bytes(self.buf[self.pos:end])
                self.pos = end
                return line
            more = self.f.read(self.chunk)
            if not more:
                line = bytes(self.buf[self.pos:])
                self.buf, self.pos = bytearray(), 0
                return line
            del self.buf[:self.pos]
            self.pos = 0
            self.buf += more


def cr_only(f: BinaryIO, sniff: int = 1 << 20) -> bool:
    """True when the file's first ``sniff`` bytes hold a CR and no LF: old Mac line endings,
    which ``readline`` would take for one huge line.  CRLF files are LF files here (the CR
    is whitespace to the JSON decoder).  Leaves ``f`` at its start."""
    f.seek(0)
    head = f.read(sniff)
    f.seek(0)
    return b"\n" not in head and b"\r" in head


def file_lines(path: str | os.PathLike, *, start: int = 0, length: int | None = None,
               first_line: int = 1) -> Iterator[tuple[int, bytes | TooLong]]:
    """The numbered lines of a file (LF, CRLF or CR-only), or of ``length`` bytes of it from
    ``start``: the one line splitter, with the one length limit, for ``Reader`` and the shards."""
    with open(path, "rb") as f:
        src: BinaryIO | CRLines = f
        if cr_only(f):
            src = CRLines(f)
        f.seek(start)
        yield from numbered_lines(src, first_line=first_line, limit=length)


def parse_jsonl_lines(lines: Iterable[tuple[int, bytes | TooLong]],
                      defaults: TaskDefaults) -> Iterator[Task | BadLine]:
    """Tasks from numbered raw JSONL lines; used for a whole file here and for one byte-range
    shard by ``carpool.distributed.worker``. Undecodable bytes make a ``BadLine``, blank lines nothing."""
    for line_no, raw in lines:
        if isinstance(raw, TooLong):
            yield BadLine(line_no, f"line-{line_no}", "",
                          f"line is {int(raw):,} bytes long, past the limit of {MAX_LINE_BYTES >> 20} MiB "
                          "a task line may have (is this a JSONL file?)")
            continue
        try:
            # utf-8-sig on the file's first line: a UTF-8 byte order mark (Windows editors, Excel,
            # PowerShell's Out-File write one) is not part of the JSON, and json.loads refuses it.
            text = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
        except UnicodeDecodeError as e:
            yield BadLine(line_no, f"line-{line_no}", "", f"not UTF-8 text ({e.reason} at byte {e.start})")
            continue
        item = parse_json_line(text, line_no, defaults)
        if item is not None:
            yield item


def refuse_special_file(path: Path) -> None:
    """An input must be a regular file: a FIFO without a writer blocks ``open()`` for ever (no
    signal gets a thread out of it), ``/dev/zero`` never ends, and a resume reads the input
    again, which a pipe cannot give.  Raises ``ValueError`` (exit code 2) naming what it is."""
    mode = path.stat().st_mode  # follows symlinks: a link to a regular file is fine
    if stat.S_ISREG(mode):
        return
    what = ("a directory" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode)
            else "a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
    raise StartRefused(f"input {str(path)!r} is {what}: carpool run reads a regular file (it reads it again "
                     "to resume); write the tasks to a file first, e.g. `producer > tasks.jsonl`")


# The first bytes of the compressed files people keep tasks in, and how to get the text back.
_COMPRESSED = ((b"\x1f\x8b", "gzip", "gunzip -k"), (b"\x28\xb5\x2f\xfd", "zstd", "zstd -d"),
               (b"BZh", "bzip2", "bunzip2 -k"), (b"\xfd7zXZ\x00", "xz", "unxz -k"), (b"PK\x03\x04", "zip", "unzip"))


def refuse_compressed(path: Path) -> None:
    """A compressed JSONL or CSV would be read as text and every line would fail as not UTF-8
    after the job started; refused at the start instead (exit 2), with the command that
    decompresses it.  Not read in place: a resume and the shards seek by byte offset."""
    with open(path, "rb") as f:
        head = f.read(6)
    for magic, kind, command in _COMPRESSED:
        if head.startswith(magic):
            raise StartRefused(f"input {str(path)!r} is {kind}-compressed: carpool run reads the plain file (it "
                               f"reads it again by byte offset to resume); decompress it first, e.g. "
                               f"`{command} {shlex.quote(str(path))}`, and run on the file it writes")


class RecordSource:
    """Tasks from records already in memory: (line number, task record) pairs, validated
    as the lines of a file are (``carpool.distributed.ray_data`` feeds a Ray batch so)."""

    def __init__(self, records: Sequence[tuple[int, dict]], defaults: TaskDefaults | None = None):
        self.records = records
        self.defaults = defaults or TaskDefaults()

    def __iter__(self) -> Iterator[Task | BadLine]:
        for line_no, rec in self.records:
            yield build_record(rec, line_no, self.defaults)

    def count(self) -> int | None:
        return len(self.records)


def _json_cell(text: str) -> object:
    """A CSV ``metadata`` cell: the JSON object it holds (anything else stays text, and the
    task's check names the field)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


# A byte that was not UTF-8, as surrogateescape keeps it (U+DC80-U+DCFF).  A regex scans in C:
# a Python loop over every character cost ~12 us a 500-character row, 5x the search.
_UNDECODABLE = re.compile("[\udc80-\udcff]")


class Reader:
    def __init__(self, path: str | os.PathLike, fmt: str | None = None, template: Template | None = None,
                 defaults: TaskDefaults | None = None):
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"input file {str(self.path)!r} does not exist")
        refuse_special_file(self.path)
        self.fmt = fmt or detect_format(path)
        if self.fmt not in FORMATS:
            raise StartRefused(f"unknown input format {self.fmt!r}; one of {', '.join(FORMATS)}")
        if self.fmt == "parquet":
            require("parquet", f"reading the Parquet file {str(self.path)!r}")
        else:
            refuse_compressed(self.path)
        self.template = template
        self.defaults = defaults or TaskDefaults()

    def __iter__(self) -> Iterator[Task | BadLine]:
        if self.fmt in ("jsonl", "batch"):
            return self._jsonl()
        if self.fmt == "csv":
            return self._rows(self._csv_rows())
        return self._rows(self._parquet_rows())

    def count(self) -> int | None:
        """How many records (for the progress bar); a fast byte scan, run it off the event loop."""
        if self.fmt == "parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(self.path).metadata.num_rows
        n, last = 0, b"\n"
        with open(self.path, "rb") as f:
            end = b"\r" if cr_only(f) else b"\n"
            while chunk := f.read(1 << 22):
                n += chunk.count(end)
                last = chunk[-1:]
        if last != end:
            n += 1
        return n - 1 if self.fmt == "csv" else n

    def _jsonl(self) -> Iterator[Task | BadLine]:
        yield from parse_jsonl_lines(file_lines(self.path), self.defaults)

    def _csv_rows(self) -> Iterator[tuple[int, dict]]:
        # Bytes that are not UTF-8 (a file saved as Latin-1 or cp1252) are kept as lone surrogates,
        # so that their row becomes an error line naming the column (``_rows``), as a JSONL line
        # would, and the job goes on; U+FFFD in their place sent prompts with letters missing.
        with open(self.path, newline="", encoding="utf-8-sig", errors="surrogateescape") as f:  # -sig: Excel's BOM
            dialect = "excel-tab" if self.path.suffix.lower() == ".tsv" else "excel"
            reader = csv.DictReader(f, dialect=dialect)
            for row in reader:
                yield reader.line_num, row

    def _parquet_rows(self) -> Iterator[tuple[int, dict]]:
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(self.path)
        n = 0
        for batch in pf.iter_batches(batch_size=2048):
            for row in batch.to_pylist():
                n += 1
                yield n, row

    def _rows(self, rows: Iterator[tuple[int, dict]]) -> Iterator[Task | BadLine]:
        for line_no, row in rows:
            bad = next(((k, m) for k, v in row.items() if isinstance(v, str) and (m := _UNDECODABLE.search(v))), None)
            if bad is not None:
                column, found = bad
                yield BadLine(line_no, f"line-{line_no}", str(column),
                              f"not UTF-8 text (byte 0x{ord(found.group()) - 0xDC00:02x}): the file is in another "
                              "encoding; save it as UTF-8 (Excel: CSV UTF-8)")
                continue
            if self.template is not None:
                yield build_from_row(row, line_no, self.template, self.defaults)
            elif any(k in row for k in ("messages", "prompt", "input")):
                rec = {k: v for k, v in row.items() if v is not None and v != ""}
                if isinstance(rec.get("metadata"), str):
                    rec["metadata"] = _json_cell(rec["metadata"])
                if "metadata" in rec:
                    rec["metadata"] = jsonable(rec["metadata"])
                yield build_task(rec, line_no, self.defaults)
            else:
                yield BadLine(line_no, f"line-{line_no}", "template",
                              "this file has no prompt/input column: pass --template, e.g. "
                              f"--template 'Classify: {{{next(iter(row), 'text')}}}'")
