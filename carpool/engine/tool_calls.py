"""OpenAI ``tools`` + ``tool_choice`` as a grammar, and the generated text back as tool calls.

The model writes a call as JSON, and the grammar makes that JSON valid:

- ``tool_choice`` "required": a JSON array of one or more calls (one only when
  ``parallel_tool_calls`` is false), each ``{"name": <a declared function>, "arguments":
  {...}}`` with the arguments valid against that function's ``parameters`` schema.
- ``tool_choice`` {"type": "function", "function": {"name": F}}: the arguments object of F
  alone (as vLLM does); the call's name is F.
- "auto" stays free text, as in vLLM: no grammar, so the model may answer in words; if the
  text is a call in the "required" form (or a single call object) it is read as one.
- "none" (or no tools): no grammar, no calls.

The chat template of the packaged model does not render tools: the layer above must describe
them in the prompt (a system message listing names, descriptions and parameters) or the model
cannot know what to call.  ``tool_call_constraint`` and ``parse_tool_calls`` are the whole
contract; the OpenAI layer turns ``ToolCall``s into ``message.tool_calls`` (ids are its own).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from carpool.errors import EngineError

from .protocol import StructuredOutputs


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object, as OpenAI sends it


def _functions(tools: list[dict]) -> dict[str, dict]:
    """name -> parameters schema, checking the OpenAI shape with errors naming the entry."""
    if not isinstance(tools, list) or not tools:
        raise EngineError("tools must be a non-empty list of {\"type\": \"function\", \"function\": {...}}")
    out: dict[str, dict] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise EngineError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise EngineError(f"tools[{i}].function.name must be a non-empty string")
        if name in out:
            raise EngineError(f"tools[{i}].function.name {name!r} is declared twice; names must be unique")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise EngineError(f"tools[{i}].function.parameters must be a JSON Schema object")
        out[name] = params
    return out


def _named(tool_choice: object) -> str | None:
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise EngineError('tool_choice must be "none", "auto", "required" or '
                              '{"type": "function", "function": {"name": ...}}')
        return name
    if tool_choice in (None, "none", "auto", "required"):
        return None
    raise EngineError(f'tool_choice must be "none", "auto", "required" or a named function, got {tool_choice!r}')


def tool_call_constraint(tools: list[dict] | None, tool_choice: object = "auto",
                         parallel_tool_calls: bool = True) -> StructuredOutputs | None:
    """The grammar for ``tools`` under ``tool_choice`` (None: free text).  Raises EngineError."""
    if not tools or tool_choice == "none":
        return None
    fns = _functions(tools)
    name = _named(tool_choice)
    if name is not None:
        if name not in fns:
            raise EngineError(f"tool_choice names function {name!r}, which is not in tools "
                              f"(declared: {', '.join(fns)})")
        return StructuredOutputs(json=fns[name])
    if tool_choice != "required":
        return None  # "auto" (the default): free text
    call = {"anyOf": [{"type": "object",
                       "properties": {"name": {"const": n}, "arguments": p},
                       "required": ["name", "arguments"], "additionalProperties": False}
                      for n, p in fns.items()]}
    schema: dict = {"type": "array", "items": call, "minItems": 1}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return StructuredOutputs(json=schema)


def parse_tool_calls(text: str, tools: list[dict] | None, tool_choice: object = "auto") -> list[ToolCall] | None:
    """The calls in a generated ``text``; None when it is not a call (plain content).

    Under "required" or a named function the grammar made ``text`` a call unless the output
    was cut by max_tokens or a stop string: then this returns None too, and the caller keeps
    the text as content with its finish_reason ("length").
    """
    if not tools or tool_choice == "none":
        return None
    fns = _functions(tools)
    name = _named(tool_choice)
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if name is not None:
        return [ToolCall(name, json.dumps(value, ensure_ascii=False))] if isinstance(value, dict) else None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not (isinstance(item, dict) and item.get("name") in fns and isinstance(item.get("arguments"), dict)):
            return None
        calls.append(ToolCall(item["name"], json.dumps(item["arguments"], ensure_ascii=False)))
    return calls or None
