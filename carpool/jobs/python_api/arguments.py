"""The keyword arguments of ``run_batch`` / ``arun_batch`` as a job: ``RunOptions`` and ``LiveParts``.

The names a LiteLLM, vLLM or Curator user knows (``endpoint`` or ``endpoints``, ``model``,
``max_tokens``, ``response_format`` as a dict or a pydantic model, ``template`` as a
string) are turned into the fields ``carpool run`` fills from its flags; any other field of
``RunOptions`` is taken by name, and a misspelt one is refused with the closest name.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Sequence
from typing import Any

from carpool.jobs.input.tasks import TaskDefaults, Template
from carpool.jobs.options import KEYWORDS, LIVE_NAMES, LiveParts, RunOptions

_OPTION_NAMES = ({f.name for f in dataclasses.fields(RunOptions)} | set(LIVE_NAMES)) - {"input", "output"}
_SHORTCUTS = ("model", "max_tokens", "temperature", "idempotent")


def make_job(input: str, output: str, **options) -> tuple[RunOptions, LiveParts]:
    """The job ``run_batch``'s keyword arguments describe: its settings, and the objects it is
    given (``engine``, ``embedder_factory``, ``budget``, ``identity``: ``LiveParts``).
    ``model``, ``max_tokens``, ``temperature`` and ``idempotent`` are accepted as shortcuts:
    with ``endpoints`` ``model`` is the model name sent, without it the engine's model;
    ``template`` may be a string (chat kind)."""
    unknown = sorted(k for k in options if k not in _OPTION_NAMES and k not in _SHORTCUTS)
    if unknown:
        close = difflib.get_close_matches(unknown[0], [*_OPTION_NAMES, *_SHORTCUTS], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else " (see help(carpool.run_batch))"
        raise TypeError(f"run_batch: unknown keyword argument {unknown[0]!r}{hint}")
    shortcuts = {k: options.pop(k) for k in _SHORTCUTS if k in options}
    live = LiveParts(**{k: options.pop(k) for k in LIVE_NAMES if k in options})
    defaults = options.pop("defaults", None) or TaskDefaults()
    model = shortcuts.pop("model", None)
    if model is not None:
        if options.get("endpoints"):
            defaults = dataclasses.replace(defaults, model=model)
        else:
            options.setdefault("engine_model", model)
    if isinstance(options.get("template"), str):
        options["template"] = Template(options["template"])
    defaults = dataclasses.replace(defaults, **{k: v for k, v in shortcuts.items() if v is not None})
    options.setdefault("naming", KEYWORDS)  # a message names run_batch's arguments, not carpool run's flags
    return RunOptions(input=str(input), output=str(output), defaults=defaults, **options), live


def make_options(input: str, output: str, **options) -> RunOptions:
    """The settings of ``make_job`` alone, for a job given no live parts (benchmarks, scripts)."""
    opts, live = make_job(input, output, **options)
    if live != LiveParts():
        raise TypeError("make_options: engine, embedder_factory, budget and identity are live parts, not "
                        "settings: use make_job and pass its LiveParts to Runner(live=...)")
    return opts


def strict_schema(schema: Any) -> Any:
    """``schema`` as OpenAI's strict mode wants it: every object closed (``additionalProperties:
    false``) with all its properties required; the nested schemas too."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) if k in _NESTED else v for k, v in schema.items()}
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: strict_schema(v) for k, v in out["properties"].items()}
        out.setdefault("additionalProperties", False)
        out["required"] = list(out["properties"])
    if isinstance(out.get("$defs"), dict):
        out["$defs"] = {k: strict_schema(v) for k, v in out["$defs"].items()}
    return out


_NESTED = ("items", "anyOf", "allOf", "oneOf", "prefixItems")


def response_format_body(response_format: Any) -> tuple[dict, Any]:
    """(the body's ``response_format``, the pydantic model to build answers with or None).

    Takes what OpenAI's and LiteLLM's clients take: a ``{"type": ...}`` dict, or a pydantic
    model class (sent as its JSON Schema, strict, as the OpenAI SDK's ``parse`` does)."""
    if isinstance(response_format, dict):
        if response_format.get("type") not in ("json_schema", "json_object", "text"):
            raise TypeError("run_batch: response_format must be {'type': 'json_schema', 'json_schema': {'name': "
                            "..., 'schema': {...}}}, {'type': 'json_object'} or a pydantic model class; got "
                            f"{response_format!r}")
        return response_format, None
    schema_of = getattr(response_format, "model_json_schema", None)
    if isinstance(response_format, type) and callable(schema_of):
        schema = strict_schema(schema_of())
        return ({"type": "json_schema", "json_schema": {"name": response_format.__name__, "schema": schema,
                                                         "strict": True}}, response_format)
    raise TypeError(f"run_batch: response_format must be a dict or a pydantic model class; got "
                    f"{type(response_format).__name__}")


def _endpoint_list(endpoint: str | None, endpoints: str | Sequence[str] | None) -> list[str] | None:
    """``endpoint="URL"``, ``endpoints="URL"`` or ``endpoints=[URL, ...]`` as a list of URLs."""
    if endpoint is not None and endpoints is not None:
        raise TypeError("run_batch: give endpoint= (one URL) or endpoints= (a list), not both")
    given = endpoint if endpoint is not None else endpoints
    if given is None:
        return None
    urls = [given] if isinstance(given, str | os.PathLike) else list(given)
    for url in urls:
        if not isinstance(url, str) or not url:
            raise TypeError(f"run_batch: an endpoint is a base URL such as 'http://127.0.0.1:8000/v1'; "
                            f"got {url!r}")
    return urls


def job_options(*, endpoint: str | None = None, endpoints: str | Sequence[str] | None = None,
                response_format: Any = None, system: str | None = None, template: str | Template | None = None,
                **options: Any) -> tuple[dict, Any]:
    """The keyword arguments as ``RunOptions`` fields, and the pydantic model to parse with (or None)."""
    urls = _endpoint_list(endpoint, endpoints)
    if urls is not None:
        options["endpoints"] = urls
        if options.get("api_key") is None:  # as `carpool run` reads it
            options["api_key"] = os.environ.get("CARPOOL_API_KEY") or os.environ.get("OPENAI_API_KEY")
    parse = None
    if response_format is not None:
        body_rf, parse = response_format_body(response_format)
        defaults = options.get("defaults") or TaskDefaults()
        options["defaults"] = dataclasses.replace(defaults, extra={**defaults.extra, "response_format": body_rf})
    if isinstance(template, str):
        template = Template(template, system=system)
    elif system is not None:
        if template is None:
            raise TypeError("run_batch: system= goes with template= (e.g. template='Classify: {review}'); "
                            "a task dict carries its own system message")
        template = dataclasses.replace(template, system=system)
    if template is not None:
        options["template"] = template
    return {k: v for k, v in options.items() if v is not None or k in ("cache_ttl",)}, parse
