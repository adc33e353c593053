"""Real servers on free ports over one shared tiny engine (loading it once keeps the room fast)."""

from __future__ import annotations

import importlib.util

import pytest

from carpool.engine.config import EngineConfig
from carpool.server import ServerConfig, start_server
from carpool.testing.fixtures import running_engine

TINY = EngineConfig(model="tiny-random", max_num_seqs=8, max_num_batched_tokens=512, num_kv_blocks=256)


def embedder_available() -> bool:
    return all(importlib.util.find_spec(m) is not None
               for m in ("carpool.embed.embedder", "carpool.embed.dynamic_batcher"))


@pytest.fixture(scope="session")
def tiny_config() -> EngineConfig:
    return TINY


@pytest.fixture(scope="session")
def tiny_engine():
    with running_engine(TINY) as engine:
        yield engine


@pytest.fixture(scope="session")
def server(tiny_engine):
    """The main server: tiny engine, embeddings on, no API key."""
    cfg = ServerConfig(engine=TINY, port=0, embedding_model="all-MiniLM-L6-v2" if embedder_available() else None)
    with start_server(cfg, engine=tiny_engine) as srv:
        yield srv


@pytest.fixture()
def openai_client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def batch_server(tiny_engine, tmp_path_factory):
    """A server with the Files and Batches API on a directory of its own, one per test module."""
    cfg = ServerConfig(engine=TINY, port=0, embedding_model=None, batch_dir=str(tmp_path_factory.mktemp("batches")),
                       max_batch_requests=300, batch_max_inflight=4)
    with start_server(cfg, engine=tiny_engine) as srv:
        yield srv


@pytest.fixture()
def client(batch_server):
    """The openai SDK's client of ``batch_server``."""
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=batch_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
