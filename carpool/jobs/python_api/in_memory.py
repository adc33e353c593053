"""What the Python API takes besides a file, and how results go back as the same kind.

``run_batch`` accepts a path (read as ``carpool run`` reads it), a list of task dicts or
of prompt strings (each one user message, as LiteLLM's ``batch_completion`` and vLLM's
``LLM.chat`` take them), a pandas ``DataFrame`` or a Hugging Face ``datasets.Dataset``.
In-memory inputs become records (rows through the ``template`` when one is given, else
each row is a task record with its empty cells left out) fed to the pipeline as a
``RecordSource``; the results come back as the input's kind, in input order:

- a list (or a path) -> a list of ``Result``: the output line (a dict in the OpenAI Batch
  output shape, so ``r["response"]["body"]`` is all there) with the answer at hand as
  ``r.text`` / ``r["text"]``, ``r.parsed`` for a task that asked for JSON, ``r.ok`` and
  ``r.error_message``;
- a DataFrame / Dataset -> a copy with the result columns added (``RESULT_COLUMNS``, and
  ``parsed`` / ``parse_error`` when a task asked for JSON).

pandas and datasets are imported only when such an object is given.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

from carpool.errors import StartRefused
from carpool.jobs.input.readers import RecordSource
from carpool.jobs.input.tasks import BadLine, Task, TaskDefaults, Template, build_from_row, build_record, repeat_id

# The columns a DataFrame or Dataset gains: the answer's text (or embedding), why it stopped,
# its tokens, and the error message of a task that failed (None when it succeeded).
RESULT_COLUMNS = ("content", "finish_reason", "prompt_tokens", "completion_tokens", "error")
# Added when a task asked for JSON (``response_format``): the parsed object, or why it is not one.
STRUCTURED_COLUMNS = ("parsed", "parse_error")


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
    raise TypeError(f"run_batch input: a path, a list of dicts or strings, a pandas DataFrame or a "
                    f"datasets.Dataset; got {type(data).__name__}")


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
        rows = []
        for i, row in enumerate(data):
            if isinstance(row, str):  # a prompt: one user message
                row = {"messages": [{"role": "user", "content": row}]}
            elif not isinstance(row, dict):
                raise TypeError(f"run_batch input: item {i} is a {type(row).__name__}; every item must be "
                                "a dict (a task record) or a string (a prompt)")
            rows.append(row)
        return rows
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


class Result(dict):
    """One task's result: its output line (OpenAI Batch output shape) with the answer at hand.

    A dict, so ``r["custom_id"]``, ``r["error"]`` and ``r["response"]["body"]`` read as the
    JSONL line does; the key ``"text"`` and the attributes below save digging the answer
    out of the body.  ``parsed``: for a task with ``response_format``, the decoded object
    (an instance of the pydantic model when one was given), None when it did not validate
    (``parse_error`` says why)."""

    @property
    def custom_id(self) -> str | None:
        return self.get("custom_id")

    @property
    def text(self) -> str | None:
        """The first choice's message content (chat) or text (completion); None for an error."""
        return self.get("text")

    @property
    def parsed(self) -> Any:
        return self.get("parsed")

    @property
    def parse_error(self) -> str | None:
        return self.get("parse_error")

    @property
    def ok(self) -> bool:
        """Answered, and parsed and valid when the task asked for JSON."""
        return not self.get("error") and not self.get("parse_error")

    @property
    def error_message(self) -> str | None:
        """Why the task failed (its error line's message), or why its JSON did not validate."""
        err = self.get("error")
        if isinstance(err, dict):
            return err.get("message") or err.get("code") or "error"
        return self.get("parse_error")

    @property
    def finish_reason(self) -> str | None:
        return flatten(self)["finish_reason"]

    @property
    def usage(self) -> dict:
        body = (self.get("response") or {}).get("body") or {}
        usage = body.get("usage")
        return usage if isinstance(usage, dict) else {}

    @property
    def embedding(self) -> list[float] | None:
        """An embedding task's vector (the first, when its input was a list)."""
        body = (self.get("response") or {}).get("body") or {}
        data = body.get("data")
        return data[0].get("embedding") if isinstance(data, list) and data else None

    def __repr__(self) -> str:
        shown = {"custom_id": self.custom_id, "text": self.text}
        if "parsed" in self or "parse_error" in self:
            shown["parsed"] = self.parsed
        if not self.ok:
            shown["error"] = self.error_message
        return "Result(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"


def as_result(line: dict | None, parse: Any = None) -> Result:
    """``line`` as a ``Result`` (a row the job did not reach: an error of its own);
    ``parse``: a pydantic model class the parsed JSON is turned into."""
    if line is None:
        return Result(custom_id=None, error={"code": "not_run", "message": NOT_RUN}, response=None, text=None)
    out = Result(line)
    out["text"] = flatten(line)["content"] if not line.get("error") else None
    if parse is not None and out.get("parsed") is not None:
        try:
            out["parsed"] = parse.model_validate(out["parsed"])
        except ValueError as e:  # pydantic's ValidationError is a ValueError
            out["parsed"] = None
            out["parse_error"] = f"does not match {parse.__name__}: {e}"
    return out


NOT_RUN = "not run (the job stopped before this task)"


def flatten(line: dict | None) -> dict:
    """An output line as the ``RESULT_COLUMNS`` (and ``STRUCTURED_COLUMNS`` when it has them)."""
    row: dict[str, Any] = dict.fromkeys(RESULT_COLUMNS)
    if line is None:
        row["error"] = NOT_RUN
        return row
    for c in STRUCTURED_COLUMNS:
        if c in line:
            row[c] = line[c]
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


def check_columns(names: Sequence[str], structured: bool = False) -> None:
    """``structured``: the job asks for JSON, so ``parsed`` and ``parse_error`` are result columns too."""
    result = RESULT_COLUMNS + (STRUCTURED_COLUMNS if structured else ())
    clash = [c for c in result if c in names]
    if clash:
        raise StartRefused(f"run_batch input: column {clash[0]!r} is also a result column ({', '.join(result)}); "
                           "rename it before the run")


def results_as(data: Any, kind: str, lines: list[dict | None], parse: Any = None) -> Any:
    """The results as the input's kind (see the module docstring); ``parse``: a pydantic
    model class the parsed answers become."""
    if kind in ("list", "path"):
        return [as_result(line, parse) for line in lines]
    results = [as_result(line, parse) for line in lines]
    flat = [flatten(r) for r in results]
    names = RESULT_COLUMNS + (STRUCTURED_COLUMNS if any("parsed" in r or "parse_error" in r for r in results) else ())
    columns = {c: [r.get(c) for r in results] if c in STRUCTURED_COLUMNS else [row[c] for row in flat] for c in names}
    if kind == "pandas":
        out = data.copy()
        for c, values in columns.items():
            out[c] = values
        return out
    for c, values in columns.items():
        data = data.add_column(c, values)
    return data
