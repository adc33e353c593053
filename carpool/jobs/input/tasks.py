"""The task model and the per-line validation of input records.

A record becomes a ``Task`` (an OpenAI request body plus where it came from) or a
``BadLine`` that says which line, which field and why, so the job reports it and goes
on.  Two record shapes are accepted:

- plain: ``{"custom_id"?, "metadata"?, "messages" | "prompt" | "input", ...params}``;
  ``messages`` is chat, ``prompt`` a text completion, ``input`` an embedding; the other keys
  are request parameters (max_tokens, temperature, ...).
- OpenAI Batch: ``{"custom_id", "metadata"?, "method": "POST", "url": "/v1/chat/completions",
  "body": {...}}``.

A record without custom_id gets ``line-<n>`` (its 1-based line number).

``metadata`` (an object) beside the request is the user's own: it is copied into the
task's output line and never sent, so an endpoint that refuses unknown fields (OpenAI)
never sees it and two tasks that differ only by it share one cache entry.  OpenAI's own
``metadata`` body field (stored completions) is sent only from inside a Batch ``body``.
For rows of a CSV/Parquet file with ``--template``, every column the template does not
use (nor ``--id-column``) becomes the metadata (``Template.record``).
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal

from carpool.client.base import Request
from carpool.client.retry import is_idempotent
from carpool.openai.schema import check_body

_URL_KINDS = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/v1/embeddings": "embedding",
              "/chat/completions": "chat", "/completions": "completion", "/embeddings": "embedding"}
# Carpool keys allowed on a plain record that are not request parameters.
_META_KEYS = {"custom_id", "metadata"}


@dataclass(slots=True)
class Task:
    line_no: int
    request: Request
    metadata: dict | None = None  # kept in the output line, never sent

    @property
    def custom_id(self) -> str:
        return self.request.custom_id


@dataclass(slots=True)
class BadLine:
    line_no: int
    custom_id: str
    field: str
    reason: str
    metadata: dict | None = None  # kept in the output line, never sent

    @property
    def message(self) -> str:
        where = f"field '{self.field}': " if self.field else ""
        return f"line {self.line_no}: {where}{self.reason}"


def repeat_id(custom_id: str, line_no: int, take: Callable[[str], bool]) -> str:
    """The id a repeated custom_id's error line is written under: ``<id>#line-<n>``, or when
    that name is taken, ``<id>#line-<n>#2``, ``#3``..., the first one ``take`` grants.

    ``take(name)`` reserves a name and says whether it was free.  Called once every id of
    the input is known to ``take`` (and in input order), the name carpool makes up can never
    be one a user gave, and a resume over the same input makes up the same names."""
    base = f"{custom_id}#line-{line_no}"
    name, k = base, 1
    while not take(name):
        k += 1
        name = f"{base}#{k}"
    return name


def repeat_reason(custom_id: str) -> str:
    return (f"duplicate custom_id {custom_id!r}: it was used on an earlier line; "
            "custom_ids must be unique in a file")


@dataclass
class TaskDefaults:
    """Values applied to records that do not set them (from the command line)."""

    model: str | None = None
    max_tokens: int | None = None
    # --max-completion-tokens: written under that name (what OpenAI's reasoning models take)
    max_completion_tokens: int | None = None
    temperature: float | None = None
    idempotent: str = "auto"  # auto | on | off
    require_model: bool = False  # an HTTP endpoint needs a model name in every request
    extra: dict = field(default_factory=dict)


def _bad(line_no: int, cid: str | None, fld: str, reason: str) -> BadLine:
    return BadLine(line_no, cid or f"line-{line_no}", fld, reason)


def _estimate_tokens(body: dict, kind: str) -> int:
    """A first guess for the TPM budget, without a tokenizer: about 4 characters a token
    plus the output bound (16 when unset).  With a TPM budget for an OpenAI model the job
    replaces it with the real count (``carpool.jobs.cost.tokens.CountedSource``); the budget
    is corrected by each answer's usage either way."""
    if kind == "chat":
        chars = sum(len(m.get("content") or "") if isinstance(m.get("content"), str) else 200
                    for m in body["messages"])
    elif kind == "completion":
        chars = len(body["prompt"]) if isinstance(body["prompt"], str) else 0
    else:
        inp = body["input"]
        chars = len(inp) if isinstance(inp, str) else sum(len(x) for x in inp if isinstance(x, str))
    out = body.get("max_tokens") or body.get("max_completion_tokens") or (0 if kind == "embedding" else 16)
    return chars // 4 + 1 + int(out)


def build_task(obj: object, line_no: int, defaults: TaskDefaults) -> Task | BadLine:
    """Validate one parsed record; its ``metadata`` goes with the result, a bad line's too."""
    if not isinstance(obj, dict):
        return _bad(line_no, None, "", f"a task must be a JSON object, got {type(obj).__name__}")
    meta = obj.get("metadata")
    if meta is not None and not isinstance(meta, dict):
        cid = obj.get("custom_id")
        return _bad(line_no, cid if isinstance(cid, str) and cid else None, "metadata",
                    f"must be an object (it is copied into the output line), got {type(meta).__name__}; "
                    'wrap the value, e.g. {"metadata": {"tag": ...}}')
    item = _build_task(obj, line_no, defaults)
    item.metadata = meta or None
    return item


def _build_task(obj: dict, line_no: int, defaults: TaskDefaults) -> Task | BadLine:
    cid = obj.get("custom_id")
    if cid is not None and (not isinstance(cid, str) or not cid):
        return _bad(line_no, None, "custom_id", f"must be a non-empty string, got {cid!r}")
    if "body" in obj or "url" in obj:  # OpenAI Batch format
        url = obj.get("url")
        kind = _URL_KINDS.get(url) if isinstance(url, str) else None
        if kind is None:
            return _bad(line_no, cid, "url", f"must be one of /v1/chat/completions, /v1/completions, "
                                              f"/v1/embeddings; got {url!r}")
        method = obj.get("method", "POST")
        if method != "POST":
            return _bad(line_no, cid, "method", f"must be POST, got {method!r}")
        body = obj.get("body")
        if not isinstance(body, dict):
            return _bad(line_no, cid, "body", "must be an object (the request body)")
        body = dict(body)
        prefix = "body."
    else:
        body = {k: v for k, v in obj.items() if k not in _META_KEYS}
        kind = "chat" if "messages" in body else "completion" if "prompt" in body else \
            "embedding" if "input" in body else None
        if kind is None:
            return _bad(line_no, cid, "messages", "missing: a task needs 'messages' (chat), 'prompt' "
                                                  "(completion) or 'input' (embedding)")
        prefix = ""
    # The body as any OpenAI-compatible endpoint would check it (what carpool's own engine
    # does not implement is its backend's to refuse: EngineBackend.check).
    problem = check_body(kind, body)
    if problem is not None:
        return _bad(line_no, cid, prefix + problem.param, problem.reason)
    if kind == "completion" and not isinstance(body["prompt"], str):
        return _bad(line_no, cid, prefix + "prompt", "must be a string (one prompt per task)")
    if defaults.model and "model" not in body:
        body["model"] = defaults.model
    if defaults.require_model and not isinstance(body.get("model"), str):
        return _bad(line_no, cid, prefix + "model", "missing: the endpoint needs a model name; set it in the "
                                                    "task or pass --model NAME")
    if kind != "embedding":
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            if defaults.max_completion_tokens is not None:
                body["max_completion_tokens"] = defaults.max_completion_tokens
            elif defaults.max_tokens is not None:
                body["max_tokens"] = defaults.max_tokens
        if defaults.temperature is not None and "temperature" not in body:
            body["temperature"] = defaults.temperature
    for k, v in defaults.extra.items():
        body.setdefault(k, v)
    req = Request(cid or f"line-{line_no}", kind, body, is_idempotent(body, kind, defaults.idempotent),
                  _estimate_tokens(body, kind))
    return Task(line_no, req)


def parse_json_line(text: str, line_no: int, defaults: TaskDefaults) -> Task | BadLine | None:
    """One JSONL line; None for a blank line (skipped, not an error)."""
    if not text.strip():
        return None
    try:
        obj = json.loads(text)
    except ValueError as e:
        return _bad(line_no, None, "", f"not valid JSON ({e})")
    except RecursionError:  # json's decoder recurses per nesting level
        return _bad(line_no, None, "", "not valid JSON: nested too deeply")
    if _SURROGATE_ESCAPE.search(text) is not None:
        return build_record(obj, line_no, defaults)
    return build_task(obj, line_no, defaults)


def build_record(obj: object, line_no: int, defaults: TaskDefaults) -> Task | BadLine:
    """A record that did not come from JSON text (a row in memory): checked for text that
    cannot be sent or written (a lone surrogate), then validated as a line is."""
    bad = _lone_surrogate_field(obj)
    if bad is not None:
        cid = obj.get("custom_id") if isinstance(obj, dict) and bad != "custom_id" else None
        return _bad(line_no, cid if isinstance(cid, str) and cid else None, bad,
                    "contains a lone surrogate escape (\\ud800-\\udfff without its pair): not Unicode "
                    "text, it cannot be sent or written; fix the producer of this file")
    return build_task(obj, line_no, defaults)


# "\ud800".."\udfff" escapes: only these can decode to a lone surrogate (a cheap pre-check).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _encodable(value: object) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _lone_surrogate_field(obj: object) -> str | None:
    """The top-level field holding a lone surrogate ("" for the record itself), or None."""
    if _encodable(obj):
        return None
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not _encodable(k) or not _encodable(v):
                return k if _encodable(k) else ""
    return ""


@dataclass
class Template:
    """``--template "Classify: {review}"`` builds the user message (or embedding input) from
    columns; ``--system`` adds a system message; ``--id-column`` names the custom_id column.
    The other columns of the row are the task's metadata (copied to its output line)."""

    text: str
    system: str | None = None
    id_column: str | None = None
    kind: str = "chat"  # chat | completion | embedding

    def __post_init__(self) -> None:
        self.columns = [f for _, f, _, _ in string.Formatter().parse(self.text) if f]

    def record(self, row: dict, line_no: int) -> dict | BadLine:
        cid = row.get(self.id_column) if self.id_column else None
        cid = None if cid is None else str(cid)
        missing = [c for c in self.columns if c not in row]
        if missing:
            return _bad(line_no, cid, "template", f"column {missing[0]!r} is not in the file "
                                                  f"(columns: {', '.join(map(str, row))})")
        empty = [c for c in self.columns if row[c] is None]
        if empty:  # a NaN or null cell: a prompt with a hole is not what the row meant
            return _bad(line_no, cid, "template", f"the cell of column {empty[0]!r} is empty in this row "
                                                  "(null or NaN): fill it, or leave the row out")
        values = {k: "" if v is None else v for k, v in row.items()}
        try:
            text = self.text.format_map(values)
        except (ValueError, IndexError, KeyError) as e:
            return _bad(line_no, cid, "template", f"cannot fill the template: {e}")
        rec: dict = {"custom_id": cid} if cid else {}
        used = {*self.columns, self.id_column}
        meta = {str(k): jsonable(v) for k, v in row.items() if k not in used}
        if meta:
            rec["metadata"] = meta
        if self.kind == "embedding":
            rec["input"] = text
        elif self.kind == "completion":
            rec["prompt"] = text
        else:
            msgs = [{"role": "system", "content": self.system}] if self.system else []
            rec["messages"] = [*msgs, {"role": "user", "content": text}]
        return rec


def jsonable(value: object) -> object:
    """A cell of a CSV/Parquet row as JSON can hold it: dates and times as ISO text, bytes
    as text (UTF-8, else hex), decimals as numbers, anything else unknown as its str()."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return value.hex()
    iso = getattr(value, "isoformat", None)
    if callable(iso):
        return iso()
    if isinstance(value, Decimal):
        return float(value)
    return str(value)


def build_from_row(row: dict, line_no: int, template: Template, defaults: TaskDefaults) -> Task | BadLine:
    rec = template.record(row, line_no)
    if isinstance(rec, BadLine):
        return rec
    return build_task(rec, line_no, defaults)


def prefix_key(task: Task, chars: int = 256) -> str:
    """The start of the prompt as the server will see it: tasks with equal keys share a prefix."""
    body = task.request.body
    if task.request.kind == "chat":
        parts = []
        for m in body["messages"]:
            c = m.get("content")
            parts.append(f"{m.get('role')}:{c if isinstance(c, str) else json.dumps(c)}")
            if sum(map(len, parts)) >= chars:
                break
        return "\n".join(parts)[:chars]
    if task.request.kind == "completion":
        return body["prompt"][:chars]
    inp = body["input"]
    return (inp if isinstance(inp, str) else inp[0])[:chars]
