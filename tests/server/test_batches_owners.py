"""Several API keys on one server, each a project of its own: it sees only the files and batches
created with it, as OpenAI's projects do.  No key is written to the batch directory."""

from __future__ import annotations

import argparse

import pytest

from carpool.commands.serve import add_arguments, config_from_args
from carpool.server import ServerConfig, start_server
from carpool.testing.batch_client import output_lines, request_line, upload, wait_final

openai = pytest.importorskip("openai")

ALPHA, BETA = "sk-alpha-4f9c2e71d0", "sk-beta-83b6a5c2e4"


def test_each_key_sees_only_what_it_created(tiny_engine, tiny_config, tmp_path):
    cfg = ServerConfig(engine=tiny_config, port=0, embedding_model=None, batch_dir=str(tmp_path),
                       api_keys=[ALPHA, BETA])
    with start_server(cfg, engine=tiny_engine) as srv:
        a, b = (openai.OpenAI(base_url=srv.base_url + "/v1", api_key=k, max_retries=0, timeout=60)
                for k in (ALPHA, BETA))
        fa, fb = upload(a, [request_line(0)]), upload(b, [request_line(1)])
        assert [f.id for f in a.files.list()] == [fa.id] and [f.id for f in b.files.list()] == [fb.id]
        for call in (b.files.retrieve, b.files.content, b.files.delete):
            with pytest.raises(openai.NotFoundError):
                call(fa.id)
        with pytest.raises(openai.NotFoundError):  # another project's file is no input of mine
            b.batches.create(input_file_id=fa.id, endpoint="/v1/chat/completions", completion_window="24h")
        batch = a.batches.create(input_file_id=fa.id, endpoint="/v1/chat/completions", completion_window="24h")
        for call in (b.batches.retrieve, b.batches.cancel):
            with pytest.raises(openai.NotFoundError):
                call(batch.id)
        assert [x.id for x in b.batches.list()] == []
        done = wait_final(a, batch.id)
        assert [x.id for x in a.batches.list()] == [batch.id]
        assert [x["custom_id"] for x in output_lines(a, done.output_file_id)] == ["task-0"]
        with pytest.raises(openai.NotFoundError):
            b.files.content(done.output_file_id)
        assert {f.id for f in a.files.list()} == {fa.id, done.output_file_id}
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.base_url + "/v1", api_key="sk-nobody", max_retries=0).files.list()
    for path in tmp_path.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert ALPHA.encode() not in data and BETA.encode() not in data, path


def test_a_server_restarted_without_keys_shows_every_object(tiny_engine, tiny_config, tmp_path):
    """No key, no owners: what was created under a key is everyone's once the server takes none."""
    keyed = ServerConfig(engine=tiny_config, port=0, embedding_model=None, batch_dir=str(tmp_path),
                         api_keys=[ALPHA])
    with start_server(keyed, engine=tiny_engine) as srv:
        a = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=ALPHA, max_retries=0, timeout=60)
        made = upload(a, [request_line(0)])
        batch = a.batches.create(input_file_id=made.id, endpoint="/v1/chat/completions", completion_window="24h")
        wait_final(a, batch.id)
    open_cfg = ServerConfig(engine=tiny_config, port=0, embedding_model=None, batch_dir=str(tmp_path))
    with start_server(open_cfg, engine=tiny_engine) as srv:
        anyone = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert made.id in {f.id for f in anyone.files.list()}
        assert anyone.files.retrieve(made.id).id == made.id
        assert [x.id for x in anyone.batches.list()] == [batch.id]


def test_the_api_key_flag_takes_several_keys(monkeypatch):
    monkeypatch.delenv("CARPOOL_API_KEY", raising=False)
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert config_from_args(p.parse_args(["--api-key", ALPHA, "--api-key", BETA])).keys() == [ALPHA, BETA]
    monkeypatch.setenv("CARPOOL_API_KEY", ALPHA)
    assert config_from_args(p.parse_args([])).keys() == [ALPHA]
