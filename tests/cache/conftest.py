"""Fixtures for the cache room: a real redis-server and the real MiniLM embedder."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A redis-server of this session on a free port, no persistence; yields its URL base."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server binary not found; scripts/test.sh installs it (apt-get install -y redis-server)")
    import redis

    port = _free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path_factory.mktemp("redis"))],
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
    yield f"redis://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def embedder():
    """The engine's all-MiniLM-L6-v2 embedder (packaged weights, no network)."""
    from carpool.engine.embedder import Embedder

    return Embedder()
