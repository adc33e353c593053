"""Any of the test servers on its own event loop in a daemon thread.

The fault and replay servers are aiohttp apps with async ``start``/``stop``; sync tests,
subprocess helpers and benchmarks want them running beside their own code.  One wrapper
serves both (and any server with the same three members).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from carpool.compat import Self


class ThreadedServer:
    """Runs ``server`` on a private loop in a daemon thread; ``start()`` returns its URL."""

    def __init__(self, server: Any):
        self.server = server
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def start(self) -> str:
        self._thread.start()
        return asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result(10)

    def stop(self) -> None:
        """Stops the server and its loop; a second call (a test that took a server down, then
        the fixture's own stop) does nothing."""
        if not self._loop.is_running():
            return
        asyncio.run_coroutine_threadsafe(self.server.stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    @property
    def url(self) -> str:
        return self.server.url

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
