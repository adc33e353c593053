"""The packaged MiniLM is loaded once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def embedder():
    from carpool.embed.embedder import Embedder

    return Embedder()
