"""Fault-injecting servers on free ports, stopped after each test."""

import pytest

from carpool.testing.fault_server import ThreadedFaultServer
from carpool.testing.fixtures import started_servers


@pytest.fixture
def fault_server():
    with started_servers(ThreadedFaultServer) as start:
        yield start
