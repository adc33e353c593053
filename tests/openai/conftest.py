"""One tiny-random engine for the translation tests (the translator counts tokens with it)."""

from __future__ import annotations

import pytest

from carpool.engine.config import EngineConfig
from carpool.testing.fixtures import running_engine


@pytest.fixture(scope="session")
def engine():
    with running_engine(EngineConfig(model="tiny-random", max_num_seqs=8, max_model_len=128)) as eng:
        yield eng
