"""API keys and who owns what: each key is a project that sees only its own files and batches.

``carpool serve --api-key A --api-key B`` takes either key; a file or batch created with A
is A's, and B gets a 404 for it, never finds it in a list, and cannot start a batch on
A's input file -- OpenAI's projects, one per key.  One key works as before (every object is
its one project's); no key, no owners (every object is everyone's).  Objects created
while the server took no key have no owner and stay visible to every key.

The owner is named by a hash of its key (scrypt, so a stolen store does not give keys back
cheaply), made once per key at start; the key itself is never written to the store, a
file or a log.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from aiohttp import web

from carpool.errors import OpenAIError

# The request's owner, set by the auth middleware (a typed key where aiohttp has them, 3.12+).
OWNER: Any = web.RequestKey("carpool_owner", str) if hasattr(web, "RequestKey") else "carpool_owner"
_SALT = b"carpool serve: the owner of files and batches"


def owner_of(key: str) -> str:
    digest = hashlib.scrypt(key.encode("utf-8", "surrogatepass"), salt=_SALT, n=1 << 14, r=8, p=1, dklen=16)
    return "key-" + digest.hex()


def request_owner(request: web.Request) -> str:
    """The owner of what ``request`` creates ('' when the server takes no key)."""
    return request.get(OWNER, "")


def request_reader(request: web.Request) -> str | None:
    """Whose objects ``request`` may see: its key's and those of no owner, or every object
    (None) when the server takes no key."""
    return request.get(OWNER)


class Keys:
    """The API keys a server takes, each with its owner."""

    def __init__(self, keys: list[str]) -> None:
        self._owners = [(k.encode("utf-8", "surrogatepass"), owner_of(k)) for k in dict.fromkeys(keys)]

    def owner(self, token: bytes) -> str | None:
        """The owner of the key ``token``, None when it is no key of this server.  Every key is
        compared, in constant time, whichever matches: the time says nothing of which did."""
        found = None
        for key, owner in self._owners:
            if hmac.compare_digest(token, key):
                found = owner
        return found


def auth_middleware(keys: Keys):
    @web.middleware
    async def check(request: web.Request, handler):
        if request.path != "/health":
            header = request.headers.get("Authorization", "")
            scheme, _, token = header.strip().partition(" ")
            # The scheme is case-insensitive (RFC 9110 11.1): "bearer KEY" is as good as "Bearer KEY".
            given = token.strip().encode("utf-8", "surrogateescape") if scheme.lower() == "bearer" else b""
            owner = keys.owner(given) if given else None
            if owner is None:
                what = "provided" if header else "missing; send 'Authorization: Bearer <key>'"
                raise OpenAIError(401, f"Incorrect API key {what}.", code="invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"})
            request[OWNER] = owner
        return await handler(request)

    return check
