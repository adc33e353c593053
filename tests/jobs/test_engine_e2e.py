"""End to end on the real in-process engine (tiny-random: random weights, real tokenizer)."""

import json

import pytest

from carpool.jobs.python_api.run import run_batch


def read(path):
    return [json.loads(x) for x in open(path)]


def test_engine_run_writes_openai_batch_output(engine, tmp_path):
    src = tmp_path / "in.jsonl"
    with open(src, "w") as f:
        f.writelines(json.dumps({"custom_id": f"c{i}", "temperature": 0, "max_tokens": 5,
                                "messages": [{"role": "user", "content": f"Is review {i} positive?"}]}) + "\n"
                               for i in range(12))
        f.write(json.dumps({"custom_id": "p", "prompt": "Once upon a time", "max_tokens": 3}) + "\n")
    out = tmp_path / "out.jsonl"
    s = run_batch(src, out, engine=engine, cache="off")
    rows = {d["custom_id"]: d for d in read(out)}
    assert len(rows) == 13 and s["ok"] == 13
    body = rows["c3"]["response"]["body"]
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 5
    assert rows["p"]["response"]["body"]["object"] == "text_completion"
    assert s["ttft_ms_p50"] is not None and s["completion_tokens"] == 12 * 5 + 3
    # Greedy: the same prompt gives the same text again (through the cache-free path).
    s2 = run_batch(src, tmp_path / "again.jsonl", engine=engine, cache="off")
    again = {d["custom_id"]: d for d in read(tmp_path / "again.jsonl")}
    assert again["c3"]["response"]["body"]["choices"] == body["choices"] and s2["ok"] == 13


def test_prompt_past_context_is_a_bad_line(engine, tmp_path):
    src = tmp_path / "in.jsonl"
    long_text = "word " * 400  # far past max_model_len=256
    with open(src, "w") as f:
        f.write(json.dumps({"custom_id": "ok", "temperature": 0, "max_tokens": 2,
                            "messages": [{"role": "user", "content": "hi"}]}) + "\n")
        f.write(json.dumps({"custom_id": "long", "max_tokens": 2,
                            "messages": [{"role": "user", "content": long_text}]}) + "\n")
    out = tmp_path / "out.jsonl"
    s = run_batch(src, out, engine=engine, cache="off")
    rows = {d["custom_id"]: d for d in read(out)}
    err = rows["long"]["error"]
    assert err["code"] == "invalid_input" and err["line"] == 2 and err["field"] == "messages"
    assert "context" in err["message"]
    assert rows["ok"]["error"] is None and s["ok"] == 1


def test_engine_with_sqlite_cache_and_dedup(engine, tmp_path):
    src = tmp_path / "in.jsonl"
    with open(src, "w") as f:
        f.writelines(json.dumps({"custom_id": f"x{i}", "temperature": 0, "max_tokens": 3,
                                "messages": [{"role": "user", "content": f"q{i % 2}"}]}) + "\n" for i in range(6))
    cache = f"sqlite:///{tmp_path / 'c.sqlite'}"
    s1 = run_batch(src, tmp_path / "a.jsonl", engine=engine, cache=cache)
    assert s1["sent"] == 2 and s1["dedup_fanouts"] + s1["cache_hits"] == 4
    s2 = run_batch(src, tmp_path / "b.jsonl", engine=engine, cache=cache)
    assert s2["sent"] == 0 and s2["cache_hits"] == 6


def test_embedding_tasks_on_the_embedder(engine, tmp_path):
    pytest.importorskip("carpool.embed.embedder")
    src = tmp_path / "emb.jsonl"
    with open(src, "w") as f:
        f.writelines(json.dumps({"custom_id": f"e{i}", "input": f"sentence number {i}"}) + "\n" for i in range(5))
    out = tmp_path / "out.jsonl"
    s = run_batch(src, out, engine=engine, cache="off")
    rows = read(out)
    assert s["ok"] == 5
    assert all(len(r["response"]["body"]["data"][0]["embedding"]) == 384 for r in rows)


def test_each_prompt_is_templated_once(engine, tmp_path, monkeypatch):
    # The admission check counts the prompt's tokens; the call and the engine reuse them
    # (templating ran three times a task before: ~1.4 ms of the event loop's time each).
    tok = engine.tokenizer
    calls = []
    real = tok.apply_chat_template

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(tok, "apply_chat_template", counted)
    src = tmp_path / "in.jsonl"
    with open(src, "w") as f:
        f.writelines(json.dumps({"custom_id": f"t{i}", "temperature": 0, "max_tokens": 3,
                                "messages": [{"role": "user", "content": f"Rate product {i}."}]}) + "\n"
                     for i in range(8))
    s = run_batch(src, tmp_path / "out.jsonl", engine=engine, cache="off")
    assert s["ok"] == 8 and s["prompt_tokens"] > 0
    assert len(calls) == 8


def test_a_second_call_of_a_checked_request_is_answered_in_full(engine):
    # A retry must not reuse the choices of the first attempt (they hold its answer already).
    import asyncio

    from carpool.client.base import Refused, Request
    from carpool.client.engine_backend import EngineBackend

    backend = EngineBackend(engine)
    req = Request("r", "chat", {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4,
                                "temperature": 0, "ignore_eos": True})
    prepared = backend.check(req)
    assert prepared is not None and not isinstance(prepared, Refused)

    async def twice():  # the executor gives what the check prepared to the first attempt only
        return await backend.call(req, prepared=prepared), await backend.call(req)

    first, second = asyncio.run(twice())
    assert first.ok and second.ok and first.request_id != second.request_id
    assert first.body["choices"] == second.body["choices"]
    assert first.completion_tokens == second.completion_tokens == 4


def test_the_summary_says_how_long_the_engine_took_to_start(tmp_path):
    # benchmarks/main_job.py sets it apart from the job's throughput: LLM.generate starts its clock later.
    from carpool.engine import AsyncEngine, EngineConfig

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
                   + "\n")
    fresh = AsyncEngine(EngineConfig(model="tiny-random", max_num_seqs=4, max_model_len=128))
    try:
        s = run_batch(src, tmp_path / "out.jsonl", engine=fresh, cache="off")
    finally:
        import asyncio

        asyncio.run(fresh.shutdown())
    assert s["ok"] == 1 and 0 < s["engine_start_s"] < s["elapsed_s"]
    assert s["engine_max_num_seqs"] == 4  # what it was given, read without starting it before the clock
