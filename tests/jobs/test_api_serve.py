"""``carpool.run_batch(tasks, endpoint="http://.../v1", model=...)`` against the real
``carpool serve`` (in a thread, over the tiny engine), with ``response_format``: the engine
constrains the answer to the schema and the API hands back the parsed object."""

import pytest

import carpool

server_mod = pytest.importorskip("carpool.server")

LABEL = {"type": "json_schema", "json_schema": {"name": "label", "schema": {
    "type": "object", "properties": {"label": {"enum": ["positive", "negative"]}},
    "required": ["label"], "additionalProperties": False}}}


def test_a_string_endpoint_to_carpool_serve_with_a_schema(engine):
    from carpool.engine.config import EngineConfig
    from carpool.server import ServerConfig, start_server

    cfg = ServerConfig(engine=EngineConfig(model="tiny-random"), port=0, embedding_model=None)
    with start_server(cfg, engine=engine) as srv:
        results = carpool.run_batch(["I loved it", "It broke"], endpoints=srv.base_url + "/v1", model="tiny-random",
                                    response_format=LABEL, max_tokens=48, temperature=0, cache="off",
                                    progress=False)
    assert len(results) == 2
    for r in results:
        assert r["error"] is None and r.text
        assert r.ok, r.parse_error
        assert r.parsed["label"] in ("positive", "negative")
