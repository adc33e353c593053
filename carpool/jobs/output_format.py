"""The output format, from ``-o``'s suffix: JSONL (the journal itself) or Parquet.

``.jsonl`` is the OpenAI Batch output shape, one line per task, and is also the journal a
resume reads.  ``.parquet`` is for tables (pandas, DuckDB, Spark): the job journals into a
JSONL beside it (``<output>.jsonl``, e.g. ``out.parquet.jsonl``; kept, it is what a resume
and ``--retry-errors`` read) and writes the Parquet file from it once the run finishes
(an interrupted or stopped run leaves only the journal; the same command resumes and then
writes it).  Any other suffix is refused before anything starts, so ``-o out.csv`` never
silently writes JSONL.

The Parquet file has one row per output line, in the journal's order (``--ordered`` for
input order), with flat columns: ``custom_id``, ``content`` (the first choice's message
content or completion text), ``finish_reason``, ``prompt_tokens``, ``completion_tokens``,
``error`` (the error code, null on success), ``error_message``, ``embedding`` (embedding
tasks only), then one column per metadata key (named as the key; ``metadata_<key>`` when
it collides with one of the fixed columns).  A metadata column whose values are not all
of one JSON type (numbers, text, booleans) holds JSON text.  The full response bodies stay
in the JSONL journal.

It is written in two passes over the journal (the columns and their types, then rows in
batches), so a big job is converted in bounded memory, to a temporary file renamed over
the target.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from carpool.extras import require
from carpool.jobs.exit_codes import StartRefused

JSONL = ".jsonl"
PARQUET = ".parquet"
SUFFIXES = (JSONL, PARQUET)
FIXED_COLUMNS = ("custom_id", "content", "finish_reason", "prompt_tokens", "completion_tokens", "error",
                 "error_message")
_BATCH_ROWS = 4096


@dataclass(frozen=True)
class OutputTarget:
    """What ``-o`` names: the ``path`` the user asked for, its ``kind`` and the ``journal``
    the lines are appended to (``path`` itself for JSONL)."""

    path: Path
    kind: str  # jsonl | parquet

    @property
    def journal(self) -> Path:
        return self.path if self.kind == "jsonl" else Path(f"{self.path}{JSONL}")


def output_target(output: str | os.PathLike) -> OutputTarget:
    """The target of ``-o``; ``StartRefused`` (exit 2) for a suffix carpool cannot write."""
    path = Path(output)
    suffix = path.suffix.lower()
    if suffix == JSONL:
        return OutputTarget(path, "jsonl")
    if suffix == PARQUET:
        require("parquet", f"-o {str(output)!r} (a Parquet table)")  # refused before the run, not after it
        return OutputTarget(path, "parquet")
    got = f"suffix {suffix!r}" if suffix else "no suffix"
    raise StartRefused(f"-o/--output {str(output)!r} has {got}: carpool writes {' or '.join(SUFFIXES)} "
                       f"(JSONL lines in the OpenAI Batch output shape, or a Parquet table); "
                       f"e.g. -o {path.with_suffix(JSONL).name}")


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
    meta_kinds: dict[str, set[str]] = {}
    has_embedding = False
    for line in _lines(journal):  # pass 1: which columns, of which type
        meta = line.get("metadata")
        if isinstance(meta, dict):
            for k, v in meta.items():
                kinds = meta_kinds.setdefault(k, set())
                if v is not None:
                    kinds.add(_kind(v))
        if not has_embedding:
            has_embedding = flat_row(line)["embedding"] is not None
    names = {k: f"metadata_{k}" if k in FIXED_COLUMNS or k == "embedding" else k for k in meta_kinds}
    fields = [pa.field("custom_id", pa.string()), pa.field("content", pa.string()),
              pa.field("finish_reason", pa.string()), pa.field("prompt_tokens", pa.int64()),
              pa.field("completion_tokens", pa.int64()), pa.field("error", pa.string()),
              pa.field("error_message", pa.string())]
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
