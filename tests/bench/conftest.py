"""Fixtures for the bench room: scripted OpenAI-compatible servers on 127.0.0.1."""

from __future__ import annotations

import pytest

from carpool.testing.scripted_server import Script, ScriptedServer


@pytest.fixture
def scripted():
    """Factory: ``scripted(Script(...))`` starts a server in a background thread; all are stopped at teardown."""
    servers: list[ScriptedServer] = []

    def start(script: Script | None = None) -> ScriptedServer:
        srv = ScriptedServer(script or Script()).start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.stop()
