"""OpenAI chat bodies to Anthropic Messages ``params`` and Anthropic Messages back.

The task file holds OpenAI chat bodies and the output holds OpenAI chat completions,
whatever answered them, so a job moves between providers without changing its files.
What differs in Anthropic's Messages API: the system prompt is a field of its own, not a
message; ``max_tokens`` is required; stop sequences, tools and tool choice have other
names; content is a list of blocks.  A field that has no Anthropic form (``n`` > 1,
``logprobs``, ``response_format``, penalties) is refused with its name, never dropped in
silence, since dropping it would answer another question than the task asked.
"""

from __future__ import annotations

import json
import time

from carpool.errors import Untranslatable

# Fields sent on as they are, and fields that change nothing Anthropic would answer.
_SAME = ("temperature", "top_p", "top_k")
_IGNORED = {"stream", "stream_options", "seed", "store", "metadata", "parallel_tool_calls", "service_tier"}
_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls",
           "refusal": "content_filter", "pause_turn": "stop"}


def chat_to_params(body: dict, model: str | None, default_max_tokens: int) -> dict:
    """The Messages API body for an OpenAI chat ``body``; ``model`` replaces the body's when given."""
    params: dict = {"model": model or body.get("model")}
    if not params["model"]:
        raise Untranslatable("model", "missing: name the model (--model or the task's body.model)")
    system, messages = _messages(body.get("messages") or [])
    if system:
        params["system"] = system
    params["messages"] = messages
    params["max_tokens"] = body.get("max_tokens") or body.get("max_completion_tokens") or default_max_tokens
    for key in _SAME:
        if body.get(key) is not None:
            params[key] = body[key]
    stop = body.get("stop")
    if stop:
        params["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
    if body.get("tools"):
        params["tools"] = [_tool(t) for t in body["tools"]]
    if body.get("tool_choice") is not None:
        params["tool_choice"] = _tool_choice(body["tool_choice"])
    if isinstance(body.get("user"), str):
        params["metadata"] = {"user_id": body["user"]}
    known = {"model", "messages", "max_tokens", "max_completion_tokens", "stop", "tools", "tool_choice", "user",
             *_SAME, *_IGNORED}
    for key, value in body.items():
        if key == "n" and value in (None, 1):
            continue
        if key not in known and value is not None:
            raise Untranslatable(key, f"Anthropic's Messages API has no '{key}'; remove it from the task "
                                      "or run this task online")
    return params


def _messages(msgs: list) -> tuple[str, list[dict]]:
    system: list[str] = []
    out: list[dict] = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise Untranslatable(f"messages.{i}", "must be an object")
        role = m.get("role")
        if role in ("system", "developer"):
            system.append(_text(m.get("content"), f"messages.{i}.content"))
        elif role == "tool":
            block = {"type": "tool_result", "tool_use_id": m.get("tool_call_id", ""),
                     "content": _text(m.get("content"), f"messages.{i}.content")}
            out.append({"role": "user", "content": [block]})
        elif role in ("user", "assistant"):
            content = _content(m.get("content"), f"messages.{i}.content")
            if role == "assistant" and m.get("tool_calls"):
                content = ([{"type": "text", "text": content}] if isinstance(content, str) and content else
                           content if isinstance(content, list) else [])
                content += [_tool_use(c) for c in m["tool_calls"]]
            out.append({"role": role, "content": content if content is not None else ""})
        else:
            raise Untranslatable(f"messages.{i}.role", f"{role!r} is not a chat role")
    return "\n\n".join(s for s in system if s), out


def _text(content: object, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise Untranslatable(where, "must be a string or a list of content parts")


def _content(content: object, where: str) -> str | list[dict] | None:
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise Untranslatable(where, "must be a string or a list of content parts")
    blocks = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            blocks.append({"type": "text", "text": part.get("text", "")})
        elif kind == "image_url":
            blocks.append(_image(part.get("image_url"), f"{where}.{j}"))
        else:
            raise Untranslatable(f"{where}.{j}.type", f"{kind!r} parts have no Anthropic form (text, image_url do)")
    return blocks


def _image(image: object, where: str) -> dict:
    url = image.get("url") if isinstance(image, dict) else image
    if not isinstance(url, str):
        raise Untranslatable(f"{where}.image_url", "must hold a url")
    if url.startswith("data:"):
        head, _, data = url.partition(",")
        media = head[5:].split(";")[0]
        return {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}
    return {"type": "image", "source": {"type": "url", "url": url}}


def _tool(tool: dict) -> dict:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not fn.get("name"):
        raise Untranslatable("tools", "each tool must be {type: function, function: {name, parameters}}")
    out = {"name": fn["name"], "input_schema": fn.get("parameters") or {"type": "object", "properties": {}}}
    if fn.get("description"):
        out["description"] = fn["description"]
    return out


def _tool_choice(choice: object) -> dict:
    if choice in ("auto", "none"):
        return {"type": choice}
    if choice == "required":
        return {"type": "any"}
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        return {"type": "tool", "name": choice["function"].get("name", "")}
    raise Untranslatable("tool_choice", f"{choice!r} is not a tool choice")


def _tool_use(call: dict) -> dict:
    fn = call.get("function") or {}
    try:
        args = json.loads(fn.get("arguments") or "{}")
    except ValueError:
        raise Untranslatable("messages.tool_calls", "function.arguments must be a JSON object") from None
    return {"type": "tool_use", "id": call.get("id", ""), "name": fn.get("name", ""), "input": args}


def message_to_chat(message: dict) -> dict:
    """An OpenAI chat completion body for an Anthropic Message (a succeeded batch result)."""
    text: list[str] = []
    calls: list[dict] = []
    for block in message.get("content") or []:
        if block.get("type") == "text":
            text.append(block.get("text", ""))
        elif block.get("type") == "tool_use":
            calls.append({"id": block.get("id", ""), "type": "function",
                          "function": {"name": block.get("name", ""), "arguments": json.dumps(block.get("input"))}})
    reply: dict = {"role": "assistant", "content": "".join(text) if text or not calls else None}
    if calls:
        reply["tool_calls"] = calls
    u = message.get("usage") or {}
    cached = int(u.get("cache_read_input_tokens") or 0)
    prompt = int(u.get("input_tokens") or 0) + cached + int(u.get("cache_creation_input_tokens") or 0)
    completion = int(u.get("output_tokens") or 0)
    return {"id": message.get("id", ""), "object": "chat.completion", "created": int(time.time()),
            "model": message.get("model", ""),
            "choices": [{"index": 0, "message": reply, "logprobs": None,
                         "finish_reason": _FINISH.get(message.get("stop_reason") or "", "stop")}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                      "prompt_tokens_details": {"cached_tokens": cached}}}
