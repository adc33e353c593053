"""What an endpoint says it serves (``GET /v1/models``), and the identity of a served model.

The identity is what the run fingerprint and the cache keys name instead of a URL, so a
replica of the same model (another URL) shares a job's cache and may resume its output,
while a model re-deployed under the same name does not pass for the old one.  From a
model card it takes:

- ``id`` (the name requests use), ``owned_by`` and ``root`` (vLLM and carpool serve: the
  weights the name points at; a name moved to other weights changes it);
- ``created`` only when the card has no ``root`` and the stamp is older than
  ``VOLATILE_CREATED_S``: hosted APIs (OpenAI) give the model's creation date there, but
  vLLM and SGLang stamp the time of the request and carpool serve its own start, which
  would make every restart or replica look like another model.

``--cache-namespace`` is not part of the identity: it is a key component of its own
(``carpool.cache.keys``), beside the identity, and not in the run fingerprint.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

VOLATILE_CREATED_S = 24 * 3600.0


@dataclass(frozen=True)
class ModelIdentity:
    """One served model as the fingerprint and the cache keys see it."""

    name: str  # the model name the tasks send (or the embedded engine's model)
    kind: str = "http"  # http | engine | echo
    served_id: str | None = None  # the card's id (None: the endpoint could not be asked)
    owned_by: str | None = None
    root: str | None = None
    created: int | None = None  # only when it dates the model (see the module docstring)

    def doc(self) -> dict:
        """The fields that identify the model, for the sidecar file (JSON)."""
        d: dict = {"kind": self.kind, "name": self.name}
        for k in ("served_id", "owned_by", "root", "created"):
            v = getattr(self, k)
            if v is not None:
                d[k] = v
        return d

    def cache_identity(self) -> str:
        """What the cache keys hold in place of the endpoint (never a URL)."""
        return json.dumps(self.doc(), sort_keys=True, separators=(",", ":"))


@dataclass
class ModelList:
    """The answer of one endpoint's ``/models``: its cards, or why there are none."""

    url: str
    cards: list[dict] = field(default_factory=list)
    error: str | None = None  # "HTTP 404", "cannot connect: ...": the list is unknown

    @property
    def ids(self) -> list[str]:
        return [str(c.get("id")) for c in self.cards if c.get("id") is not None]

    def card(self, model: str) -> dict | None:
        return next((c for c in self.cards if c.get("id") == model), None)


def identity_from_card(name: str, card: dict | None, now: float | None = None) -> ModelIdentity:
    if card is None:
        return ModelIdentity(name=name)
    root = card.get("root") if isinstance(card.get("root"), str) else None
    created = card.get("created")
    now = time.time() if now is None else now
    dated = (root is None and isinstance(created, int) and not isinstance(created, bool)
             and now - created > VOLATILE_CREATED_S)
    owned = card.get("owned_by")
    return ModelIdentity(name=name, served_id=str(card.get("id")), owned_by=owned if isinstance(owned, str) else None,
                         root=root, created=created if dated else None)


async def list_models(session: aiohttp.ClientSession, base_url: str, headers: dict[str, str] | None = None,
                      params: dict[str, str] | None = None, timeout_s: float = 10.0) -> ModelList:
    """``GET {base_url}/models``; never raises: a failure is the list's ``error``."""
    url = base_url.rstrip("/") + "/models"
    out = ModelList(base_url)

    async def get() -> tuple[int, bytes]:
        async with session.get(url, headers=headers or {}, params=params) as resp:
            return resp.status, await resp.read()

    try:
        status, raw = await asyncio.wait_for(get(), timeout_s)
    except (TimeoutError, asyncio.TimeoutError):
        out.error = f"no answer within {timeout_s:g}s"
        return out
    except aiohttp.ClientError as e:
        out.error = f"cannot connect: {e}"
        return out
    except ValueError as e:  # the HTTP library refused the request itself (a header, the URL)
        out.error = f"the request could not be sent: {e}"
        return out
    if status != 200:
        out.error = f"HTTP {status}"
        return out
    try:
        doc = json.loads(raw)
    except ValueError:
        out.error = "the answer is not JSON"
        return out
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        out.error = "the answer has no 'data' list"
        return out
    out.cards = [c for c in data if isinstance(c, dict)]
    return out
