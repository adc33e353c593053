"""The output format, from ``-o``'s suffix: JSONL (the journal itself), Parquet or CSV.

``.jsonl`` is the OpenAI Batch output shape, one line per task, and is also the journal a
resume reads.  ``.parquet`` and ``.csv`` are tables (pandas, DuckDB, Spark, a spreadsheet):
the job journals into a JSONL beside it (``<output>.jsonl``, e.g. ``out.csv.jsonl``; kept,
it is what a resume and ``--retry-errors`` read) and writes the table from it once the run
finishes (an interrupted or stopped run leaves only the journal; the same command resumes
and then writes it).  Any other suffix is refused before anything starts, so ``-o out.txt``
never silently writes JSONL.

A table has one row per output line, in the journal's order (``--ordered`` for input
order), with flat columns: ``custom_id``, ``content`` (the first choice's message content
or completion text), ``finish_reason``, ``prompt_tokens``, ``completion_tokens``, ``error``
(the error code, empty on success), ``error_message``, ``parsed`` and ``parse_error`` (tasks
that asked for JSON: the parsed answer as JSON text, or why it did not validate), ``embedding``
(embedding tasks only), then one column per metadata key (named as the key;
``metadata_<key>`` when it collides with one of the fixed columns).  A metadata column whose
values are not all of one JSON type (numbers, text, booleans) holds JSON text; in CSV every
nested value (an embedding, a parsed object) is JSON text.  The full response bodies stay
in the JSONL journal.

Parquet is written in two passes over the journal (the columns and their types, then rows
in batches), CSV in two passes too (the columns, then the rows), so a big job is converted
in bounded memory, to a temporary file renamed over the target.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from carpool.errors import StartRefused
from carpool.extras import require
from carpool.jobs.options import FLAGS, Naming

JSONL = ".jsonl"
PARQUET = ".parquet"
CSV = ".csv"
SUFFIXES = (JSONL, PARQUET, CSV)
FIXED_COLUMNS = ("custom_id", "content", "finish_reason", "prompt_tokens", "completion_tokens", "error",
                 "error_message")
STRUCTURED = ("parsed", "parse_error")  # on lines of tasks that asked for JSON (carpool.jobs.output.structured)
_BATCH_ROWS = 4096


@dataclass(frozen=True)
class OutputTarget:
    """What ``-o`` names: the ``path`` the user asked for, its ``kind`` and the ``journal``
    the lines are appended to (``path`` itself for JSONL)."""

    path: Path
    kind: str  # jsonl | parquet | csv

    @property
    def journal(self) -> Path:
        return self.path if self.kind == "jsonl" else Path(f"{self.path}{JSONL}")

    @property
    def is_table(self) -> bool:
        """Written from the journal once the run finishes."""
        return self.kind != "jsonl"


def write_table(target: OutputTarget) -> int:
    """Write a table target from its journal; returns the number of rows."""
    if target.kind == "csv":
        return write_csv(target.journal, target.path)
    return write_parquet(target.journal, target.path)


def output_target(output: str | os.PathLike, naming: Naming = FLAGS) -> OutputTarget:
    """The target of ``-o``; ``StartRefused`` (exit 2) for a suffix carpool cannot write, naming
    the setting as the entry point spells it (``naming``: ``-o`` or ``output=``)."""
    path = Path(output)
    suffix = path.suffix.lower()
    if suffix == JSONL:
        return OutputTarget(path, "jsonl")
    if suffix == PARQUET:
        require("parquet", f"-o {str(output)!r} (a Parquet table)")  # refused before the run, not after it
        return OutputTarget(path, "parquet")
    if suffix == CSV:
        return OutputTarget(path, "csv")
    got = f"suffix {suffix!r}" if suffix else "no suffix"
    flag = "-o/--output" if naming is FLAGS else naming("output")
    raise StartRefused(f"{flag} {str(output)!r} has {got}: carpool writes {', '.join(SUFFIXES)} "
                       f"(JSONL lines in the OpenAI Batch output shape, a Parquet or a CSV table); "
                       f"e.g. {naming('output', str(path.with_suffix(JSONL)))}")


def _lines(journal: Path) -> Iterator[dict]:
    with open(journal, "rb") as f:
        for raw in f:
            if raw.strip():
                yield json.loads(raw)


def flat_row(line: dict) -> dict[str, Any]:
    """One output line as the fixed columns (metadata apart)."""
    err = line.get("error")
    resp = line.get("response")
    body = resp.get("body") if isinstance(resp, dict) else None
    if not isinstance(body, dict):
        body = {}
    choices = body.get("choices")
    first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    message = first.get("message")
    content = message.get("content") if isinstance(message, dict) else first.get("text")
    usage = body.get("usage")
    if not isinstance(usage, dict):
        usage = {}
    data = body.get("data")
    embedding = (data[0].get("embedding") if isinstance(data, list) and data and isinstance(data[0], dict)
                 else None)
    return {
        "custom_id": line.get("custom_id"),
        "content": content if isinstance(content, str) else None,
        "finish_reason": first.get("finish_reason"),
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "error": err.get("code") if isinstance(err, dict) else None,
        "error_message": err.get("message") if isinstance(err, dict) else None,
        "parsed": line.get("parsed"),
        "parse_error": line.get("parse_error"),
        "embedding": embedding if isinstance(embedding, list) else None,
    }


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    return "json"


@dataclass
class _Columns:
    """What a journal's lines hold beyond the fixed columns (pass 1 of a table)."""

    meta_kinds: dict[str, set[str]]
    has_embedding: bool
    has_structured: bool

    @property
    def names(self) -> dict[str, str]:
        """Metadata key -> column name (``metadata_<key>`` where it collides with a fixed column)."""
        taken = {*FIXED_COLUMNS, *STRUCTURED, "embedding"}
        return {k: f"metadata_{k}" if k in taken else k for k in self.meta_kinds}


def _survey(journal: Path) -> _Columns:
    cols = _Columns({}, False, False)
    for line in _lines(journal):
        meta = line.get("metadata")
        if isinstance(meta, dict):
            for k, v in meta.items():
                kinds = cols.meta_kinds.setdefault(k, set())
                if v is not None:
                    kinds.add(_kind(v))
        cols.has_structured = cols.has_structured or "parsed" in line or "parse_error" in line
        if not cols.has_embedding:
            cols.has_embedding = flat_row(line)["embedding"] is not None
    return cols


def _json_text(value: Any) -> Any:
    return None if value is None else json.dumps(value, ensure_ascii=False)


def _column_type(kinds: set[str]) -> Any:
    import pyarrow as pa

    if kinds <= {"int"}:
        return pa.int64()
    if kinds <= {"int", "float"}:
        return pa.float64()
    if kinds == {"bool"}:
        return pa.bool_()
    return pa.string()  # text, or JSON text for mixed / nested values


def write_parquet(journal: str | os.PathLike, target: str | os.PathLike) -> int:
    """Write ``target`` from the JSONL ``journal``; returns the number of rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    journal, target = Path(journal), Path(target)
    cols = _survey(journal)  # pass 1: which columns, of which type
    meta_kinds, has_embedding, has_structured = cols.meta_kinds, cols.has_embedding, cols.has_structured
    names = cols.names
    fields = [pa.field("custom_id", pa.string()), pa.field("content", pa.string()),
              pa.field("finish_reason", pa.string()), pa.field("prompt_tokens", pa.int64()),
              pa.field("completion_tokens", pa.int64()), pa.field("error", pa.string()),
              pa.field("error_message", pa.string())]
    if has_structured:
        fields += [pa.field("parsed", pa.string()), pa.field("parse_error", pa.string())]
    if has_embedding:
        fields.append(pa.field("embedding", pa.list_(pa.float32())))
    fields += [pa.field(names[k], _column_type(kinds)) for k, kinds in meta_kinds.items()]
    schema = pa.schema(fields)
    as_text = {k for k, kinds in meta_kinds.items() if _column_type(kinds) == pa.string() and kinds != {"str"}}

    def cell(key: str, value: Any) -> Any:
        if value is None or key not in as_text or isinstance(value, str):
            return value
        return json.dumps(value, ensure_ascii=False)

    tmp = target.with_name(target.name + ".tmp")
    rows = 0
    batch: list[dict] = []
    with pq.ParquetWriter(tmp, schema) as out:
        def flush() -> None:
            out.write_table(pa.Table.from_pylist(batch, schema=schema))
            batch.clear()

        for line in _lines(journal):  # pass 2: the rows
            row = flat_row(line)
            if not has_embedding:
                row.pop("embedding")
            if has_structured:
                row["parsed"] = _json_text(row["parsed"])
            else:
                row.pop("parsed")
                row.pop("parse_error")
            meta = line.get("metadata")
            if not isinstance(meta, dict):
                meta = {}
            for k in meta_kinds:
                row[names[k]] = cell(k, meta.get(k))
            batch.append(row)
            rows += 1
            if len(batch) >= _BATCH_ROWS:
                flush()
        if batch or rows == 0:
            flush()
    os.replace(tmp, target)
    return rows


def _csv_cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False)
    return value


def write_csv(journal: str | os.PathLike, target: str | os.PathLike) -> int:
    """Write the CSV ``target`` from the JSONL ``journal`` (UTF-8, a header row, RFC 4180
    quoting); returns the number of rows."""
    import csv

    journal, target = Path(journal), Path(target)
    cols = _survey(journal)
    header = list(FIXED_COLUMNS) + (list(STRUCTURED) if cols.has_structured else []) \
        + (["embedding"] if cols.has_embedding else []) + list(cols.names.values())
    tmp = target.with_name(target.name + ".tmp")
    rows = 0
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        out = csv.writer(f)
        out.writerow(header)
        for line in _lines(journal):
            row = flat_row(line)
            meta = line.get("metadata")
            if isinstance(meta, dict):
                row.update({cols.names[k]: v for k, v in meta.items() if k in cols.names})
            out.writerow([_csv_cell(row.get(c)) for c in header])
            rows += 1
    os.replace(tmp, target)
    return rows
