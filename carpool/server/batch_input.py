"""Reading a batch input file: OpenAI's checks of the whole file, then its requests one by one.

A batch is refused as a whole (status ``failed``, ``errors.data`` naming each line and why,
with OpenAI's error codes) when its file is not a batch file: a line that is not JSON, a
line without ``custom_id`` / ``method`` / ``url`` / ``body``, a ``custom_id`` seen before,
a method other than POST, a ``url`` that is not the batch's ``endpoint``, a ``model`` other
than the first line's (one model per batch), an empty file, more requests than the limit.
What only running a request can tell (a field out of range, a prompt past the context) is
that request's own answer in the error file, as OpenAI does; so is text that is not Unicode
(a lone surrogate escape) in its custom_id or body: a 400 naming the field, the other
requests answered.  A custom_id is at most ``MAX_CUSTOM_ID_CHARS`` characters (it is
written into every answer line), and every message quotes what it refuses cut short, so
the batch object stays small whatever the file holds.

Lines are numbered from 1; a blank line counts as a line but holds no request.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from carpool.errors import bounded
from carpool.openai.surrogates import SURROGATE_ESCAPE, lone_surrogate_path
from carpool.server.batch_journal import journal_id
from carpool.server.batch_object import BatchError

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/v1/embeddings": "embedding"}
MAX_REPORTED_ERRORS = 100  # a file wrong on every line names the first this many
MAX_CUSTOM_ID_CHARS = 1024
MAX_MESSAGE_CHARS = 500  # of one error's message: 100 of them stay within 50 KB
_QUOTED_CHARS = 80  # of a value quoted in a message


def shown(value: object) -> str:
    """``value`` as a message quotes it: its repr, cut to a few dozen characters."""
    return bounded(repr(value), _QUOTED_CHARS)


@dataclass
class BatchLine:
    line_no: int
    custom_id: str
    body: dict
    problem: str | None = None  # the field holding text that is not Unicode: answered as a 400


@dataclass
class InputCheck:
    """What the whole-file check found: the request count and model, or the errors."""

    total: int = 0
    model: str | None = None
    errors: list[BatchError] = field(default_factory=list)
    more_errors: int = 0  # errors past MAX_REPORTED_ERRORS, counted only

    def add(self, code: str, message: str, line: int | None = None, param: str | None = None) -> None:
        if len(self.errors) >= MAX_REPORTED_ERRORS:
            self.more_errors += 1
            return
        self.errors.append(BatchError(code, bounded(message, MAX_MESSAGE_CHARS), line, param))


def iter_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw line) of every non-blank line."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if raw.strip():
                yield n, raw


def parse_line(raw: bytes) -> dict | None:
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def check_input(path: Path, endpoint: str, max_requests: int) -> InputCheck:
    """Check every line of the file at ``path`` for a batch to ``endpoint`` (runs off the loop)."""
    out = InputCheck()
    seen: set[str] = set()
    for n, raw in iter_lines(path):
        out.total += 1
        obj = parse_line(raw)
        if obj is None:
            out.add("invalid_json_line", "This line is not parseable as a valid JSON object.", n)
            continue
        _check_record(obj, n, endpoint, seen, out)
    if out.total == 0:
        out.add("empty_file", "The batch input file is empty: it holds no request lines.")
    elif out.total > max_requests:
        out.add("too_many_tasks", f"The batch input file holds {out.total:,} requests; the limit is "
                f"{max_requests:,} per batch (--batch-max-requests). Split the file.")
    return out


def _check_record(obj: dict, n: int, endpoint: str, seen: set[str], out: InputCheck) -> None:
    for key in ("custom_id", "method", "url", "body"):
        if key not in obj:
            out.add("missing_required_parameter", f"Missing required parameter: '{key}'.", n, key)
            return
    cid = obj["custom_id"]
    if not isinstance(cid, str) or not cid or len(cid) > MAX_CUSTOM_ID_CHARS:
        out.add("invalid_value", f"'custom_id' must be a string of 1 to {MAX_CUSTOM_ID_CHARS} characters, got "
                f"{shown(cid)}.", n, "custom_id")
        return
    cid = journal_id(cid)  # the name its answer is written under: two ids must not share it
    if cid in seen:
        out.add("duplicate_custom_id", f"The custom_id {shown(cid)} is a duplicate of another request's: each "
                "request of a batch needs its own custom_id.", n, "custom_id")
        return
    seen.add(cid)
    if obj["method"] != "POST":
        out.add("invalid_method", f"The method {shown(obj['method'])} is not supported; only POST is.", n, "method")
        return
    if obj["url"] != endpoint:
        out.add("url_mismatch", f"The url {shown(obj['url'])} of this request does not match the batch's "
                f"endpoint {endpoint!r}.", n, "url")
        return
    body = obj["body"]
    if not isinstance(body, dict):
        out.add("invalid_value", "'body' must be a JSON object (the request body).", n, "body")
        return
    model = body.get("model")
    if not isinstance(model, str):
        out.add("missing_required_parameter", "Missing required parameter: 'body.model'.", n, "body.model")
        return
    if out.model is None:
        out.model = model
    elif model != out.model:
        out.add("model_mismatch", f"The model {shown(model)} differs from {shown(out.model)} of the batch's "
                "first request: a batch runs one model.", n, "body.model")


def iter_requests(path: Path) -> Iterator[BatchLine]:
    """The requests of a file that passed ``check_input``, each under its ``journal_id``."""
    for n, raw in iter_lines(path):
        obj = parse_line(raw)
        assert obj is not None  # check_input refused the file otherwise
        problem = None
        if SURROGATE_ESCAPE.search(raw):  # only an escape can make a lone surrogate: walk the line then
            problem = lone_surrogate_path({"custom_id": obj["custom_id"], "body": obj["body"]})
        yield BatchLine(n, journal_id(obj["custom_id"]), obj["body"], problem)
