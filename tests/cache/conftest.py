"""Fixtures for the cache room: a real redis-server and the real MiniLM embedder."""

from __future__ import annotations

import pytest

from carpool.testing.fixtures import running_redis


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A redis-server of this session on a free port, no persistence; yields its URL base."""
    with running_redis(tmp_path_factory.mktemp("redis")) as port:
        if port is None:
            pytest.skip("redis-server binary not found; scripts/test.sh installs it (apt-get install -y redis-server)")
        yield f"redis://127.0.0.1:{port}"


@pytest.fixture(scope="session")
def embedder():
    """The engine's all-MiniLM-L6-v2 embedder (packaged weights, no network)."""
    from carpool.embed.embedder import Embedder

    return Embedder()
