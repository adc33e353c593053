"""Batch lines are counted in engine work, not in lines: a batch whose lines ask for ``n`` sequences
each never holds more than its share of the engine's seats, so an online request always finds one."""

from __future__ import annotations

import pytest

from carpool.server import ServerConfig, start_server
from carpool.testing.batch_client import output_lines, request_line, start_batch, wait_final, wait_until

openai = pytest.importorskip("openai")


def test_lines_with_n_never_fill_the_engine_and_an_online_request_gets_through(tiny_engine, tiny_config,
                                                                                 tmp_path):
    seats = tiny_config.max_num_seqs  # 8: the batch share is 6 of them
    steps: list[int] = []
    recording = [True]

    def listen(info: dict) -> None:
        if recording[0]:
            steps.append(info["num_running"])

    tiny_engine.add_step_listener(listen)
    cfg = ServerConfig(engine=tiny_config, port=0, embedding_model=None, batch_dir=str(tmp_path))
    try:
        with start_server(cfg, engine=tiny_engine) as srv:
            client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
            lines = [request_line(i, max_tokens=48, **{}) for i in range(8)]
            for x in lines:
                x["body"].update(n=4, ignore_eos=True)
            batch = start_batch(client, lines)
            wait_until(client, batch.id, lambda b: b.status == "in_progress")
            online = client.chat.completions.create(model="tiny-random", max_tokens=1,
                                                    messages=[{"role": "user", "content": "quick"}])
            assert online.choices[0].finish_reason == "length"
            done = wait_final(client, batch.id)
            assert (done.status, done.request_counts.completed) == ("completed", 8)
            assert all(len(x["response"]["body"]["choices"]) == 4 for x in output_lines(client, done.output_file_id))
    finally:
        recording[0] = False
    assert any(r > 1 for r in steps), "the batch never ran"
    # 4 sequences a line and 6 of 8 seats for the batch: one line in the engine at a time, plus the
    # online request, which found a seat free.
    assert max(steps) < seats


def test_a_line_larger_than_the_whole_share_still_runs_alone(tiny_engine, tiny_config, tmp_path):
    cfg = ServerConfig(engine=tiny_config, port=0, embedding_model=None, batch_dir=str(tmp_path),
                       batch_max_seqs=2)
    with start_server(cfg, engine=tiny_engine) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        big = request_line(0, max_tokens=4)
        big["body"]["n"] = 5
        done = wait_final(client, start_batch(client, [big, request_line(1), request_line(2)]).id)
        assert (done.status, done.request_counts.completed) == ("completed", 3)
