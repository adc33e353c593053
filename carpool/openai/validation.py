"""Validate a request body against an OpenAPI 3.0 schema dict, naming the first field that breaks it.

Only the part of OpenAPI 3.0 the request schemas use (type, nullable, enum, anyOf, ranges,
lengths, items, properties, required, maxProperties) is implemented: a small walker whose
errors say which field, what was expected and what came, which a general validator does
not.  tests/server/test_schema_admission.py checks that it accepts exactly what an
independent OpenAPI validator accepts.
"""

from __future__ import annotations

from typing import Any

from carpool.errors import SchemaError

# A schema key marking a parameter carpool does not implement; its value says what, for the error.
UNSUPPORTED = "x-carpool-unsupported"
# A schema key whose text is added to the error when a value breaks that schema: why, and the fix.
HINT = "x-carpool-hint"


_JSON_TYPE_NAMES = {
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    list: "array",
    dict: "object",
    type(None): "null",
}


def _type_name(value: Any) -> str:
    return _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def _is_type(value: Any, expected: str) -> bool:
    if expected == "integer":  # as OpenAPI 3.0 (JSON Schema draft 4): 1.0 is a number, not an integer
        return isinstance(value, int) and not isinstance(value, bool)
    if expected == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected == "boolean":
        return isinstance(value, bool)
    if expected == "string":
        return isinstance(value, str)
    if expected == "array":
        return isinstance(value, list)
    if expected == "object":
        return isinstance(value, dict)
    return False


def _fail(path: str, schema: dict, reason: str) -> SchemaError:
    what = schema.get(UNSUPPORTED)
    if what:
        return SchemaError(path, f"{what} is not supported by carpool; leave it out")
    hint = schema.get(HINT)
    return SchemaError(path, f"{reason}: {hint}" if hint else reason)


def validate(value: Any, schema: dict, path: str = "") -> None:
    """Raise SchemaError naming the first field of ``value`` that breaks ``schema``."""
    if value is None:
        if schema.get("nullable"):
            return
        if "type" in schema and "anyOf" not in schema:
            raise _fail(path, schema, "must not be null")
    if "anyOf" in schema:
        errors = []
        for option in schema["anyOf"]:
            try:
                validate(value, option, path)
                return
            except SchemaError as e:
                errors.append(e)
        # Report the option whose type matched (its message is the precise one), else list the types;
        # among arrays, the one whose items are of the first item's type ([1, 2, -1]: token ids).
        matched = [(o, e) for o, e in zip(schema["anyOf"], errors, strict=True)
                   if "type" in o and _is_type(value, o["type"])]
        if isinstance(value, list) and value:
            matched = [(o, e) for o, e in matched
                       if "type" in o.get("items", {}) and _is_type(value[0], o["items"]["type"])] or matched
        if matched:
            raise matched[0][1]
        kinds = " or ".join(_describe(o) for o in schema["anyOf"])
        raise _fail(path, schema, f"must be {kinds}, got {_type_name(value)}")
    expected = schema.get("type")
    if expected and not _is_type(value, expected):
        raise _fail(path, schema, f"must be {_describe(schema)}, got {_type_name(value)}")
    if "enum" in schema and value not in schema["enum"]:
        choices = ", ".join(repr(c) for c in schema["enum"] if c is not None)
        raise _fail(path, schema, f"must be one of {choices}, got {value!r}")
    if expected in ("integer", "number"):
        _check_range(value, schema, path)
    elif expected == "string":
        if "minLength" in schema and len(value) < schema["minLength"]:
            n = schema["minLength"]
            raise _fail(path, schema, "must not be empty" if n == 1 else f"must have at least {n} characters")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            raise _fail(path, schema, f"must have at most {schema['maxLength']} characters")
    elif expected == "array":
        if "minItems" in schema and len(value) < schema["minItems"]:
            raise _fail(path, schema, f"must have at least {schema['minItems']} item(s)")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            raise _fail(path, schema, f"must have at most {schema['maxItems']} item(s)")
        items = schema.get("items")
        if items is not None and not _plain_integers(value, items):
            for i, item in enumerate(value):
                validate(item, items, f"{path}[{i}]")
    elif expected == "object":
        if "maxProperties" in schema and len(value) > schema["maxProperties"]:
            raise _fail(path, schema, f"must have at most {schema['maxProperties']} properties")
        # Present fields first: a wrong value ("type": "image_url") explains more than what is missing.
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                validate(value[name], sub, _join(path, name))
        for name in schema.get("required", []):
            if name not in value:
                raise _fail(_join(path, name), {}, "is required")


def _plain_integers(value: list, items: dict) -> bool:
    """True when every item is an int within ``items``' range: a token-id prompt of thousands of
    ids is checked in one pass instead of one validate() call per id.  False means "check each
    item" (which then finds and names the culprit)."""
    if items.get("type") != "integer" or not value or set(items) - {"type", "minimum", "maximum"}:
        return False
    if not all(type(x) is int for x in value):
        return False
    lo, hi = items.get("minimum"), items.get("maximum")
    return (lo is None or min(value) >= lo) and (hi is None or max(value) <= hi)


def _check_range(value: float, schema: dict, path: str) -> None:
    lo, hi = schema.get("minimum"), schema.get("maximum")
    if lo is not None:
        if schema.get("exclusiveMinimum") and value <= lo:
            raise _fail(path, schema, f"must be > {lo}, got {value}")
        if value < lo:
            raise _fail(path, schema, f"must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise _fail(path, schema, f"must be <= {hi}, got {value}")


def _describe(schema: dict) -> str:
    kind = schema.get("type", "value")
    if kind == "array" and "items" in schema:
        return f"an array of {schema['items'].get('type', 'value')}s"
    return {"integer": "an integer", "object": "an object", "array": "an array"}.get(kind, f"a {kind}")


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def check_choice_count(prompts: int, n: int, limit: int | None) -> None:
    """A request runs ``prompts`` x ``n`` engine sequences (choices); past ``limit`` it is
    refused before anything is tokenized, naming ``prompt`` (or ``n`` for one prompt) and
    the limit.  One request could otherwise put 2048 x 16 sequences into the engine past
    admission control, which always admits a request into an empty waiting room."""
    if limit is None or prompts * n <= limit:
        return
    param = "prompt" if prompts > 1 else "n"
    raise SchemaError(param, f"this request asks for {prompts:,} prompt(s) x n={n} = {prompts * n:,} choices; "
                             f"this server runs at most {limit:,} per request (--max-choices-per-request); "
                             "split the prompts over several requests")
