"""Lifecycles several test rooms' fixtures share; each conftest wraps one in a pytest fixture.

``started_servers`` backs the ``fault_server`` / ``logging_fault_server`` fixtures (servers
started on demand inside a test, all stopped after it), ``running_engine`` the one shared
tiny engine a room loads per session, ``running_redis`` the throwaway redis-server of the
cache and distributed rooms.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, TypeVar


class _Startable(Protocol):
    def start(self) -> Any: ...
    def stop(self) -> None: ...


S = TypeVar("S", bound=_Startable)


@contextmanager
def started_servers(factory: Callable[[Any], S]) -> Iterator[Callable[..., S]]:
    """Yields ``start(config=None)``, which builds a server with ``factory`` (from its config:
    a ``FaultConfig``, or another test server's), starts it and returns it; every server
    started that way is stopped when the block ends."""
    started: list[S] = []

    def start(config: Any = None) -> S:
        srv = factory(config)
        srv.start()
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


@contextmanager
def running_engine(config: Any) -> Iterator[Any]:
    """An ``AsyncEngine`` for ``config`` (an ``EngineConfig``), started synchronously and shut
    down when the block ends. The engine is imported here, not at module load, so importing
    this module stays cheap for rooms that never start one."""
    from carpool.engine import AsyncEngine

    engine = AsyncEngine(config).start_sync()
    yield engine
    asyncio.run(engine.shutdown())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_redis(workdir: Path) -> Iterator[int | None]:
    """A redis-server on a free loopback port with no persistence; yields its port, or None
    when the binary is missing (the caller skips: scripts/test.sh installs it)."""
    exe = shutil.which("redis-server")
    if exe is None:
        yield None
        return
    import redis

    port = free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 15
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"redis-server did not start on port {port}") from None
            time.sleep(0.05)
    client.close()
    try:
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)
