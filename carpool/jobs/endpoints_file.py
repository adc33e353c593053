"""``--endpoints FILE``: the endpoints of a job, read from YAML (or JSON), checked at start.

The file is a list of endpoints, or a mapping with an ``endpoints:`` list::

    endpoints:
      - name: openai                    # optional: how messages name it (default: the URL)
        base_url: https://api.openai.com/v1
        model: gpt-4o-mini              # what this endpoint is sent (required)
        api_key_env: OPENAI_API_KEY     # the NAME of the variable holding the key
        headers: {OpenAI-Organization: org-123}
        headers_env: {X-Gateway-Token: GATEWAY_TOKEN}   # header values kept in variables
        weight: 3                       # share of the traffic within its tier (default 1)
        rpm: 500                        # this endpoint's own budget (the job's is --rpm/--tpm)
        tpm: 200000
        max_completion_tokens: auto     # auto (from the model name) | true | false
      - kind: azure                     # or told from *.openai.azure.com
        base_url: https://my-resource.openai.azure.com
        deployment: gpt-4o-mini-prod    # default: model
        api_version: "2024-10-21"
        model: gpt-4o-mini
        api_key_env: AZURE_OPENAI_API_KEY
        fallback: true                  # = priority 1: used only while every primary is out

An endpoint of kind ``openai-batch``, ``azure-batch`` or ``anthropic-batch`` sends the job
through that provider's batch API (``carpool.jobs.provider_batch``): it is then the file's only
endpoint, and an ``anthropic-batch`` key goes in the ``x-api-key`` header.

Keys are never in the file: ``api_key`` (or an ``Authorization`` / ``api-key`` header
with a literal value) is refused, naming the field and what to write instead.  A missing
variable, an unknown field, a wrong type: the start is refused (exit 2) naming the entry
and the field.  Variables are read here, once, when the job starts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from carpool.client.endpoints import EndpointSpec, auth_headers, header_problem, is_azure_url, plain_specs
from carpool.errors import EndpointsFileError, StartRefused
from carpool.jobs.options import KINDS

if TYPE_CHECKING:
    from carpool.jobs.options import RunOptions

FIELDS = ("name", "base_url", "url", "kind", "model", "deployment", "api_version", "api_key_env", "headers",
          "headers_env", "weight", "priority", "fallback", "rpm", "tpm", "max_completion_tokens")
_SECRET_HEADERS = {"authorization", "api-key", "x-api-key"}
BATCH_KINDS = tuple(KINDS)


def load_endpoints(path: str, environ: Mapping[str, str] | None = None) -> list[EndpointSpec]:
    """The endpoints of the file at ``path``; keys are read from ``environ`` (default: os.environ)."""
    env = os.environ if environ is None else environ
    try:
        with open(path, encoding="utf-8-sig") as f:  # -sig: a byte order mark is no part of the document
            text = f.read()
    except OSError as e:
        raise EndpointsFileError(f"--endpoints {path}: cannot read it ({e.strerror or e})") from None
    doc = _parse(path, text)
    entries = doc.get("endpoints") if isinstance(doc, dict) else doc
    if isinstance(doc, dict) and set(doc) - {"endpoints"}:
        extra = ", ".join(sorted(set(doc) - {"endpoints"}))
        raise EndpointsFileError(f"{path}: unknown top-level field(s) {extra}; the file holds 'endpoints:' only")
    if not isinstance(entries, list) or not entries:
        raise EndpointsFileError(f"{path}: expected a non-empty list of endpoints (or 'endpoints:' holding one)")
    specs = [_entry(path, i, e, env) for i, e in enumerate(entries, 1)]
    names = [s.name for s in specs]
    for n in names:
        if names.count(n) > 1:
            raise EndpointsFileError(f"{path}: two endpoints are named {n!r}; give each its own 'name'")
    return specs


def _parse(path: str, text: str) -> Any:
    if path.endswith(".json"):
        try:
            return json.loads(text)
        except ValueError as e:
            raise EndpointsFileError(f"{path}: not valid JSON: {e}") from None
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise EndpointsFileError(f"{path}: not valid YAML (JSON is YAML too): {e}") from None


def _entry(path: str, i: int, e: object, env: Mapping[str, str]) -> EndpointSpec:
    where = f"{path}: endpoint {i}"
    if not isinstance(e, dict):
        raise EndpointsFileError(f"{where}: must be a mapping of fields (base_url, model, ...), got {e!r}")
    if isinstance(e.get("name"), str) and e["name"]:
        where += f" ({e['name']})"

    def bad(fld: str, why: str) -> EndpointsFileError:
        return EndpointsFileError(f"{where}: field '{fld}': {why}")

    if "api_key" in e:
        raise bad("api_key", "a key is never written in the endpoints file; put it in an environment "
                             "variable and name the variable: api_key_env: OPENAI_API_KEY")
    unknown = [k for k in e if k not in FIELDS]
    if unknown:
        raise bad(str(unknown[0]), f"unknown field; the fields are {', '.join(FIELDS)}")
    url = e.get("base_url", e.get("url"))
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise bad("base_url", f"missing or not an http(s) URL ({url!r}); e.g. base_url: http://127.0.0.1:8000/v1")
    kind = e.get("kind", "azure" if is_azure_url(url) else "openai")
    if kind not in ("openai", "azure", *BATCH_KINDS):
        raise bad("kind", f"{kind!r} is not a kind: openai (any OpenAI-compatible server), azure, or a batch "
                          f"API: {', '.join(BATCH_KINDS)}")
    model = e.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "missing: the model name this endpoint is sent (on Azure: the model of the deployment)")
    for fld in ("name", "deployment", "api_version"):
        if fld in e and not (isinstance(e[fld], str) and e[fld]):
            raise bad(fld, f"must be a non-empty string, got {e[fld]!r}"
                           + (" (quote a date: api_version: \"2024-10-21\")" if fld == "api_version" else ""))
    if kind not in ("azure", "azure-batch"):
        for fld in ("deployment", "api_version"):
            if fld in e:
                raise bad(fld, "only for kind: azure (or azure-batch)")
    key = None
    if "api_key_env" in e:
        var = e["api_key_env"]
        if not isinstance(var, str) or not var:
            raise bad("api_key_env", f"must name an environment variable, got {var!r}")
        if var.startswith(("sk-", "Bearer ")) or len(var) > 64:
            raise bad("api_key_env", "looks like a key, not the name of a variable; put the key in a variable "
                                     "(export OPENAI_API_KEY=...) and write api_key_env: OPENAI_API_KEY")
        key = env.get(var)
        if not key:
            raise bad("api_key_env", f"the environment variable {var} is not set (or empty); export it "
                                     "or remove api_key_env for an endpoint without a key")
        problem = header_problem("Authorization", key)
        if problem:
            raise bad("api_key_env", f"the key in ${var} cannot be sent: {problem.replace('the value', 'it')}")
    headers = _headers(e, bad, env)
    return EndpointSpec(
        url, model=model, headers={**_auth(kind, key), **headers}, kind=kind,
        deployment=e.get("deployment"), api_version=e.get("api_version"),
        weight=_number(e, "weight", 1.0, bad, positive=True), priority=_priority(e, bad),
        rpm=_number(e, "rpm", None, bad, positive=True), tpm=_number(e, "tpm", None, bad, positive=True),
        max_completion_tokens=_auto_bool(e, bad), name=e.get("name") or "")


def _auth(kind: str, key: str | None) -> dict[str, str]:
    if kind == "anthropic-batch":
        return {"x-api-key": key} if key else {}
    return auth_headers(kind.removesuffix("-batch"), key)


def _headers(e: dict, bad: Any, env: Mapping[str, str]) -> dict[str, str]:
    out: dict[str, str] = {}
    literal = e.get("headers", {})
    if not isinstance(literal, dict):
        raise bad("headers", "must be a mapping of header name to value")
    for name, value in literal.items():
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise bad(f"headers.{name}", f"must be a string, got {value!r}")
        if str(name).lower() in _SECRET_HEADERS:
            raise bad(f"headers.{name}", "holds a key; name its variable instead: api_key_env: VAR, or "
                                         f"headers_env: {{{name}: VAR}}")
        _check(f"headers.{name}", str(name), str(value), bad)
        out[str(name)] = str(value)
    from_env = e.get("headers_env", {})
    if not isinstance(from_env, dict):
        raise bad("headers_env", "must be a mapping of header name to the NAME of an environment variable")
    for name, var in from_env.items():
        if not isinstance(var, str) or not env.get(var):
            raise bad(f"headers_env.{name}", f"the environment variable {var!r} is not set (or empty)")
        _check(f"headers_env.{name}", str(name), env[var], bad)
        out[str(name)] = env[var]
    return out


def _check(fld: str, name: str, value: str, bad: Any) -> None:
    problem = header_problem(name, value)
    if problem:
        raise bad(fld, problem)


def _number(e: dict, fld: str, default: float | None, bad: Any, positive: bool = False) -> Any:
    if fld not in e:
        return default
    v = e[fld]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (positive and not v > 0):
        raise bad(fld, f"must be a positive number, got {v!r}")
    return float(v)


def _priority(e: dict, bad: Any) -> int:
    if "priority" in e and "fallback" in e:
        raise bad("fallback", "give either priority (0 first, then 1, ...) or fallback: true, not both")
    if "fallback" in e:
        if not isinstance(e["fallback"], bool):
            raise bad("fallback", f"must be true or false, got {e['fallback']!r}")
        return 1 if e["fallback"] else 0
    p = e.get("priority", 0)
    if isinstance(p, bool) or not isinstance(p, int) or p < 0:
        raise bad("priority", f"must be a whole number >= 0 (0: primary, 1: first fallback, ...), got {p!r}")
    return p


def _auto_bool(e: dict, bad: Any) -> bool | None:
    v = e.get("max_completion_tokens", "auto")
    if v == "auto":
        return None
    if not isinstance(v, bool):
        raise bad("max_completion_tokens", f"must be auto, true or false, got {v!r}")
    return v


def job_endpoints(opts: RunOptions) -> list[EndpointSpec]:
    """The endpoints a job sends to: those of its endpoints file, else its ``--endpoint`` URLs
    with ``--api-key``, ``--header`` and ``--api-version`` (``--header`` applies to the file's too)."""
    if opts.endpoint_specs:
        specs = [_with_headers(s, opts.headers) for s in opts.endpoint_specs] if opts.headers else opts.endpoint_specs
    else:
        specs = plain_specs(opts.endpoints, opts.api_key, opts.headers, opts.api_version)
    check_headers(specs, opts)
    return specs


def check_headers(specs: list[EndpointSpec], opts: RunOptions) -> None:
    """Refuse the start (exit 2, before anything is sent) when a header cannot go out as HTTP:
    a line break, a control character, a character beyond Latin-1, a bad name.  Without this,
    the HTTP library refuses each request and every task becomes an error line.  The message
    names where the header came from, never its value."""
    for spec in specs:
        for name, value in spec.headers.items():
            problem = header_problem(name, value)
            if problem is None:
                continue
            if name in opts.headers:
                origin = f"--header '{name}: ...'"
            elif opts.endpoint_specs:
                origin = f"endpoint {spec.name} of --endpoints"
            else:
                origin = "--api-key (or $CARPOOL_API_KEY / $OPENAI_API_KEY)"
            raise StartRefused(f"{origin}: header {name}: {problem}")


def _with_headers(spec: EndpointSpec, headers: dict[str, str]) -> EndpointSpec:
    import dataclasses

    return dataclasses.replace(spec, headers={**spec.headers, **headers})


def endpoint_models(opts: RunOptions) -> list[str]:
    """The models an endpoints file sends, each once, in file order (empty without a file)."""
    out: list[str] = []
    for s in opts.endpoint_specs:
        if s.model and s.model not in out:
            out.append(s.model)
    return out
