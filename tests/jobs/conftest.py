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
