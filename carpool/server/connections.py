"""Connection hygiene: a cap with a clean refusal, OpenAI error bodies for protocol errors,
timeouts, and rate-limited logging (a flood of ~20k silent connections used to exhaust the
file descriptors, /health timed out and the log took 328k tracebacks in 45 s).

- ``GuardedSite`` listens like aiohttp's ``TCPSite``; past ``max_connections`` open
  connections a new one gets a 503 OpenAI error body with ``Retry-After`` and is closed,
  so there is always a descriptor left for the ones being served.
- Idle and header timeouts: aiohttp's ``keepalive_timeout`` runs from the moment a
  connection opens, so one that sends no (complete) request is closed after it too; the
  launcher passes ``ServerConfig.idle_timeout_s``.  The body read has its own timeout
  (``server.http.read_json``).
- ``OpenAIRequestHandler``: aiohttp answers a request it cannot parse (a bad request line,
  a header too long) itself, in text/plain; this handler answers an OpenAI error body.
- ``RateLimitFilter``: one line per kind (logger + message template) per second; the next
  line of that kind says how many were left out.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import resource
import socket
import time

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from carpool.errors import OpenAIError, StartRefused, bounded


def default_max_connections() -> int:
    """What the process's file-descriptor limit allows, keeping room for files and the engine."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 10_000
    return max(16, min(10_000, soft - 256))


class OpenAIRequestHandler(RequestHandler):
    """aiohttp's connection handler, with protocol-level errors as OpenAI error bodies."""

    __slots__ = ()  # same layout as RequestHandler: an instance's class can be switched to this one

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        plain = super().handle_error(request, status, exc, message)  # logs it; raises if already answering
        if status >= 500:
            err = OpenAIError(status, "internal server error; see the server log", type="server_error")
        else:
            why = str(exc) if exc is not None else (message or "")
            err = OpenAIError(status, bounded(f"bad HTTP request: {why}", 500), code="bad_request")
        resp = web.Response(status=plain.status, body=json.dumps(err.body()).encode(),
                            content_type="application/json")
        resp.force_close()
        return resp


class _Refusal(asyncio.Protocol):
    """Answers a connection past the cap with a 503 and closes it.  The request is read and
    dropped: closing a socket with unread bytes would reset it, and the client might lose
    the answer."""

    def __init__(self, max_connections: int) -> None:
        body = json.dumps(OpenAIError(
            503, f"too many connections (carpool serve's cap is {max_connections:,}); retry shortly",
            code="too_many_connections", type="server_error").body()).encode()
        self._response = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                          b"Retry-After: 1\r\nConnection: close\r\nContent-Length: "
                          + str(len(body)).encode() + b"\r\n\r\n" + body)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(self._response)
        transport.write_eof()  # the answer, then our FIN; the client closes its side
        self._timer = asyncio.get_running_loop().call_later(2.0, transport.close)  # or we do, soon

    def data_received(self, data: bytes) -> None:
        pass  # the request is not served

    def eof_received(self) -> bool:
        return False  # the client is done too: close

    def connection_lost(self, exc: Exception | None) -> None:
        self._timer.cancel()


def check_bindable(host: str, port: int) -> None:
    """Refuse (``StartRefused``) a host:port the server could not listen on (the port taken, a
    port below 1024 without the right, a host this machine does not have) before the engine
    loads: a server that cannot listen says so in a moment, not after loading its model.  A
    fixed port only (0 lets the OS choose at start)."""
    if port == 0:
        return
    try:
        for family, kind, proto, _, addr in socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                               flags=socket.AI_PASSIVE):
            with socket.socket(family, kind, proto) as sock:
                # As the server's own socket: a port in TIME_WAIT binds, one another process listens on does not.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(addr)
    except OSError as e:
        fix = ("choose another port, or stop what listens there" if e.errno == errno.EADDRINUSE
               else "choose a port above 1023" if e.errno == errno.EACCES
               else "give one of this machine's addresses: 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)")
        raise StartRefused(f"cannot listen on {host}:{port}: {e.strerror or e}; {fix}") from None


class GuardedSite(web.BaseSite):
    """``TCPSite`` with a connection cap and ``OpenAIRequestHandler`` connections."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, backlog: int = 1024,
                 max_connections: int | None = None) -> None:
        super().__init__(runner, backlog=backlog)
        self._host, self._port = host, port
        self.max_connections = max_connections or default_max_connections()
        self.refused = 0  # connections refused at the cap
        self._log = logging.getLogger("carpool.server")

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    def _protocol(self) -> asyncio.Protocol:
        server = self._runner.server
        assert server is not None
        if len(server.connections) >= self.max_connections:
            self.refused += 1
            self._log.warning("refused a connection: %d open, the cap is %d", len(server.connections),
                              self.max_connections)
            return _Refusal(self.max_connections)
        handler = server()
        handler.__class__ = OpenAIRequestHandler  # same slots; only handle_error differs
        return handler

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._protocol, self._host, self._port, backlog=self._backlog,
                                                reuse_address=True)

    @property
    def port(self) -> int:
        """The bound port (the one the OS picked when 0 was asked)."""
        server = self._server  # the asyncio.Server start() made (the base class types it abstractly)
        return server.sockets[0].getsockname()[1] if isinstance(server, asyncio.Server) and server.sockets else 0


class RateLimitFilter(logging.Filter):
    """At most one record per (logger, message template) per ``interval_s``; the next one that
    passes says how many were dropped meanwhile (and a dropped record's traceback is not formatted)."""

    def __init__(self, interval_s: float = 1.0) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._last: dict[tuple[str, str], float] = {}
        self._dropped: dict[tuple[str, str], int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        now = time.monotonic()
        if now - self._last.get(key, -1e9) < self.interval_s:
            self._dropped[key] = self._dropped.get(key, 0) + 1
            return False
        self._last[key] = now
        dropped = self._dropped.pop(key, 0)
        if dropped:
            record.msg = f"{record.msg} [and {dropped} more like it in the last {self.interval_s:g} s, not shown]"
        if len(self._last) > 10_000:  # message templates are few; never let odd ones grow this
            self._last.clear()
        return True


_LOGGERS = ("aiohttp.server", "aiohttp.access", "aiohttp.web", "asyncio", "carpool.server")


def rate_limit_logging(interval_s: float = 1.0) -> RateLimitFilter:
    """Put one ``RateLimitFilter`` on the loggers a flood of bad connections writes to."""
    f = RateLimitFilter(interval_s)
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(x, RateLimitFilter) for x in logger.filters):
            logger.addFilter(f)
    return f
