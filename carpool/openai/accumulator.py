"""Rebuilds the non-streamed OpenAI response body from the chunks of a streamed one, losing nothing.

A streamed chat or text completion is a series of chunks; each chunk carries, per choice
``index``, an increment of the answer.  ``StreamAccumulator`` folds them back into the body
the same server would have returned without ``stream``, so the output file and the result
cache hold one shape whatever the transport was.  The folding rules:

* top level: ``object`` becomes ``chat.completion`` (chat) or stays ``text_completion``;
  ``usage`` is the last non-null one (the ``include_usage`` chunk); every other field
  (``id``, ``created``, ``model``, ``system_fingerprint``, ``service_tier``, vLLM's
  ``prompt_logprobs`` / ``prompt_token_ids``, unknown ones) takes its first non-null value,
  because the top level describes the whole answer and servers repeat it on every chunk.
  OpenAI's ``obfuscation`` padding is per-chunk noise and is dropped.
* per choice (by ``index``, so ``n > 1`` and several prompts interleave freely):
  ``finish_reason`` and other scalars take their last non-null value (vLLM's
  ``stop_reason``); lists are concatenated (vLLM's ``token_ids``); ``logprobs`` is merged
  list by list (chat: ``content`` and ``refusal``; completions: ``tokens``,
  ``token_logprobs``, ``top_logprobs``, ``text_offset`` -- servers send absolute offsets).
* completions: ``text`` pieces are joined.
* chat, the ``delta`` becomes the ``message``: ``role`` from the first delta that has one;
  strings are joined (``content``, ``refusal``, ``reasoning_content``, ``reasoning``, any
  unknown text field: a delta is an increment by definition); ``tool_calls`` are merged by
  their ``index`` -- ``id``, ``type`` and ``function.name`` from the first delta carrying
  them, ``function.arguments`` joined -- and the ``index`` key is dropped, as in a
  non-streamed message; the legacy ``function_call`` joins its ``arguments`` the same way;
  nested objects (``audio``) are merged by the same rules; a field only ever seen as null
  stays null.

Field order follows first appearance.  Nothing here needs the openai SDK: this sits on the
client's hot path and must not import a large optional package.
"""

from __future__ import annotations

from typing import Any

# Per-chunk fields that describe the transport, not the answer.
_DROPPED_TOP = frozenset({"obfuscation"})
# Delta fields that are increments of text even when a server sends them as one piece.
_TEXT_FIELDS = ("content", "refusal", "reasoning_content", "reasoning")


class StreamAccumulator:
    """Feed it every parsed ``data:`` chunk with ``add``; ``body()`` is the rebuilt answer."""

    def __init__(self, chat: bool):
        self.chat = chat
        self._top: dict[str, Any] = {}
        self._choices: dict[int, _Choice] = {}
        self._saw_choices = False
        self.pieces = 0  # deltas that carried text: about one token each, when usage is missing

    def has_content(self, chunk: dict) -> bool:
        """Whether the chunk carries part of the answer (the first one marks the TTFT)."""
        for c in _choices_of(chunk):
            if self.chat:
                delta = c.get("delta")
                if isinstance(delta, dict) and (
                    any(delta.get(f) for f in _TEXT_FIELDS) or delta.get("tool_calls") or delta.get("function_call")
                ):
                    return True
            elif c.get("text"):
                return True
        return False

    def add(self, chunk: dict) -> None:
        for key, value in chunk.items():
            if key in _DROPPED_TOP:
                continue
            if key == "choices":
                self._saw_choices = True
                self._top.setdefault("choices", None)
                for c in _choices_of(chunk):
                    self._add_choice(c)
            elif key == "object":
                self._top["object"] = "chat.completion" if self.chat else "text_completion"
            elif key == "usage":
                if value is not None or "usage" not in self._top:
                    self._top["usage"] = value
            elif value is not None and self._top.get(key) is None:
                self._top[key] = value
            else:
                self._top.setdefault(key, None)

    def _add_choice(self, c: dict) -> None:
        index = c.get("index", 0)
        if not isinstance(index, int):
            index = 0
        choice = self._choices.get(index)
        if choice is None:
            choice = self._choices[index] = _Choice(index, self.chat)
        if choice.add(c):
            self.pieces += 1

    def body(self) -> dict:
        out: dict[str, Any] = {}
        for key, value in self._top.items():
            if key == "choices":
                out["choices"] = [self._choices[i].body() for i in sorted(self._choices)]
            else:
                out[key] = value
        if not self._saw_choices:
            out["choices"] = []
        out.setdefault("object", "chat.completion" if self.chat else "text_completion")
        return out


def _choices_of(chunk: dict) -> list[dict]:
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return []
    return [c for c in choices if isinstance(c, dict)]


class _Choice:
    """One choice's fields, folded chunk by chunk."""

    def __init__(self, index: int, chat: bool):
        self.chat = chat
        self.fields: dict[str, Any] = {"index": index}
        self.message: dict[str, Any] = {}
        self.texts: dict[str, list[str]] = {}  # the choice's "text" (completions) or message strings
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.tool_args: dict[int, list[str]] = {}

    def add(self, c: dict) -> bool:
        """Fold one chunk's choice in; True when it carried text."""
        carried = False
        for key, value in c.items():
            if key == "index":
                continue
            if key == "delta" and self.chat:
                self.fields.setdefault("message", None)
                if isinstance(value, dict):
                    carried = self._add_delta(value)
            elif key == "text" and not self.chat:
                self.fields.setdefault("text", None)
                if isinstance(value, str):
                    self.texts.setdefault("text", []).append(value)
                    carried = bool(value)
            elif key == "logprobs":
                self.fields["logprobs"] = _merge_lists(self.fields.get("logprobs"), value)
            else:
                _fold_scalar_or_list(self.fields, key, value)
        return carried

    def _add_delta(self, delta: dict) -> bool:
        carried = False
        msg = self.message
        for key, value in delta.items():
            if key == "role":
                if value is not None and msg.get("role") is None:
                    msg["role"] = value
                else:
                    msg.setdefault("role", None)
            elif key == "tool_calls":
                msg.setdefault("tool_calls", None)
                if isinstance(value, list):
                    for position, call in enumerate(value):
                        if isinstance(call, dict):
                            self._add_tool_call(call, position)
                    carried = carried or bool(value)
            elif isinstance(value, str):
                msg.setdefault(key, None)
                self.texts.setdefault(key, []).append(value)
                carried = carried or (bool(value) and key in _TEXT_FIELDS)
            elif isinstance(value, dict):
                msg[key] = _merge_nested(msg.get(key), value)
            else:
                _fold_scalar_or_list(msg, key, value)
        return carried

    def _add_tool_call(self, call: dict, position: int) -> None:
        index = call.get("index", position)
        if not isinstance(index, int):
            index = position
        slot = self.tool_calls.setdefault(index, {})
        args = self.tool_args.setdefault(index, [])
        for key, value in call.items():
            if key == "index":
                continue
            if key == "function" and isinstance(value, dict):
                fn = slot.get("function")
                if not isinstance(fn, dict):
                    fn = slot["function"] = {}
                for fkey, fvalue in value.items():
                    if fkey == "arguments":
                        fn.setdefault("arguments", None)
                        if isinstance(fvalue, str):
                            args.append(fvalue)
                    elif fvalue is not None and fn.get(fkey) is None:
                        fn[fkey] = fvalue
                    else:
                        fn.setdefault(fkey, None)
            elif value is not None and slot.get(key) is None:
                slot[key] = value
            else:
                slot.setdefault(key, None)

    def body(self) -> dict:
        out: dict[str, Any] = {}
        for key, value in self.fields.items():
            if key == "message":
                out["message"] = self._message()
            elif key == "text":
                out["text"] = "".join(self.texts.get("text", []))
            else:
                out[key] = value
        if self.chat and "message" not in out:
            out["message"] = self._message()
        if not self.chat and "text" not in out:
            out["text"] = ""
        return out

    def _message(self) -> dict:
        msg: dict[str, Any] = {}
        for key, value in self.message.items():
            if key == "tool_calls":
                calls = []
                for i in sorted(self.tool_calls):
                    call = dict(self.tool_calls[i])
                    fn = call.get("function")
                    if isinstance(fn, dict):
                        fn = dict(fn)
                        if self.tool_args.get(i) or "arguments" in fn:
                            fn["arguments"] = "".join(self.tool_args.get(i, []))
                        call["function"] = fn
                    calls.append(call)
                msg["tool_calls"] = calls if calls else value
            elif key in self.texts:
                msg[key] = "".join(self.texts[key])
            else:
                msg[key] = value
        return msg


def _fold_scalar_or_list(target: dict, key: str, value: Any) -> None:
    """Lists concatenate (token ids arrive piece by piece); other values: last non-null wins."""
    if isinstance(value, list):
        have = target.get(key)
        target[key] = [*have, *value] if isinstance(have, list) else list(value)
    elif value is not None:
        target[key] = value
    else:
        target.setdefault(key, None)


def _merge_lists(have: Any, new: Any) -> Any:
    """logprobs objects: every list field concatenates; other fields keep the first non-null."""
    if new is None:
        return have
    if not isinstance(new, dict):
        return new if have is None else have
    out = dict(have) if isinstance(have, dict) else {}
    for key, value in new.items():
        prev = out.get(key)
        if isinstance(value, list):
            out[key] = [*prev, *value] if isinstance(prev, list) else list(value)
        elif value is not None and prev is None:
            out[key] = value
        else:
            out.setdefault(key, None)
    return out


def _merge_nested(have: Any, new: dict) -> dict:
    """A nested delta object (``audio``, ``function_call``): strings join, lists extend, the rest last non-null."""
    out = dict(have) if isinstance(have, dict) else {}
    for key, value in new.items():
        prev = out.get(key)
        if isinstance(value, str) and key not in ("id", "name", "type"):
            out[key] = (prev if isinstance(prev, str) else "") + value
        elif isinstance(value, str):
            if prev is None:
                out[key] = value
        elif isinstance(value, list):
            out[key] = [*prev, *value] if isinstance(prev, list) else list(value)
        elif isinstance(value, dict):
            out[key] = _merge_nested(prev, value)
        elif value is not None:
            out[key] = value
        else:
            out.setdefault(key, None)
    return out
