"""The aiohttp lifecycle shared by the local test servers.

Every fake upstream in this package serves one ``web.Application`` on a local host and
port, where port 0 asks the OS for a free one that is read back once the socket is bound.
``LocalSite`` holds the runner behind that; ``LocalAppServer`` adds the members the tests
and ``ThreadedServer`` rely on (``url``, async ``start``/``stop``, ``async with``), so a
server only says which application it serves.
"""

from __future__ import annotations

import logging

from aiohttp import web

from carpool.compat import Self


class LocalSite:
    """One application's runner and TCP site; ``close`` is safe to call twice."""

    def __init__(self) -> None:
        self._runner: web.AppRunner | None = None

    async def open(self, app: web.Application, host: str, port: int, *, backlog: int = 128,
                   access_log: logging.Logger | None = None) -> int:
        """Serves ``app`` and returns the bound port (the OS's pick when ``port`` is 0)."""
        self._runner = web.AppRunner(app, access_log=access_log, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, backlog=backlog)
        await site.start()
        return int(self._runner.addresses[0][1])

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


class LocalAppServer:
    """Base of the async test servers: a subclass builds its application in ``_app``."""

    # How many connections may wait to be accepted; load tests raise it.
    _backlog = 128
    # None keeps the servers quiet; a subclass may log every request.
    _access_log: logging.Logger | None = None

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host, self.port = host, port
        self._site = LocalSite()

    def _app(self) -> web.Application:
        raise NotImplementedError

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> str:
        self.port = await self._site.open(self._app(), self.host, self.port, backlog=self._backlog,
                                          access_log=self._access_log)
        return self.url

    async def stop(self) -> None:
        await self._site.close()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
