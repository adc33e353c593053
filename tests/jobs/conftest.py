"""Fault-injecting servers on free ports, stopped after each test."""

import os
import sys

import pytest

from carpool.testing.fault_server import ThreadedFaultServer
from carpool.testing.fixtures import running_engine, started_servers

sys.path.insert(0, os.path.dirname(__file__))  # job_helpers


@pytest.fixture
def fault_server():
    with started_servers(ThreadedFaultServer) as start:
        yield start


@pytest.fixture(scope="session")
def engine():
    """One tiny-random engine for the room (loading it once keeps the tests fast)."""
    from carpool.engine import EngineConfig

    with running_engine(EngineConfig(model="tiny-random", max_num_seqs=16, max_model_len=256)) as eng:
        yield eng
