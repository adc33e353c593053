"""One aiohttp session and connection pool for the whole job.

Measured on the zero-latency fault server (benchmarks/client_overhead.py), aiohttp
handles more requests/s per core than httpx's AsyncClient, so the client uses aiohttp;
the benchmark prints both figures.  One ``TCPConnector`` is shared by every endpoint so
connections are reused across requests (keep-alive) and the pool size follows the
concurrency cap rather than the number of tasks.
"""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp


@dataclass
class Timeouts:
    connect_s: float = 10.0  # TCP connect (and pool wait is not counted: the limiter bounds it)
    # Between two reads of a response, and for its first byte.  A queueing server (vLLM or
    # carpool serve past its batch) can keep a request waiting longer than that for its first
    # token and is not hung: the HTTP backend then waits up to twice the slowest first byte its
    # endpoint sent lately (``HttpBackend.read_timeout``), so a queued request is not sent twice.
    read_s: float = 60.0
    total_s: float = 600.0  # one attempt, end to end

    def client_timeout(self) -> aiohttp.ClientTimeout:
        # total and read are enforced by the backend around the whole attempt (the read timeout
        # grows with a queueing server's first bytes: HttpBackend.read_timeout), so each is
        # reported as its own error kind instead of a generic timeout.
        return aiohttp.ClientTimeout(total=None, sock_connect=self.connect_s)


def make_session(max_connections: int = 0, timeouts: Timeouts | None = None, *, fresh_connections: bool = False,
                 trace_configs: list[aiohttp.TraceConfig] | None = None) -> aiohttp.ClientSession:
    """``max_connections`` 0: unlimited (the concurrency limiter is the real bound).
    ``fresh_connections``: a new TCP connection per request, what a client without a pool pays (bench)."""
    # aiohttp refuses a keep-alive timeout together with force_close
    reuse = {"force_close": True} if fresh_connections else {"keepalive_timeout": 60}
    connector = aiohttp.TCPConnector(
        limit=max_connections,
        limit_per_host=0,
        ttl_dns_cache=300,
        enable_cleanup_closed=False,
        **reuse,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=(timeouts or Timeouts()).client_timeout(),
        auto_decompress=True,
        raise_for_status=False,
        skip_auto_headers=("User-Agent",),
        trace_configs=trace_configs,
    )
