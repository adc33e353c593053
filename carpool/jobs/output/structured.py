"""Structured answers: the JSON a task asked for with ``response_format``, parsed and checked.

A task whose body has ``response_format`` ``{"type": "json_schema", "json_schema": {"schema":
S}}`` (or ``{"type": "json_object"}``) wants JSON back.  Its output line then carries the
answer parsed, so nobody has to parse ``choices[0].message.content`` again downstream:

- ``"parsed"``: the decoded object when it is JSON and validates against ``S``;
- ``"parse_error"``: why it is not (not JSON, cut by ``max_tokens``, or the first schema
  violation with its path), the answer text staying in the response as it came.

An answer that does not validate stays a success line (the endpoint did answer, the cache
keeps it); the per-row ``parse_error`` is what tells it apart.  The schema is checked with
``jsonschema`` (the validator class the schema's ``$schema`` names, Draft 2020-12 without
one); validators are compiled once per distinct schema.
"""

from __future__ import annotations

import json
from typing import Any

# Compiled validators by the schema's canonical JSON text; bounded, a job rarely has many schemas.
_VALIDATORS: dict[str, Any] = {}
_MAX_VALIDATORS = 256
_ANY_OBJECT = {"type": "object"}


def answer_schema(request_body: dict | None) -> dict | None:
    """The JSON Schema the answer must follow, ``{"type": "object"}`` for ``json_object``;
    None when the task asked for no structured answer."""
    rf = request_body.get("response_format") if isinstance(request_body, dict) else None
    if not isinstance(rf, dict):
        return None
    kind = rf.get("type")
    if kind == "json_object":
        return _ANY_OBJECT
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        return schema if isinstance(schema, dict) else _ANY_OBJECT
    return None


def _validator(schema: dict) -> Any:
    from jsonschema.validators import validator_for

    key = json.dumps(schema, sort_keys=True, separators=(",", ":"), default=str)
    found = _VALIDATORS.get(key)
    if found is None:
        cls = validator_for(schema)
        cls.check_schema(schema)
        found = cls(schema)
        if len(_VALIDATORS) >= _MAX_VALIDATORS:
            _VALIDATORS.clear()
        _VALIDATORS[key] = found
    return found


def answer_text(response_body: dict | None) -> str | None:
    """The first choice's message content (chat) or text (completion)."""
    choices = response_body.get("choices") if isinstance(response_body, dict) else None
    first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    message = first.get("message")
    text = message.get("content") if isinstance(message, dict) else first.get("text")
    return text if isinstance(text, str) else None


def _finish_reason(response_body: dict | None) -> str | None:
    choices = response_body.get("choices") if isinstance(response_body, dict) else None
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        reason = choices[0].get("finish_reason")
        return reason if isinstance(reason, str) else None
    return None


def check_answer(request_body: dict | None, response_body: dict | None) -> dict | None:
    """``{"parsed": obj}`` or ``{"parse_error": why}`` for a task that asked for JSON; None otherwise."""
    schema = answer_schema(request_body)
    if schema is None:
        return None
    text = answer_text(response_body)
    if text is None:
        return {"parse_error": "the answer has no text to parse"}
    try:
        value = json.loads(text)
    except ValueError as e:
        cut = " (cut by max_tokens: finish_reason 'length'; raise max_tokens)" \
            if _finish_reason(response_body) == "length" else ""
        return {"parse_error": f"the answer is not JSON{cut}: {e}"}
    from jsonschema.exceptions import SchemaError

    try:
        validator = _validator(schema)
    except SchemaError as e:  # the task's own schema is broken: said on its row
        return {"parse_error": f"response_format's schema is not a valid JSON Schema: {_first_line(e)}"}
    error = _best_error(validator, value)
    if error is not None:
        return {"parse_error": error}
    return {"parsed": value}


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _best_error(validator: Any, value: Any) -> str | None:
    from jsonschema.exceptions import best_match

    err = best_match(validator.iter_errors(value))
    if err is None:
        return None
    where = "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in err.absolute_path) or "the answer"
    where = where.lstrip(".") if where != "the answer" else where
    return f"does not match the schema at {where}: {err.message}"
