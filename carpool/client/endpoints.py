"""One endpoint as the HTTP backend sends to it: where, how it authenticates, what it is sent.

An ``EndpointSpec`` holds everything that differs between endpoints of one job: the base
URL, the model sent to it, its headers (the key already in them), its share of the traffic
(``weight``), its own RPM/TPM, its fallback tier (``priority``: a higher tier gets traffic
only while every endpoint of the lower ones is down or cooling down), and its dialect:

- ``kind="openai"`` (OpenAI, vLLM, SGLang, carpool serve, LiteLLM): ``POST {url}/chat/completions``
  with ``Authorization: Bearer KEY``;
- ``kind="azure"`` (Azure OpenAI, detected from ``*.openai.azure.com`` and
  ``*.cognitiveservices.azure.com``): ``POST {url}/openai/deployments/{deployment}/chat/completions
  ?api-version=...`` with an ``api-key: KEY`` header, as Azure documents it.

OpenAI's reasoning models (o1, o3, o4-mini, gpt-5, ...) refuse ``max_tokens`` and want
``max_completion_tokens``; ``wants_max_completion_tokens`` says whether an endpoint gets the
renamed field (asked for, or told from the model name), and ``prepare_limits`` renames it
in a body (a body that already has ``max_completion_tokens`` is sent as it is).

The endpoints file (``carpool.jobs.endpoints_file``) and the plain ``--endpoint`` flags both
end up here; nothing in this module reads files or the environment.
"""

from __future__ import annotations

import base64
import re
import urllib.parse
from dataclasses import dataclass, field

# Azure OpenAI's current GA data-plane version; an endpoint may name another (api_version).
AZURE_API_VERSION = "2024-10-21"
_AZURE_HOSTS = (".openai.azure.com", ".cognitiveservices.azure.com")
# OpenAI model names that refuse max_tokens (its reasoning models): o1, o1-mini, o3-pro,
# o4-mini-2025-04-16, gpt-5, gpt-5-mini, ... (an optional provider prefix, "openai/o3").
_REASONING = re.compile(r"^(?:[\w.-]+/)?(?:o\d+(?:-[\w.-]+)?|gpt-5(?:[.-][\w.-]*)?)$")


def is_azure_url(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname or ""
    return host.endswith(_AZURE_HOSTS)


def is_reasoning_model(model: str | None) -> bool:
    """An OpenAI reasoning model by its name (these refuse ``max_tokens``)."""
    return bool(model) and bool(_REASONING.match(str(model)))


def auth_headers(kind: str, key: str | None) -> dict[str, str]:
    """The header a key goes in: ``api-key`` for Azure, ``Authorization: Bearer`` elsewhere."""
    if not key:
        return {}
    return {"api-key": key} if kind == "azure" else {"Authorization": f"Bearer {key}"}


def split_credentials(url: str) -> tuple[str, str | None]:
    """``url`` without its ``user:password@`` part, and that part as the ``Authorization: Basic``
    value it means (None when the URL holds none).  The credentials leave the URL at once so
    that no message, summary or report that names the endpoint can show them."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, None
    host = parts.netloc.rpartition("@")[2]
    plain = urllib.parse.urlunsplit(parts._replace(netloc=host))
    pair = f"{urllib.parse.unquote(parts.username or '')}:{urllib.parse.unquote(parts.password or '')}"
    return plain, "Basic " + base64.b64encode(pair.encode("utf-8")).decode("ascii")


# RFC 9110's token characters: what a header name may hold.
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def header_problem(name: str, value: str) -> str | None:
    """Why an HTTP header cannot be sent as given (with the fix), or None when it can.

    Checked before a job sends anything: a header that the HTTP library refuses fails every
    request of the job instead, each as an error line."""
    if not _TOKEN.fullmatch(name):
        bad = next((c for c in name if not _TOKEN.fullmatch(c)), "")
        return (f"the name {name!r} holds {bad!r}, which a header name may not; names are letters, digits "
                "and - (e.g. X-Request-Source)")
    if "\r" in value or "\n" in value:
        return ("the value holds a line break (CR or LF), which HTTP forbids; remove it (a value read from a "
                "file or a variable often ends in a newline)")
    for c in value:
        if (ord(c) < 0x20 and c != "\t") or ord(c) == 0x7F:
            return f"the value holds the control character {c!r}, which HTTP forbids; remove it"
        if ord(c) > 0xFF:
            return (f"the value holds {c!r}, which is not Latin-1 (HTTP header values are bytes in Latin-1); "
                    "percent-encode or base64 it as the server expects")
    return None


def has_authorization(headers: dict[str, str]) -> bool:
    return any(k.lower() == "authorization" for k in headers)


@dataclass
class EndpointSpec:
    url: str  # base URL: http://host:8000/v1 (openai) or https://NAME.openai.azure.com (azure)
    model: str | None = None  # sent to this endpoint in place of the task's model (None: the task's)
    headers: dict[str, str] = field(default_factory=dict)  # auth included
    kind: str = "openai"  # openai | azure
    deployment: str | None = None  # azure: the deployment name (default: model)
    api_version: str | None = None  # azure: the api-version query parameter
    weight: float = 1.0
    priority: int = 0  # 0 = primary; higher tiers are fallbacks, used in order
    rpm: float | None = None
    tpm: float | None = None
    max_completion_tokens: bool | None = None  # None: from the model name
    name: str = ""  # how messages and the summary name it (default: the URL)

    def __post_init__(self) -> None:
        # http://user:pass@host: sent as the Basic credentials it means, unless an Authorization
        # header is given as well (the more explicit of the two wins).
        self.url, basic = split_credentials(self.url.rstrip("/"))
        if basic is not None and not has_authorization(self.headers):
            self.headers = {**self.headers, "Authorization": basic}
        if self.kind == "azure":
            self.url = self.url.removesuffix("/openai")
            self.api_version = self.api_version or AZURE_API_VERSION
            self.deployment = self.deployment or self.model
        self.name = self.name or self.url

    def request_url(self, path: str, model: str | None = None) -> str:
        """Where a request of ``path`` (``/chat/completions``, ``/embeddings``) goes; on Azure
        the deployment is in the path (the task's ``model`` when the endpoint names none)."""
        if self.kind == "azure":
            deployment = urllib.parse.quote(self.deployment or model or "", safe="")
            return f"{self.url}/openai/deployments/{deployment}{path}"
        return self.url + path

    def models_url(self) -> str:
        return f"{self.url}/openai/models" if self.kind == "azure" else self.url + "/models"

    @property
    def params(self) -> dict[str, str]:
        """Query parameters every request to this endpoint carries."""
        return {"api-version": self.api_version} if self.kind == "azure" and self.api_version else {}

    def wants_max_completion_tokens(self, model: str | None) -> bool:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return is_reasoning_model(self.model or model)

    def prepare_limits(self, body: dict) -> dict:
        """``body`` with ``max_tokens`` renamed ``max_completion_tokens`` when this endpoint wants
        that (a body that already has ``max_completion_tokens`` is left as it is)."""
        if ("max_tokens" in body and "max_completion_tokens" not in body
                and self.wants_max_completion_tokens(body.get("model"))):
            body = dict(body)
            body["max_completion_tokens"] = body.pop("max_tokens")
        return body


def plain_specs(urls: list[str], api_key: str | None = None, headers: dict[str, str] | None = None,
                api_version: str | None = None, max_completion_tokens: bool | None = None) -> list[EndpointSpec]:
    """The endpoints of ``--endpoint URL`` flags: one key and the same headers for all (an
    endpoint whose URL holds ``user:password@`` is sent those instead of the key); an Azure
    URL gets Azure's dialect."""
    out = []
    for url in urls:
        kind = "azure" if is_azure_url(url) else "openai"
        key = None if kind == "openai" and split_credentials(url)[1] is not None else api_key
        out.append(EndpointSpec(url, headers={**auth_headers(kind, key), **(headers or {})}, kind=kind,
                                api_version=api_version, max_completion_tokens=max_completion_tokens))
    return out
