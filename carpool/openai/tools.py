"""OpenAI ``tools`` / ``tool_choice``: the prompt that tells the model, and the calls in the answer.

The engine (``carpool.engine.tool_calls``) turns ``tools`` + ``tool_choice`` into a grammar
and the generated text back into calls.  What is left is the OpenAI side:

* the model must know the tools: the chat templates carpool runs do not render ``tools``,
  so a system message lists them (name, description, parameters) and the reply format the
  grammar enforces -- appended to the first system message, or added before the others;
* earlier turns: an assistant message with ``tool_calls`` is shown to the model in that same
  reply format; a ``tool`` message keeps its role and content;
* the answer: ``message.tool_calls`` = ``[{"id", "type": "function", "function": {"name",
  "arguments"}}]`` with ``content`` null, and ``finish_reason`` "tool_calls" -- except for a
  named ``tool_choice``, where OpenAI and vLLM answer "stop" (the call was forced, not chosen);
* in a stream, the calls come as ``delta.tool_calls`` once the text is complete (the call is
  read from the whole text), one delta per call carrying its id, name and whole arguments.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from typing import Any, Protocol


class _Call(Protocol):
    name: str
    arguments: str


def named_function(tool_choice: object) -> str | None:
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return fn["name"]
    return None


def active(body: dict) -> bool:
    """Whether this request's answer is read for tool calls."""
    return bool(body.get("tools")) and body.get("tool_choice", "auto") != "none"


def tools_prompt(tools: list[dict], tool_choice: object, parallel_tool_calls: bool = True) -> str:
    """The system text that describes ``tools`` and the reply format for ``tool_choice``."""
    lines = ["You can call these functions:"]
    for t in tools:
        fn = t["function"]
        desc = f": {fn['description']}" if fn.get("description") else ""
        params = json.dumps(fn.get("parameters") or {"type": "object", "properties": {}}, ensure_ascii=False)
        lines.append(f"- {fn['name']}{desc}. Parameters (JSON Schema): {params}")
    name = named_function(tool_choice)
    if name is not None:
        lines.append(f"Call {name}: reply with its arguments as one JSON object, nothing else.")
    else:
        many = "one or more calls" if parallel_tool_calls else "exactly one call"
        lines.append(f'To call functions, reply with a JSON array of {many}, nothing else: '
                     '[{"name": "<function name>", "arguments": {<arguments>}}]')
        if tool_choice != "required":
            lines.append("If no function fits, answer in words instead.")
    return "\n".join(lines)


def with_tools_prompt(messages: list[dict], body: dict) -> list[dict]:
    """``messages`` (already in the template's form) with the tools described in the system message."""
    if not active(body):
        return messages
    parallel = body.get("parallel_tool_calls", True) is not False
    text = tools_prompt(body["tools"], body.get("tool_choice", "auto"), parallel)
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        joined = f"{first['content']}\n\n{text}" if first["content"] else text
        return [{**first, "content": joined}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def history_content(message: dict) -> str | None:
    """What the model sees of an earlier assistant ``tool_calls`` or ``tool`` message (None: as is)."""
    calls = message.get("tool_calls")
    if message.get("role") == "assistant" and calls:
        shown = []
        for c in calls:
            fn = c.get("function") or {}
            try:
                args: Any = json.loads(fn.get("arguments") or "{}")
            except ValueError:
                args = fn.get("arguments")
            shown.append({"name": fn.get("name"), "arguments": args})
        prefix = f"{message['content']}\n" if isinstance(message.get("content"), str) and message["content"] else ""
        return prefix + json.dumps(shown, ensure_ascii=False)
    return None


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def message_tool_calls(calls: Sequence[_Call], ids: Sequence[str]) -> list[dict]:
    return [{"id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c, i in zip(calls, ids, strict=True)]


def delta_tool_calls(calls: Sequence[_Call], ids: Sequence[str]) -> list[dict]:
    return [{"index": k, "id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for k, (c, i) in enumerate(zip(calls, ids, strict=True))]


def finish_reason(tool_choice: object) -> str:
    return "stop" if named_function(tool_choice) is not None else "tool_calls"
