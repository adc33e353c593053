"""Lifecycles several test rooms' fixtures share; each conftest wraps one in a pytest fixture.

``started_servers`` backs the ``fault_server`` / ``logging_fault_server`` fixtures (servers
started on demand inside a test, all stopped after it), ``running_engine`` the one shared
tiny engine a room loads per session.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

from carpool.testing.fault_server import FaultConfig


class _Startable(Protocol):
    def start(self) -> Any: ...
    def stop(self) -> None: ...


S = TypeVar("S", bound=_Startable)


@contextmanager
def started_servers(factory: Callable[[FaultConfig | None], S]) -> Iterator[Callable[..., S]]:
    """Yields ``start(config=None)``, which builds a server with ``factory``, starts it and
    returns it; every server started that way is stopped when the block ends."""
    started: list[S] = []

    def start(config: FaultConfig | None = None) -> S:
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
