"""What the Python API takes besides a file, and how results go back as the same kind.

``run_batch`` accepts a path (read as ``carpool run`` reads it), a list of task dicts, a
pandas ``DataFrame`` or a Hugging Face ``datasets.Dataset``.  In-memory inputs become
records (rows through the ``template`` when one is given, else each row is a task record
with its empty cells left out) fed to the pipeline as a ``RecordSource``; the results come
back as the input's kind, in input order:

- a list -> a list of output lines (dicts in the OpenAI Batch output shape);
- a DataFrame / Dataset -> a copy with the result columns added (``RESULT_COLUMNS``).

pandas and datasets are imported only when such an object is given.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

from carpool.jobs.readers import RecordSource
from carpool.jobs.tasks import BadLine, Task, TaskDefaults, Template, build_from_row, build_record, repeat_id

# The columns a DataFrame or Dataset gains: the answer's text (or embedding), why it stopped,
# its tokens, and the error message of a task that failed (None when it succeeded).
RESULT_COLUMNS = ("content", "finish_reason", "prompt_tokens", "completion_tokens", "error")


def input_kind(data: object) -> str:
    """"path", "list", "pandas" or "dataset"; a TypeError names what is accepted."""
    if isinstance(data, str | os.PathLike):
        return "path"
    if isinstance(data, list | tuple):
        return "list"
    module = type(data).__module__.split(".")[0]
    if module == "pandas" and type(data).__name__ == "DataFrame":
        return "pandas"
    if module == "datasets" and type(data).__name__ == "Dataset":
        return "dataset"
    raise TypeError(f"run_batch input: a path, a list of dicts, a pandas DataFrame or a datasets.Dataset; "
                    f"got {type(data).__name__}")


def _is_empty(v: Any) -> bool:
    """A missing cell of a table: None, NaN, and pandas' NaT and NA (whose text, "NaT", must
    never be sent as if it were a value)."""
    if v is None:
        return True
    if isinstance(v, float):  # numpy's float64 too
        return math.isnan(v)
    name = type(v).__name__
    return name in ("NaTType", "NAType") or (name == "datetime64" and str(v) == "NaT")


def _integral_with_gaps(frame: Any) -> list[Any]:
    """The float columns of a DataFrame that hold NaN and otherwise only whole numbers: pandas
    made an integer column (``max_tokens``, a seed) float to hold its gaps, and its values
    are meant as the integers they were."""
    cols = []
    for c in frame.columns:
        col = frame[c]
        if col.dtype.kind == "f" and col.isna().any():
            values = col.dropna()
            if len(values) and bool(((values % 1) == 0).all()) and bool((values.abs() < 2**53).all()):
                cols.append(c)
    return cols


def rows_of(data: Any, kind: str, keep_empty: bool = False) -> list[dict]:
    """The rows as plain dicts (Python values).  A table's empty cells (NaN, NaT, None) are
    left out, or kept as None with ``keep_empty`` (a template then says which cell is
    empty); an integer column pandas made float to hold NaN gives its values back as ints."""
    if kind == "list":
        for i, row in enumerate(data):
            if not isinstance(row, dict):
                raise TypeError(f"run_batch input: item {i} is a {type(row).__name__}; every item must be "
                                "a dict (a task record)")
        return list(data)
    whole = set(_integral_with_gaps(data)) if kind == "pandas" else set()
    records = data.to_dict("records") if kind == "pandas" else data.to_list()
    rows = []
    for record in records:
        row = {}
        for k, v in record.items():
            if _is_empty(v):
                if keep_empty:
                    row[str(k)] = None
                continue
            row[str(k)] = int(v) if k in whole else v
        rows.append(row)
    return rows


class MemorySource(RecordSource):
    """Rows in memory as tasks: through ``template`` if given (as CSV rows are), else each row
    is a record.  It notes the custom_id of every row as the pipeline reads it, so the
    results can be put back in input order (``ids``)."""

    def __init__(self, rows: list[dict], template: Template | None, defaults: TaskDefaults | None = None):
        super().__init__(list(enumerate(rows, 1)), defaults)
        self.template = template
        self.ids: list[str | None] = [None] * len(rows)

    def __iter__(self) -> Iterator[Task | BadLine]:
        seen: set[str] = set()
        repeats: list[tuple[int, str]] = []
        for line_no, row in self.records:
            if self.template is not None:
                item = build_from_row(row, line_no, self.template, self.defaults)
            else:
                item = build_record(row, line_no, self.defaults)
            cid = item.custom_id
            if cid in seen:
                repeats.append((line_no, cid))
            else:
                self.ids[line_no - 1] = cid
                seen.add(cid)
            yield item

        def take(name: str) -> bool:
            if name in seen:
                return False
            seen.add(name)
            return True

        # Named as the pipeline names a repeat's error line, once every id is known.
        for line_no, cid in repeats:
            self.ids[line_no - 1] = repeat_id(cid, line_no, take)


def read_lines(path: str) -> dict[str, dict]:
    """The final line of every custom_id in a journal (a later line of an id supersedes it)."""
    out: dict[str, dict] = {}
    if not os.path.exists(path):
        return out
    with open(path, encoding="utf-8") as f:
        for text in f:
            if text.strip():
                line = json.loads(text)
                out[line["custom_id"]] = line
    return out


def in_order(ids: Sequence[str | None], lines: dict[str, dict]) -> list[dict | None]:
    """The output line of each input row (None for a row the job did not reach: stopped early)."""
    return [lines.get(cid) if cid is not None else None for cid in ids]


def flatten(line: dict | None) -> dict:
    """An output line as the ``RESULT_COLUMNS``."""
    row: dict[str, Any] = dict.fromkeys(RESULT_COLUMNS)
    if line is None:
        row["error"] = "not run (the job stopped before this task)"
        return row
    err = line.get("error")
    if err:
        row["error"] = err.get("message") or err.get("code") or "error"
        return row
    body = ((line.get("response") or {}).get("body")) or {}
    usage = body.get("usage") or {}
    row["prompt_tokens"] = usage.get("prompt_tokens")
    row["completion_tokens"] = usage.get("completion_tokens")
    if body.get("object") == "list":  # embeddings
        data = body.get("data") or []
        row["content"] = data[0].get("embedding") if len(data) == 1 else [d.get("embedding") for d in data]
        return row
    choices = body.get("choices") or [{}]
    first = choices[0]
    row["content"] = (first.get("message") or {}).get("content") if "message" in first else first.get("text")
    row["finish_reason"] = first.get("finish_reason")
    return row


def check_columns(names: Sequence[str]) -> None:
    clash = [c for c in RESULT_COLUMNS if c in names]
    if clash:
        raise ValueError(f"run_batch input: column {clash[0]!r} is also a result column ({', '.join(RESULT_COLUMNS)}); "
                         "rename it before the run")


def results_as(data: Any, kind: str, lines: list[dict | None]) -> Any:
    """The results as the input's kind (see the module docstring)."""
    if kind in ("list", "path"):
        return lines
    flat = [flatten(line) for line in lines]
    columns = {c: [row[c] for row in flat] for c in RESULT_COLUMNS}
    if kind == "pandas":
        out = data.copy()
        for c, values in columns.items():
            out[c] = values
        return out
    for c, values in columns.items():
        data = data.add_column(c, values)
    return data
