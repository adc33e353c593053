"""Split a line-oriented input file into byte ranges, and merge shard outputs back.

The driver never loads the input: one streaming pass counts newlines (``bytes.count``
on 1 MiB chunks, about disk speed) and cuts the file at line boundaries near ``k * size / n``.
Each shard knows the line number of its first line, so workers report errors and build
default custom_ids with the same line numbers a single-process run would use.

The plan is saved in the job's work directory; a resumed run reuses it (same shards,
same per-shard journals) as long as the input file did not change, whatever the number
of workers this time.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from carpool.errors import PlanMismatch, StartRefused
from carpool.jobs.input.readers import TooLong, file_lines

CHUNK = 1 << 20


@dataclass(frozen=True)
class Shard:
    index: int
    start: int  # byte offset of the first line
    end: int  # byte offset just past the last line
    first_line: int  # 1-based line number of the first line in the whole file
    lines: int  # number of lines (the last one may lack its newline)

    @property
    def name(self) -> str:
        return f"shard-{self.index:05d}"


def plan_shards(path: str | os.PathLike, n_shards: int) -> list[Shard]:
    """Cut ``path`` into at most ``n_shards`` ranges of whole lines, of similar byte size."""
    if n_shards < 1:
        raise StartRefused(f"the number of shards must be >= 1, got {n_shards}")
    size = os.path.getsize(path)
    targets = [size * k // n_shards for k in range(1, n_shards)]
    cuts: list[tuple[int, int]] = []  # (byte offset of a shard start, lines before it)
    lines_before = 0
    pos = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(CHUNK)
            if not chunk:
                break
            # Place every cut that falls in this chunk at the first newline at or after it.
            while targets and targets[0] < pos + len(chunk):
                if cuts and targets[0] <= cuts[-1][0]:
                    targets.pop(0)  # a line longer than a shard: fewer, larger shards
                    continue
                nl = chunk.find(b"\n", max(targets[0] - 1, pos) - pos)
                if nl < 0:
                    break  # the line runs into the next chunk
                targets.pop(0)
                offset = pos + nl + 1
                if offset < size:
                    cuts.append((offset, lines_before + chunk.count(b"\n", 0, nl + 1)))
            lines_before += chunk.count(b"\n")
            pos += len(chunk)
    last_line_open = size > 0 and _last_byte(path) != b"\n"
    total_lines = lines_before + (1 if last_line_open else 0)
    bounds = [(0, 0), *cuts, (size, total_lines)]
    ranges = [(s, ls, e, le) for (s, ls), (e, le) in itertools.pairwise(bounds) if e > s]
    return [
        Shard(index=i, start=s, end=e, first_line=ls + 1, lines=le - ls)
        for i, (s, ls, e, le) in enumerate(ranges)
    ]


def _last_byte(path: str | os.PathLike) -> bytes:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1)


def iter_shard_lines(path: str | os.PathLike, shard: Shard) -> Iterator[tuple[int, bytes | TooLong]]:
    """(line number, raw line without its newline) for every line of the shard; a line past
    the reader's length limit comes as ``TooLong`` (``carpool.jobs.input.readers.file_lines``, the
    one splitter: CR-only files and the limit as in a single-process run)."""
    for line_no, raw in file_lines(path, start=shard.start, length=shard.end - shard.start,
                                   first_line=shard.first_line):
        yield line_no, raw if isinstance(raw, TooLong) else raw.rstrip(b"\r\n")


def _fingerprint(path: str | os.PathLike) -> dict:
    st = os.stat(path)
    return {"input": str(Path(path).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def load_or_make_plan(path: str | os.PathLike, workdir: Path, n_shards: int) -> list[Shard]:
    """The saved plan of ``workdir`` if it is for this very input, else a new one (saved)."""
    plan_file = workdir / "plan.json"
    fp = _fingerprint(path)
    if plan_file.exists():
        saved = json.loads(plan_file.read_text())
        if {k: saved.get(k) for k in fp} == fp:
            return [Shard(**s) for s in saved["shards"]]
        if any(workdir.glob("shard-*")):
            raise PlanMismatch(
                f"{workdir} holds a partial run of another version of the input "
                f"({saved.get('input')}, {saved.get('size')} bytes); remove it to start over"
            )
    shards = plan_shards(path, n_shards)
    workdir.mkdir(parents=True, exist_ok=True)
    tmp = plan_file.with_suffix(".tmp")
    tmp.write_text(json.dumps({**fp, "shards": [asdict(s) for s in shards]}, indent=1))
    os.replace(tmp, plan_file)
    return shards


def merge_files(parts: list[Path], dest: Path) -> int:
    """Concatenate ``parts`` (in order) into ``dest`` atomically; returns the bytes written."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".merging")
    written = 0
    with open(tmp, "wb") as out:
        for part in parts:
            if not part.exists():
                continue
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out, CHUNK)
            written = out.tell()
            if written and _ends_without_newline(out, tmp):
                out.write(b"\n")
                written += 1
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, dest)
    return written


def _ends_without_newline(out, tmp: Path) -> bool:
    out.flush()
    with open(tmp, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"
