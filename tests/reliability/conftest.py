"""Fixtures of the reliability room: fault servers that log per task, one tiny engine."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from reliability_helpers import ThreadedLoggingServer

from carpool.engine.config import EngineConfig
from carpool.testing.fixtures import running_engine, started_servers


@pytest.fixture
def logging_fault_server():
    with started_servers(ThreadedLoggingServer) as start:
        yield start


# max_model_len 256 so "past the context" is cheap to reach.
TINY = EngineConfig(model="tiny-random", max_num_seqs=8, max_model_len=256, num_kv_blocks=128)


@pytest.fixture(scope="session")
def tiny_config() -> EngineConfig:
    return TINY


@pytest.fixture(scope="session")
def tiny_engine():
    """One tiny-random engine for the room (loading costs seconds on a busy machine)."""
    with running_engine(TINY) as engine:
        yield engine


