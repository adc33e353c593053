"""OpenAI request body -> engine requests: the one translation and its default policy.

``Translator.prepare(kind, body)`` validates a chat or text-completion body, turns it into
one ``GenerateRequest`` per (prompt, choice) and checks the lengths against the context.
The server, the in-process backend, bench and tune all go through it, so a task gets the
same answer whichever way it is run.

The default policy follows vLLM 0.32's OpenAI server and the OpenAI API:

- ``max_tokens`` (or ``max_completion_tokens``) unset: chat generates up to the rest of
  the context; a text completion 16 tokens (the legacy API's and vLLM's default).  A value
  past the context is a 400 naming the field and the most it may be.
- chat messages: ``developer`` becomes ``system`` (the templates carpool runs have no
  developer role; vLLM does the same for them) and, when it did, the system messages are
  merged into one at the start, joined by a blank line, as vLLM does; text content parts
  are joined with "\\n"; ``name`` is kept.
- ``stop``: a string or a list; an empty stop string is refused by the schema (vLLM too).
- ``n``: n engine requests per prompt; a seeded request gives choice i the seed ``seed + i``.
- ``logprobs``: chat ``logprobs: true`` + ``top_logprobs: k`` (k defaults to 0), completions
  ``logprobs: k``: the engine gives each generated token's logprob and k alternatives.
  ``top_logprobs`` without ``logprobs: true`` is a 400 (OpenAI refuses it too).
- penalties, ``logit_bias`` (token id strings -> bias, clamped to [-100, 100]), ``min_tokens``,
  ``min_p``, ``seed``, ``stop_token_ids``: passed through with vLLM's meanings.
- one grammar at most: ``response_format`` ``json_object`` / ``json_schema`` (its ``schema``),
  vLLM's ``structured_outputs``, or ``tools`` under ``tool_choice`` "required" or a named
  function (``carpool.engine.tool_calls``); two of them in one request is a 400.  With tools,
  the model is told about them in the system message (``tools.with_tools_prompt``).

``sampling_params`` is the one place a body field becomes an engine field: a parameter the
engine learns (logprobs, penalties, structured output) is one line there plus its schema
entry in ``schema.py``.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass

from carpool.engine.protocol import EngineClient, GenerateRequest, SamplingParams, StructuredOutputs
from carpool.engine.tool_calls import tool_call_constraint
from carpool.errors import EngineError, OpenAIError, SchemaError
from carpool.openai import tools as T
from carpool.openai.responses import Choice
from carpool.openai.schema import chat_request_schema, completion_request_schema
from carpool.openai.validation import check_choice_count, validate

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions API and vLLM
# No token of the byte-level BPE vocabularies carpool runs is longer than this many characters
# (SmolLM2's longest is 81 bytes: a newline and 80 spaces), so a prompt of more than
# max_model_len * this many characters cannot fit and is refused before it is tokenized:
# tokenizing a 30 MB body took 77 s and 4 GB.
MAX_CHARS_PER_TOKEN = 128
DEFAULT_MAX_N = 16

_ID_PREFIX = {"chat": "chatcmpl", "completion": "cmpl"}


def chat_messages(messages: list[dict], body: dict | None = None) -> list[dict]:
    """The messages as the chat template gets them (see the module docstring for the rules);
    with ``body``, its tools are described in the system message."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(part["text"] for part in content)
        shown = T.history_content(m)  # an earlier assistant turn that called tools
        if shown is not None:
            content = shown
        msg = {"role": "system" if m["role"] == "developer" else m["role"], "content": content or ""}
        if m.get("name"):
            msg["name"] = m["name"]
        out.append(msg)
    if any(m["role"] == "developer" for m in messages):
        out = _merge_system(out)
    return T.with_tools_prompt(out, body) if body is not None else out


def _merge_system(messages: list[dict]) -> list[dict]:
    """One system message first, holding every system message's text (some templates want it there)."""
    system = [i for i, m in enumerate(messages) if m["role"] == "system"]
    if system == [0] or not system:
        return messages
    merged = {"role": "system", "content": "\n\n".join(messages[i]["content"] for i in system
                                                      if messages[i]["content"])}
    return [merged, *(m for m in messages if m["role"] != "system")]


def sampling_params(body: dict, max_tokens: int, kind: str = "chat") -> SamplingParams:
    """The engine's sampling parameters of a validated body (OpenAI and vLLM meanings).

    The body must have passed ``check_fields`` (the checks the schema cannot say)."""
    stop = body.get("stop")
    top_k = body.get("top_k")
    bias = body.get("logit_bias")
    return SamplingParams(
        temperature=float(1.0 if body.get("temperature") is None else body["temperature"]),
        # A top_p that rounds to 0 in float32 would mask every token; below 1e-6 the nucleus
        # is the top token anyway, so the floor changes no result.
        top_p=max(1e-6, float(1.0 if body.get("top_p") is None else body["top_p"])),
        top_k=int(top_k) if top_k and top_k > 0 else 0,
        min_p=float(body.get("min_p") or 0.0),
        max_tokens=max_tokens,
        min_tokens=int(body.get("min_tokens") or 0),
        stop=[stop] if isinstance(stop, str) else list(stop or []),
        stop_token_ids=[int(t) for t in body.get("stop_token_ids") or []],
        seed=None if body.get("seed") is None else int(body["seed"]),
        ignore_eos=bool(body.get("ignore_eos") or False),
        presence_penalty=float(body.get("presence_penalty") or 0.0),
        frequency_penalty=float(body.get("frequency_penalty") or 0.0),
        repetition_penalty=float(1.0 if body.get("repetition_penalty") is None else body["repetition_penalty"]),
        logit_bias={int(k): float(v) for k, v in bias.items()} if bias else None,
        logprobs=logprobs_asked(body, kind),
        structured_outputs=structured_outputs(body),
    )


def logprobs_asked(body: dict, kind: str) -> int | None:
    """How many alternatives per token the answer shows (None: no logprobs)."""
    if kind == "chat":
        return int(body.get("top_logprobs") or 0) if body.get("logprobs") else None
    return None if body.get("logprobs") is None else int(body["logprobs"])


def structured_outputs(body: dict) -> StructuredOutputs | None:
    """The one grammar of a checked body, or None."""
    fmt = body.get("response_format") or {}
    if fmt.get("type") == "json_object":
        return StructuredOutputs(json_object=True)
    if fmt.get("type") == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        # No schema: any JSON object (OpenAI requires one; vLLM takes its absence this way).
        return StructuredOutputs(json=schema) if schema else StructuredOutputs(json_object=True)
    so = body.get("structured_outputs")
    if so:
        return StructuredOutputs(**{k: v for k, v in so.items() if v not in (None, False)})
    if T.active(body):
        try:
            return tool_call_constraint(body["tools"], body.get("tool_choice", "auto"),
                                        body.get("parallel_tool_calls", True) is not False)
        except EngineError as e:
            raise OpenAIError(400, str(e), param="tool_choice") from None
    return None


def grammar_param(body: dict) -> str:
    """The body field that holds a checked body's grammar, as a 400 about it names it."""
    fmt = body.get("response_format") or {}
    if fmt.get("type") == "json_schema" and (fmt.get("json_schema") or {}).get("schema"):
        return "response_format.json_schema.schema"
    if fmt.get("type") in ("json_object", "json_schema"):
        return "response_format"
    so = body.get("structured_outputs")
    if so:
        return "structured_outputs." + next((k for k, v in so.items() if v not in (None, False)), "")
    return "tools"


def check_fields(kind: str, body: dict) -> None:
    """What the schema cannot say about the new fields; an OpenAIError (400) naming the field."""
    bias = body.get("logit_bias")
    if bias:
        for key, value in bias.items():
            if not key.strip().lstrip("-").isdigit() or int(key) < 0:
                raise OpenAIError(400, f"'logit_bias': keys are token ids (as strings, e.g. \"50256\"), got {key!r}",
                                  param=f"logit_bias.{key}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise OpenAIError(400, f"'logit_bias.{key}': a bias must be a number in [-100, 100], got {value!r}",
                                  param=f"logit_bias.{key}")
    if kind == "chat" and body.get("top_logprobs") is not None and not body.get("logprobs"):
        raise OpenAIError(400, "'top_logprobs': needs 'logprobs': true as well", param="top_logprobs")
    so = body.get("structured_outputs")
    if so is not None:
        set_ = [k for k, v in so.items() if v not in (None, False)]
        if len(set_) != 1:
            raise OpenAIError(400, "'structured_outputs': set exactly one of json, json_object, regex, choice, "
                              f"grammar (got {', '.join(set_) or 'none'})", param="structured_outputs")
    fmt = body.get("response_format") or {}
    if fmt.get("type") == "json_schema" and not fmt.get("json_schema"):
        raise OpenAIError(400, "'response_format.json_schema': required with type json_schema: "
                          "{\"name\": ..., \"schema\": {...}}", param="response_format.json_schema")
    grammars = [name for name, on in (("response_format", fmt.get("type") in ("json_object", "json_schema")),
                                      ("structured_outputs", so is not None),
                                      ("tool_choice", _tools_constrain(body))) if on]
    if len(grammars) > 1:
        raise OpenAIError(400, f"'{grammars[1]}': only one output constraint per request, and "
                          f"'{grammars[0]}' is one already; leave one out", param=grammars[1])
    if kind == "chat":
        _check_tools(body)
    min_tokens = body.get("min_tokens")
    max_asked = body.get("max_completion_tokens") or body.get("max_tokens")
    if min_tokens and max_asked and min_tokens > max_asked:
        raise OpenAIError(400, f"'min_tokens': {min_tokens} is more than max_tokens ({max_asked})",
                          param="min_tokens")


def _tools_constrain(body: dict) -> bool:
    choice = body.get("tool_choice", "auto")
    return T.active(body) and (choice == "required" or isinstance(choice, dict))


def _check_tools(body: dict) -> None:
    tools = body.get("tools") or []
    choice = body.get("tool_choice")
    names = [t["function"]["name"] for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise OpenAIError(400, f"'tools[{i}].function.name': {name!r} is declared twice", param=f"tools[{i}]")
    if choice in ("required",) or isinstance(choice, dict):
        if not tools:
            raise OpenAIError(400, "'tool_choice': names a function or is \"required\", but no 'tools' are given",
                              param="tool_choice")
        name = T.named_function(choice)
        if isinstance(choice, dict) and name not in names:
            raise OpenAIError(400, f"'tool_choice.function.name': {name!r} is not one of the tools "
                              f"({', '.join(names)})", param="tool_choice.function.name")


def max_tokens_for(body: dict, prompt_tokens: int, max_model_len: int, kind: str, prompt_param: str) -> int:
    """The max_tokens to run with; a 400 naming the field when the context cannot hold it."""
    if prompt_tokens >= max_model_len:
        raise OpenAIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens, and your {prompt_param} has "
            f"{prompt_tokens} tokens; shorten '{prompt_param}'.",
            param=prompt_param, code="context_length_exceeded",
        )
    room = max_model_len - prompt_tokens
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    asked = body.get(param)
    if asked is None:
        return room if kind == "chat" else min(COMPLETION_DEFAULT_MAX_TOKENS, room)
    asked = int(asked)
    if asked > room:
        raise OpenAIError(
            400,
            f"'{param}' is too large: {asked}. This model's maximum context length is {max_model_len} tokens "
            f"and your request has {prompt_tokens} prompt tokens ({asked} > {max_model_len} - {prompt_tokens}); "
            f"lower '{param}' to at most {room}.",
            param=param, code="context_length_exceeded",
        )
    return asked


@dataclass
class Prepared:
    """A validated request, ready to run: its response id and its choices (engine requests)."""

    kind: str  # "chat" | "completion"
    id: str
    choices: list[Choice]
    stream: bool
    include_usage: bool

    @property
    def structured_outputs(self) -> StructuredOutputs | None:
        """The request's grammar (every choice has the same one)."""
        return self.choices[0].request.params.structured_outputs if self.choices else None

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of every engine request (a prompt counts once per choice): what the engine queues."""
        return sum(c.prompt_tokens for c in self.choices)


class Translator:
    """Bodies -> engine requests for one engine: its context length and, on a server, its model names.

    ``model_names`` None accepts any ``model`` (in-process, there is only the one engine).
    """

    def __init__(self, engine: EngineClient, model_names: list[str] | None = None,
                 max_n: int = DEFAULT_MAX_N, max_choices: int | None = None) -> None:
        """``max_choices``: prompts x n one request may ask for (None: no limit, in-process)."""
        self.engine = engine
        self.max_choices = max_choices
        self.max_model_len = int(engine.max_model_len)
        self.schemas = {
            "chat": chat_request_schema(model_names, self.max_model_len, max_n),
            "completion": completion_request_schema(model_names, self.max_model_len, max_n),
        }

    def prepare(self, kind: str, body: dict, response_id: str | None = None) -> Prepared:
        """Validate ``body`` and build its choices; raises OpenAIError (400) naming the field."""
        try:
            validate(body, self.schemas[kind])
            check_choice_count(len(_prompts(body["prompt"])) if kind == "completion" else 1,
                               int(body.get("n") or 1), self.max_choices)
        except SchemaError as e:
            raise OpenAIError(400, e.message, param=e.param) from None
        check_fields(kind, body)
        rid = response_id or f"{_ID_PREFIX[kind]}-{uuid.uuid4().hex}"
        priority = int(body.get("priority") or 0)
        if kind == "chat":
            bases = [(GenerateRequest(request_id=rid, messages=chat_messages(body["messages"], body),
                                      priority=priority), "messages")]
        else:
            prompts = _prompts(body["prompt"])
            bases = []
            for i, p in enumerate(prompts):
                req = (GenerateRequest(request_id=rid, prompt=p, priority=priority) if isinstance(p, str) else
                       GenerateRequest(request_id=rid, prompt_token_ids=[int(t) for t in p], priority=priority))
                bases.append((req, "prompt" if len(prompts) == 1 else f"prompt[{i}]"))
        counted = []
        for req, param in bases:
            self._check_length_before_tokenizing(req, param)
        for req, param in bases:
            n_tokens = self._count(req, param)
            req.params = sampling_params(body, max_tokens_for(body, n_tokens, self.max_model_len, kind, param), kind)
            counted.append((req, n_tokens))
        stream_options = body.get("stream_options") or {}
        return Prepared(kind, rid, _expand(counted, body, rid), stream=bool(body.get("stream")),
                        include_usage=bool(stream_options.get("include_usage")))

    def _check_length_before_tokenizing(self, req: GenerateRequest, param: str) -> None:
        """A 400 for text that is too long for the context whatever its tokens (O(1) a string)."""
        chars = prompt_chars(req)
        most = self.max_model_len * MAX_CHARS_PER_TOKEN
        if chars > most:
            raise OpenAIError(
                400, f"This model's maximum context length is {self.max_model_len} tokens, and '{param}' holds "
                f"{chars:,} characters: more than that many tokens can hold (refused before tokenizing; at most "
                f"{most:,} characters); shorten '{param}'.", param=param,
                code="context_length_exceeded")

    def _count(self, req: GenerateRequest, param: str) -> int:
        if req.prompt_token_ids is not None:
            return len(req.prompt_token_ids)
        try:
            n = int(self.engine.count_prompt_tokens(req))
        except EngineError as e:
            raise OpenAIError(400, str(e), param=param) from None
        if n <= 0:
            raise OpenAIError(400, f"'{param}' is empty after tokenization; send some text", param=param)
        return n


def prompt_chars(req: GenerateRequest) -> int:
    """Characters of text the request's prompt holds (0 for token ids): what tokenizing costs."""
    if req.messages is not None:
        return sum(len(m.get("content") or "") + len(m.get("name") or "") for m in req.messages)
    return len(req.prompt) if req.prompt is not None else 0


def _prompts(prompt: str | list) -> list:
    """A completion's prompts: one string, strings, one list of token ids, or lists of them."""
    if isinstance(prompt, str) or all(isinstance(p, int) for p in prompt):
        return [prompt]
    return list(prompt)


def _expand(prompts: list[tuple[GenerateRequest, int]], body: dict, rid: str) -> list[Choice]:
    """n choices per prompt: choice i of prompt p is index p*n + i, its own engine request."""
    n = int(body.get("n") or 1)
    now = time.monotonic()
    tools = body["tools"] if T.active(body) and "messages" in body else None
    tool_choice = body.get("tool_choice", "auto")
    choices = []
    for p, (req, n_tokens) in enumerate(prompts):
        for i in range(n):
            params = req.params
            if i and params.seed is not None:  # seeded choices must still differ from each other
                params = dataclasses.replace(params, seed=params.seed + i)
            sub = dataclasses.replace(req, request_id=f"{rid}-{p * n + i}", params=params, arrival_time=now)
            choices.append(Choice(index=p * n + i, prompt_index=p, request=sub, prompt_tokens=n_tokens,
                                  tools=tools, tool_choice=tool_choice))
    return choices
