"""Cache keys: what is folded, what is kept, and which requests may be cached at all.

A key is the SHA-256 of a canonical JSON document holding the model, the endpoint
identity and the request body with its texts normalised.  The rules (docs/cache.md
repeats them for users):

Folded in every prompt text (message ``content`` strings and ``text`` parts, the
completion ``prompt``, the embeddings ``input``, ``instructions``):

* Unicode NFC (a precomposed "é" and "e" + combining accent are one text);
* invisible characters are removed: zero-width space/joiners (U+200B..U+200D), word
  joiner (U+2060), BOM/zero-width no-break space (U+FEFF), soft hyphen (U+00AD),
  Mongolian vowel separator (U+180E), bidi marks and embeddings (U+200E, U+200F,
  U+202A..U+202E, U+2066..U+2069), invisible operators (U+2061..U+2064);
* line endings: CR LF and CR become LF;
* inside a line, every run of whitespace (spaces, tabs, NBSP and other Unicode spaces)
  becomes one space, and whitespace at the end of a line is dropped;
* runs of line breaks (blank lines included) become one line break;
* leading and trailing whitespace of the whole text is dropped.

Kept exactly: case, punctuation, digits, every visible character (no NFKC: full-width
letters stay distinct), and the indentation at the start of a line (it is meaningful in
code and YAML).  Stop strings, tool definitions, schemas and every other value are kept
verbatim: whitespace in a stop string changes the output.

In the key (everything that can change the output): model, endpoint identity, the
``--cache-namespace`` when one is given (none: the key is the same as before it existed), and every
body field except the ones listed in ``IGNORED_FIELDS`` -- so messages with roles, names
and tool calls, temperature, top_p, top_k, min_p, max_tokens, max_completion_tokens,
stop, seed, n, response_format, tools, tool_choice, parallel_tool_calls, logit_bias,
logprobs, top_logprobs, presence/frequency/repetition penalties, best_of, echo, suffix,
dimensions, encoding_format, vLLM's extras (ignore_eos, stop_token_ids, min_tokens,
return_token_ids, prompt_logprobs, guided_*, structured_outputs), extra_body, and any
field carpool does not know (an unknown field might change the output, so it costs at
most a missed hit, never a wrong one).

Not in the key (they never change the output): api key, request id, custom_id, user,
stream, stream_options, timeout, metadata, store, service_tier, prompt_cache_key,
safety_identifier, extra_headers, priority.  ``stream`` is not in the key because the
client rebuilds a streamed answer into exactly the body the server returns unstreamed
(carpool/openai/accumulator.py), and the client always asks a stream for its usage
chunk, so ``stream_options`` cannot change the stored body either.  What is stored under
the key is that whole body.

Other canonical choices: the order of top-level body fields and of fields inside a
message does not matter; the order of items inside lists and nested objects (messages,
stop, tools, JSON-schema properties) does, because the model sees it.  An integral
float equals the integer (``temperature: 0`` and ``0.0`` collide).  An absent parameter
and the same parameter set to its default are NOT folded together: servers disagree on
defaults (vLLM takes them from the model's generation config), so this can only cost a
missed hit.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import unicodedata
from typing import Any

# v2: before it, a streamed answer was stored as rebuilt by a lossy accumulator (tool_calls,
# logprobs, refusal, reasoning and provider fields dropped) under the same key as the plain
# answer.  Bumping the version makes those entries unreachable instead of served.
KEY_VERSION = "carpool-cache-v2"

# Body fields that never change what the model returns.
IGNORED_FIELDS = frozenset(
    {
        "api_key",
        "request_id",
        "custom_id",
        "user",
        "stream",
        "stream_options",
        "timeout",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        "extra_headers",
        "extra_query",
        "priority",
        "model",  # passed separately as ``model=``; see cache_key
    }
)

# Fields whose text is normalised (see module docstring).
_TEXT_FIELDS = ("prompt", "input", "instructions")

_INVISIBLE = (
    "\u00ad\u180e\u200b\u200c\u200d\u200e\u200f\u2060\u2061\u2062\u2063\u2064"
    "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\ufeff"
)
_INVISIBLE_TABLE = {ord(c): None for c in _INVISIBLE}
_H_SPACE_RUN = re.compile(r"[^\S\n]+")  # whitespace other than a line feed
_LINE_BREAK_RUN = re.compile(r"\n(?:[^\S\n]*\n)+")  # several line breaks, blank lines between


def normalize_text(text: str) -> str:
    """Fold a prompt text as documented above; case, punctuation and indentation stay."""
    text = unicodedata.normalize("NFC", text).translate(_INVISIBLE_TABLE)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _LINE_BREAK_RUN.sub("\n", text.strip())
    lines = []
    for line in text.split("\n"):
        body = line.lstrip()
        indent = line[: len(line) - len(body)]
        lines.append(indent + _H_SPACE_RUN.sub(" ", body).rstrip())
    return "\n".join(lines)


def _fold_numbers(value: Any) -> Any:
    """Integral floats become ints, recursively (JSON does not tell 0 from 0.0)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _fold_numbers(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_fold_numbers(v) for v in value]
    return value


def _normalize_content(content: Any) -> Any:
    if isinstance(content, str):
        return normalize_text(content)
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                part = {**part, "text": normalize_text(part["text"])}
            parts.append(part)
        return parts
    return content


def _normalize_text_value(value: Any) -> Any:
    """prompt / input: a string, a list of strings, or token ids (kept as they are)."""
    if isinstance(value, str):
        return normalize_text(value)
    if isinstance(value, list):
        return [normalize_text(v) if isinstance(v, str) else v for v in value]
    return value


def normalize_body(body: dict) -> dict:
    """The body as it enters the key: ignored fields dropped, texts folded, numbers folded."""
    out: dict[str, Any] = {}
    for name, value in body.items():
        if name in IGNORED_FIELDS:
            continue
        if name == "messages" and isinstance(value, list):
            value = [
                {**m, "content": _normalize_content(m["content"])}
                if isinstance(m, dict) and "content" in m
                else m
                for m in value
            ]
        elif name in _TEXT_FIELDS:
            value = _normalize_text_value(value)
        out[name] = _fold_numbers(value)
    return out


def normalize_endpoint(endpoint: str | None) -> str:
    """Endpoint identity: a URL or path such as ``/v1/chat/completions``.

    Scheme and host are case-insensitive, a trailing slash means nothing; the path is kept.
    """
    if not endpoint:
        return ""
    endpoint = endpoint.strip()
    match = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*://[^/]*)(.*)$", endpoint)
    if match:
        endpoint = match.group(1).lower() + match.group(2)
    return endpoint.rstrip("/")


def _canonical(doc: Any) -> str:
    # Top-level and per-message field order does not matter (sorted in _canonical_doc);
    # nested order is kept, because the model sees it (schema properties, tool lists).
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":"))


def _canonical_doc(kind: str, model: str | None, endpoint: str | None, body: dict, namespace: str = "") -> dict:
    norm = normalize_body(body)
    if "messages" in norm and isinstance(norm["messages"], list):
        norm["messages"] = [
            {k: m[k] for k in sorted(m)} if isinstance(m, dict) else m for m in norm["messages"]
        ]
    if model is None:
        model = body.get("model")
    doc = {
        "v": KEY_VERSION,
        "kind": kind,
        "model": model or "",
        "endpoint": normalize_endpoint(endpoint),
        "body": {k: norm[k] for k in sorted(norm)},
    }
    if namespace:  # only when set: the keys of every cache written without one stay as they were
        doc["namespace"] = namespace
    return doc


def cache_key(*, model: str | None, endpoint: str | None, body: dict, namespace: str = "") -> str:
    """SHA-256 (hex) of everything in ``body`` that can change the output, plus model, endpoint
    and ``namespace`` (``--cache-namespace``: entries of one namespace are never served in another).

    ``model=None`` takes ``body["model"]``; the explicit argument wins otherwise, so a
    job-level model and the per-line body cannot disagree silently.
    """
    doc = _canonical_doc("exact", model, endpoint, body, namespace)
    return hashlib.sha256(_canonical(doc).encode()).hexdigest()


# ---------------------------------------------------------------------------------------
# Which requests may be cached.


def _number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None or isinstance(value, bool):
        return None
    return float(value) if isinstance(value, (int, float)) else math.nan


def is_embeddings(body: dict) -> bool:
    return "input" in body and "messages" not in body and "prompt" not in body


def is_cacheable(body: dict, cache_sampled: bool = False) -> bool:
    """Whether the same body is expected to give the same answer, so a stored one may be reused.

    * Embeddings are deterministic: always cacheable.
    * An absent ``temperature`` means 1.0 (OpenAI's default and carpool's engine default),
      i.e. sampling.  So a chat/completion body is cacheable when ``temperature`` is 0,
      or when a ``seed`` is given (the caller asked for a reproducible sample and the
      seed is in the key), or when ``cache_sampled`` is set (``--cache-sampled``: the
      user accepts one sample standing for all).
    * ``n > 1`` or ``best_of > 1`` while sampling without a seed is several independent
      samples: the same rule applies (cached only with ``cache_sampled``).  With
      temperature 0 the n choices are the greedy answer repeated, which is cacheable.
    * A temperature that is not a number is not cached (the server will reject it).
    """
    if not isinstance(body, dict):
        return False
    if is_embeddings(body):
        return True
    temperature = _number(body, "temperature")
    if temperature is not None and math.isnan(temperature):
        return False
    if cache_sampled:
        return True
    if temperature is None:
        temperature = 1.0
    if temperature == 0.0:
        return True
    return body.get("seed") is not None


# ---------------------------------------------------------------------------------------
# Semantic cache: scope and text.

# The semantic cache's default similarity floor for candidates (semantic.py says why); here
# so that the CLI can show it without importing FAISS.
SEMANTIC_THRESHOLD = 0.4
# Longest final user text the semantic cache will embed.  all-MiniLM-L6-v2 reads at most
# 256 word pieces; two long texts that differ only after the cut would look identical.
SEMANTIC_MAX_CHARS = 1000
SEMANTIC_MAX_TOKENS = 16  # "label-like": a short answer (a class name, yes/no, a score)
_SLOT = "\u0000carpool-semantic-slot\u0000"


def _max_tokens(body: dict) -> float | None:
    values = [v for v in (_number(body, n) for n in ("max_tokens", "max_completion_tokens")) if v is not None]
    return min(values) if values else None


def _enum_only_schema(schema: Any, depth: int = 0) -> bool:
    """A JSON schema whose every leaf is an enum, a const or a boolean: the answer is a label."""
    if not isinstance(schema, dict) or depth > 8:
        return False
    if "enum" in schema or "const" in schema or schema.get("type") == "boolean":
        return True
    for combo in ("anyOf", "oneOf"):
        if combo in schema:
            options = schema[combo]
            return isinstance(options, list) and bool(options) and all(
                _enum_only_schema(o, depth + 1) for o in options
            )
    if schema.get("type") == "object" and isinstance(schema.get("properties"), dict):
        props = schema["properties"]
        return bool(props) and all(_enum_only_schema(p, depth + 1) for p in props.values())
    return False


def _label_like(body: dict) -> bool:
    if body.get("guided_choice"):  # vLLM's choice constraint
        return True
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema") or {}
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if _enum_only_schema(schema):
            return True
    max_tokens = _max_tokens(body)
    return max_tokens is not None and not math.isnan(max_tokens) and max_tokens <= SEMANTIC_MAX_TOKENS


def _final_user_text(body: dict) -> str | None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "user":
        return None
    content = last.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "\n".join(p["text"] for p in content)
    return None  # images, audio, files: not comparable by a text embedding


def semantic_text(body: dict) -> str | None:
    """The text the semantic cache compares, or None where a near match may be wrong.

    Safe means all of: a chat body whose last message is a user text; temperature 0
    explicitly; n (if given) 1; no tools, no logprobs; and a label-like answer -- a
    ``max_tokens``/``max_completion_tokens`` of at most 16, or a ``response_format``
    JSON schema made only of enums/consts/booleans, or vLLM's ``guided_choice``.  The
    text must be at most ``SEMANTIC_MAX_CHARS`` characters.  Completions and embeddings
    are never semantic: a completion prompt mixes the instruction with the item, and a
    long shared instruction makes different items look alike.
    """
    if not isinstance(body, dict) or "messages" not in body:
        return None
    if _number(body, "temperature") != 0.0:
        return None
    n = _number(body, "n")
    if n is not None and n != 1.0:
        return None
    if body.get("tools") or body.get("functions") or body.get("logprobs"):
        return None
    if not _label_like(body):
        return None
    text = _final_user_text(body)
    if text is None:
        return None
    text = normalize_text(text)
    if not text or len(text) > SEMANTIC_MAX_CHARS:
        return None
    return text


def scope_key(*, model: str | None, endpoint: str | None, body: dict, namespace: str = "") -> str:
    """Key of everything that changes the output except the final user text.

    Two requests may share a semantic hit only inside one scope: same model, endpoint,
    system prompt, earlier turns, role/name of the last message, and every parameter.
    """
    scoped = dict(body)
    messages = body.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
        scoped["messages"] = [*messages[:-1], {**messages[-1], "content": _SLOT}]
    doc = _canonical_doc("scope", model, endpoint, scoped, namespace)
    return hashlib.sha256(_canonical(doc).encode()).hexdigest()
