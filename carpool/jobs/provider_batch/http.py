"""The HTTP calls of the batch clients: retries with backoff, and the one call not to repeat.

Reads (status, results, listing) and uploads are retried on 429, 5xx and lost connections,
with the server's ``retry-after`` when it gives one.  A batch *create* is retried only
when it certainly did not happen (a 429, a connection never made): after a timeout or a
5xx the batch may exist, so the caller is told (``MaybeCreated``) and looks it up first.

A URL's ``user:password@`` leaves the URL before anything is sent or said: it becomes the
``Authorization: Basic`` header it means, unless an Authorization header is given (the more
explicit of the two wins), so no message or error names it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from carpool.client.endpoints import has_authorization, split_credentials
from carpool.client.retry import parse_retry_after
from carpool.errors import BatchApiError, MaybeCreated


def _message(status: int, text: str) -> str:
    try:
        doc = json.loads(text)
    except ValueError:
        return f"HTTP {status}: {text[:300]}"
    err = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(err, dict):
        return f"HTTP {status}: {err.get('type') or err.get('code') or ''}: {err.get('message', '')}".strip()
    return f"HTTP {status}: {text[:300]}"


class Http:
    """One aiohttp session with the provider's headers; ``say`` is told about waits."""

    def __init__(self, headers: dict[str, str], say: Callable[[str], None] | None = None,
                 attempts: int = 8, first_wait_s: float = 1.0, max_wait_s: float = 60.0):
        self.headers = headers
        self.say = say
        self.attempts, self.first_wait_s, self.max_wait_s = attempts, first_wait_s, max_wait_s
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600, sock_connect=30))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def call(self, method: str, url: str, *, create: bool = False, into: Path | None = None,
                   data: Callable[[], Any] | None = None, **kw: Any) -> Any:
        """The decoded JSON of a 2xx answer, or with ``into`` its body streamed into that file (a
        results file can be larger than memory should hold); ``data`` makes a fresh body for each
        attempt (a multipart form is used up by one).  Raises ``BatchApiError`` /
        ``MaybeCreated`` (``create``) as the module says."""
        url, basic = split_credentials(url)
        headers = self.headers if basic is None or has_authorization(self.headers) else \
            {**self.headers, "Authorization": basic}
        wait = self.first_wait_s
        for attempt in range(1, self.attempts + 1):
            delay: float | None = None
            try:
                if data is not None:
                    kw["data"] = data()
                async with self.session().request(method, url, headers=headers, **kw) as resp:
                    if resp.status < 300 and into is not None:
                        with open(into, "wb") as f:
                            async for chunk in resp.content.iter_chunked(1 << 20):
                                f.write(chunk)
                        return into
                    body = await resp.read()
                    if resp.status < 300:
                        return json.loads(body or b"null")
                    text = body.decode("utf-8", "replace")
                    retryable = resp.status == 429 or (resp.status >= 500 and not create)
                    if not retryable or attempt == self.attempts:
                        cls = MaybeCreated if create and resp.status >= 500 else BatchApiError
                        raise cls(f"{method} {url}: {_message(resp.status, text)}", resp.status)
                    delay = parse_retry_after(resp.headers.get("retry-after"))
                    why = _message(resp.status, text)
            except aiohttp.ClientConnectorError as e:  # never reached the server: nothing happened
                if attempt == self.attempts:
                    raise BatchApiError(f"{method} {url}: cannot connect ({e})") from None
                why = f"cannot connect ({e})"
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                if create:
                    raise MaybeCreated(f"{method} {url}: no answer ({type(e).__name__}: {e})") from None
                if attempt == self.attempts:
                    raise BatchApiError(f"{method} {url}: no answer ({type(e).__name__}: {e})") from None
                why = f"no answer ({type(e).__name__})"
            pause = delay if delay is not None else wait
            if self.say is not None:
                self.say(f"{method} {url}: {why}; retrying in {pause:.1f} s")
            await asyncio.sleep(pause)
            wait = min(wait * 2, self.max_wait_s)
        raise AssertionError("unreachable")
