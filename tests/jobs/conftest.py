"""Fault-injecting servers on free ports, stopped after each test."""

import pytest

from carpool.testing.fault_server import ThreadedFaultServer


@pytest.fixture
def fault_server():
    started = []

    def start(config=None) -> ThreadedFaultServer:
        srv = ThreadedFaultServer(config)
        srv.start()
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


@pytest.fixture(scope="session")
def engine():
    """One tiny-random engine for the room (loading it once keeps the tests fast)."""
    import asyncio

    from carpool.engine import AsyncEngine, EngineConfig

    eng = AsyncEngine(EngineConfig(model="tiny-random", max_num_seqs=16, max_model_len=256)).start_sync()
    yield eng
    asyncio.run(eng.shutdown())
