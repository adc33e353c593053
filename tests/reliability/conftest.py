"""Fixtures of the reliability room: fault servers that log per task, one tiny engine."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from reliability_helpers import ThreadedLoggingServer

from carpool.engine.config import EngineConfig
from carpool.testing.fault_server import FaultConfig


@pytest.fixture
def logging_fault_server():
    started: list[ThreadedLoggingServer] = []

    def start(config: FaultConfig | None = None) -> ThreadedLoggingServer:
        srv = ThreadedLoggingServer(config)
        srv.start()
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


# max_model_len 256 so "past the context" is cheap to reach.
TINY = EngineConfig(model="tiny-random", max_num_seqs=8, max_model_len=256, num_kv_blocks=128)


@pytest.fixture(scope="session")
def tiny_config() -> EngineConfig:
    return TINY


@pytest.fixture(scope="session")
def tiny_engine():
    """One tiny-random engine for the room (loading costs seconds on a busy machine)."""
    from carpool.engine import AsyncEngine

    engine = AsyncEngine(TINY).start_sync()
    yield engine
    asyncio.run(engine.shutdown())


