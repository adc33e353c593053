"""Field-for-field comparison of two OpenAI response bodies, apart from what is per-response.

Used to check that a streamed answer, rebuilt by the client, equals the same answer not
streamed (tests and ``scripts/record_vllm_fixtures.py``).  What may differ, and why:

* the top-level ``id`` and ``created`` (each response is a new one);
* ``tool_calls[].id`` (servers draw a fresh random id per call);
* ``usage.prompt_tokens_details.cached_tokens``: how much of the prompt the server found in
  its prefix cache depends on what it ran before, not on the answer;
* a field that is null on one side and absent on the other (servers leave unset fields
  out of chunks that they spell as null in a whole body; a reader cannot tell them apart).

Everything else must be equal, numbers exactly (a greedy answer is the same computation).
``json_strings`` names string fields to compare as the JSON they hold, for a server that
re-serializes them in one mode only (vLLM: a tool call's ``arguments``).
"""

from __future__ import annotations

import json
from typing import Any

PER_RESPONSE_TOP = ("id", "created")


def _strip(doc: Any, path: str) -> Any:
    if isinstance(doc, dict):
        out = {}
        for key, value in doc.items():
            if value is None:
                continue
            if path == "" and key in PER_RESPONSE_TOP:
                continue
            if key == "id" and path.endswith("tool_calls[]"):
                continue
            if key == "cached_tokens" and path == "usage.prompt_tokens_details":
                continue
            out[key] = _strip(value, f"{path}.{key}" if path else key)
        return out
    if isinstance(doc, list):
        return [_strip(v, f"{path}[]") for v in doc]
    return doc


def answer_diff(a: Any, b: Any, json_strings: tuple[str, ...] = ()) -> list[str]:
    """Paths where the two bodies differ (empty: equal, apart from the per-response fields)."""
    out: list[str] = []
    _diff(_strip(a, ""), _strip(b, ""), "$", out, json_strings)
    return out


def _diff(a: Any, b: Any, path: str, out: list[str], json_strings: tuple[str, ...]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a:
                out.append(f"{path}.{key}: missing on the left, right has {_short(b[key])}")
            elif key not in b:
                out.append(f"{path}.{key}: missing on the right, left has {_short(a[key])}")
            elif key in json_strings and isinstance(a[key], str) and isinstance(b[key], str):
                if _as_json(a[key]) != _as_json(b[key]):
                    out.append(f"{path}.{key}: {_short(a[key])} != {_short(b[key])} (as JSON)")
            else:
                _diff(a[key], b[key], f"{path}.{key}", out, json_strings)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.append(f"{path}: {len(a)} items on the left, {len(b)} on the right")
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            _diff(x, y, f"{path}[{i}]", out, json_strings)
    elif a != b or type(a) is not type(b):
        out.append(f"{path}: {_short(a)} != {_short(b)}")


def _as_json(text: str) -> Any:
    try:
        return ("json", json.loads(text))
    except ValueError:
        return ("text", text)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
