"""Fixtures for the distributed room: a real redis-server and one local Ray cluster."""

from __future__ import annotations

import os
import time

import pytest

from carpool.compat import Self
from carpool.testing.fixtures import running_redis


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A throwaway redis-server on a free port (no persistence), for the whole session."""
    with running_redis(tmp_path_factory.mktemp("redis")) as port:
        if port is None:
            pytest.skip("redis-server binary not found; scripts/test.sh installs it (apt-get install -y redis-server)")
        yield f"redis://127.0.0.1:{port}/0"


@pytest.fixture
def redis_name(request) -> str:
    """A key namespace of its own for each test, so tests never share Redis state."""
    return f"t-{request.node.name}-{os.getpid()}-{time.monotonic_ns()}"


@pytest.fixture(scope="session")
def ray_cluster():
    """One local 2-CPU Ray cluster for the session (Ray startup takes seconds)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


class RateWindowServer:
    """A fault server that enforces a provider limit: at most ``limit`` requests in any
    ``window_s`` seconds (sliding), 429 with Retry-After past it.  It keeps every arrival
    time so a test can check the worst window afterwards."""

    def __init__(self, limit: int, window_s: float):
        from carpool.testing.fault_server import FaultConfig, FaultServer, ThreadedFaultServer

        outer = self

        class _Server(FaultServer):
            async def _handle(self, request):
                now = time.monotonic()
                recent = [t for t in outer.arrivals if now - t < outer.window_s]
                outer.arrivals.append(now)
                if len(recent) >= outer.limit:
                    outer.rejected += 1
                    return self._error(429, "rate limit reached for requests", outer.window_s)
                return await super()._handle(request)

        self.limit, self.window_s = limit, window_s
        self.arrivals: list[float] = []
        self.rejected = 0
        self._threaded = ThreadedFaultServer(FaultConfig.zero())
        self._threaded.server = _Server(FaultConfig.zero())

    def max_in_window(self) -> int:
        """The most arrivals in any window of ``window_s`` (sliding, starting at an arrival)."""
        ts = sorted(self.arrivals)
        best, j = 0, 0
        for i in range(len(ts)):
            while ts[i] - ts[j] >= self.window_s:
                j += 1
            best = max(best, i - j + 1)
        return best

    @property
    def url(self) -> str:
        return self._threaded.url

    @property
    def server(self):
        return self._threaded.server

    def __enter__(self) -> Self:
        self._threaded.start()
        return self

    def __exit__(self, *exc) -> None:
        self._threaded.stop()


@pytest.fixture
def rate_window_server():
    """``rate_window_server(limit, window_s)``: a started RateWindowServer, stopped after the test."""
    started: list[RateWindowServer] = []

    def make(limit: int, window_s: float) -> RateWindowServer:
        srv = RateWindowServer(limit, window_s).__enter__()
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.__exit__(None, None, None)
