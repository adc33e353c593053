"""Hostile input files: every bad line gets its own clear error, the job goes on.

Hypothesis writes files mixing valid tasks with lines that are deeply nested JSON, huge
strings (prompts past the context), wrong types for every field, invalid UTF-8, raw NUL
bytes, a BOM, blank lines and non-objects.  The run (on the in-process tiny engine) must
finish, write exactly one line per non-blank input line, and for every bad line an
``invalid_input`` error that names the line (``error.line`` and "line N" in the message)
and, where one field is at fault, that field.  Valid lines still succeed.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from carpool.jobs.python_api.run import run_batch
from carpool.testing.fault_server import FaultConfig

MSG = [{"role": "user", "content": "hi"}]

# (field, wrong values) for every field a task line may carry.
WRONG = {
    "custom_id": [5, "", [], True, {"a": 1}],
    "messages": ["hi", [], 5, {}, None],
    "messages[0]": [5, "x", None, [1]],
    "messages[0].role": [5, "robot", None, ""],
    "messages[0].content": [5, True, {"a": 1}, None],
    "max_tokens": ["10", 0, -1, 1.5, True, 10**30],
    "temperature": ["hot", -1, 3, True, [0]],
    "top_p": [0, 2, "x", False],
    "stop": [5, [1], {"a": 1}, [None]],
    "seed": [1.5, "x", True],
}


def _valid(cid: str, text: str) -> dict:
    return {"custom_id": cid, "temperature": 0, "max_tokens": 2, "messages": [{"role": "user", "content": text}]}


def _with_wrong(cid: str, field: str, value) -> dict:
    rec = _valid(cid, "hello")
    if field == "custom_id":
        rec["custom_id"] = value
    elif field == "messages":
        rec["messages"] = value
    elif field == "messages[0]":
        rec["messages"] = [value]
    elif field == "messages[0].role":
        rec["messages"][0]["role"] = value
    elif field == "messages[0].content":
        rec["messages"][0]["content"] = value
    else:
        rec[field] = value
    return rec


@st.composite
def hostile_line(draw, n: int):
    """(raw bytes, expectation) for line ``n``; expectation: "ok", "skip" or ("error", field, id).
    field "" means a line-level error (bad JSON/UTF-8) that names no field."""
    cid = f"L{n}"
    kind = draw(st.sampled_from(["valid", "wrong", "deep", "huge", "utf8", "nul", "blank", "bom", "nonobj",
                                 "nul_escaped", "long_id", "surrogate"]))
    if kind == "valid":
        text = draw(st.text(min_size=1, max_size=40))
        return json.dumps(_valid(cid, text)).encode(), "ok"
    if kind == "wrong":
        field = draw(st.sampled_from(sorted(WRONG)))
        value = draw(st.sampled_from(WRONG[field]))
        return json.dumps(_with_wrong(cid, field, value)).encode(), ("error", field,
                                                                      f"line-{n}" if field == "custom_id" else cid)
    if kind == "deep":
        depth = draw(st.integers(1_000, 200_000))
        inner = draw(st.sampled_from(["[" * depth + "]" * depth, '{"a":' * depth + "1" + "}" * depth]))
        return f'{{"custom_id": "{cid}", "messages": {inner}}}'.encode(), ("error", None, None)
    if kind == "huge":
        size = draw(st.integers(2_000, 300_000))
        return json.dumps(_valid(cid, "word " * (size // 5))).encode(), ("error", "messages", cid)
    if kind == "utf8":
        bad = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"]))
        return b'{"custom_id": "' + cid.encode() + b'", "messages": [{"role": "user", "content": "' + bad + b'"}]}', \
            ("error", "", f"line-{n}")
    if kind == "nul":
        return json.dumps(_valid(cid, "ab")).replace("ab", "a\x00b").encode(), ("error", "", f"line-{n}")
    if kind == "nul_escaped":  # a NUL character written as \u0000 is valid JSON text
        return json.dumps(_valid(cid, "a\x00b")).encode(), "ok"
    if kind == "surrogate":  # valid JSON, but "\ud800" alone is no Unicode character
        where = draw(st.sampled_from(["content", "custom_id", "stop"]))
        rec = _valid(cid, "x")
        if where == "content":
            rec["messages"][0]["content"] = "SURR"
        elif where == "stop":
            rec["stop"] = ["SURR"]
        else:
            rec["custom_id"] = "SURR"
        return json.dumps(rec).replace("SURR", "bad \\ud800 text").encode(), ("error", None, None)
    if kind == "blank":
        return draw(st.sampled_from([b"", b"   ", b"\t", b"\r"])), "skip"
    if kind == "bom":
        return "\ufeff".encode() + json.dumps(_valid(cid, "bom")).encode(), ("bom", None, None)
    if kind == "long_id":
        return json.dumps(_valid("i" * 100_000, "x") | {"custom_id": cid + "-" + "i" * 50_000}).encode(), \
            ("ok_id", cid + "-" + "i" * 50_000)
    value = draw(st.sampled_from(["[1, 2]", '"text"', "42", "null", "true"]))
    return value.encode(), ("error", "", f"line-{n}")


@st.composite
def hostile_file(draw):
    n_lines = draw(st.integers(1, 10))
    return [draw(hostile_line(i + 1)) for i in range(n_lines)]


def _check_file(engine, lines: list[tuple[bytes, object]]) -> None:
    # A known-good last line: the job must reach it whatever came before.
    sentinel_no = len(lines) + 1
    lines = [*lines, (json.dumps(_valid("sentinel", "the end")).encode(), "ok")]
    with tempfile.TemporaryDirectory() as d:
        src, out = Path(d) / "in.jsonl", Path(d) / "out.jsonl"
        src.write_bytes(b"\n".join(raw for raw, _ in lines) + b"\n")
        summary = run_batch(src, out, engine=engine, cache="off")
        got = [json.loads(x) for x in out.read_bytes().splitlines()]
    by_id = {d["custom_id"]: d for d in got}
    expected_lines = [(i + 1, e) for i, (_, e) in enumerate(lines) if e != "skip"]
    assert len(got) == len(expected_lines), (len(got), expected_lines)
    assert by_id["sentinel"]["error"] is None
    n_errors = 0
    for no, exp in expected_lines:
        if exp == "ok":
            d = by_id["sentinel" if no == sentinel_no else f"L{no}"]
            assert d["error"] is None, (no, d["error"])
            continue
        tag = exp[0]
        if tag == "ok_id":
            assert by_id[exp[1]]["error"] is None
            continue
        if tag == "bom":
            # Either the BOM is tolerated, or the line gets a clear error that names it.
            d = by_id.get(f"L{no}") or by_id[f"line-{no}"]
            if d["error"] is not None:
                n_errors += 1
                assert d["error"]["line"] == no and "BOM" in d["error"]["message"], d["error"]
            continue
        _, field, cid = exp
        d = by_id.get(cid) if cid else (by_id.get(f"L{no}") or by_id.get(f"line-{no}"))
        assert d is not None, (no, exp, sorted(by_id)[:20])
        err = d["error"]
        assert err is not None, (no, exp)
        n_errors += 1
        assert err["code"] == "invalid_input", (no, err)
        assert err["line"] == no and f"line {no}" in err["message"], (no, err)
        if field is not None:
            # exactly the field, or the element of it at fault ("stop[0]" for "stop": [1])
            got = err.get("field", "")
            assert got == field or got.startswith(field + "["), (no, exp, err)
    assert summary["bad_lines"] == n_errors
    assert summary["ok"] == len(expected_lines) - n_errors


@pytest.mark.slow
@settings(max_examples=50, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture, HealthCheck.large_base_example])
@given(lines=hostile_file())
def test_hostile_files_get_per_line_errors_and_the_job_goes_on(tiny_engine, lines):
    _check_file(tiny_engine, lines)


# The cases hypothesis may or may not draw, pinned down one by one.
@pytest.mark.parametrize("field", sorted(WRONG))
def test_every_field_with_a_wrong_type_is_named(tiny_engine, field):
    lines = [(json.dumps(_with_wrong(f"L{i + 1}", field, v)).encode(),
              ("error", field, f"line-{i + 1}" if field == "custom_id" else f"L{i + 1}"))
             for i, v in enumerate(WRONG[field])]
    _check_file(tiny_engine, lines)


def test_deep_nesting_is_a_line_error_not_a_crash(tiny_engine):
    deep = '{"custom_id": "L1", "messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
    _check_file(tiny_engine, [(deep.encode(), ("error", None, None)),
                              (json.dumps(_valid("L2", "fine")).encode(), "ok")])


def test_prompt_past_the_context_names_messages_and_the_limit(tiny_engine):
    lines = [(json.dumps(_valid("L1", "word " * 5000)).encode(), ("error", "messages", "L1"))]
    _check_file(tiny_engine, lines)
    with tempfile.TemporaryDirectory() as d:
        src, out = Path(d) / "in.jsonl", Path(d) / "out.jsonl"
        src.write_text(json.dumps(_valid("x", "word " * 5000)) + "\n")
        run_batch(src, out, engine=tiny_engine, cache="off")
        (row,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert "context" in row["error"]["message"] and "256" in row["error"]["message"]


@pytest.mark.parametrize("field, value", [("top_k", "abc"), ("seed", 10**30), ("seed", -(10**30))])
def test_engine_parameters_out_of_range_are_invalid_input_naming_the_field(tiny_engine, field, value):
    """Values the engine cannot take (not a number, past 64 bits) are the line's fault: an
    ``invalid_input`` naming the field, not an engine error or a generic 'body'."""
    rec = _valid("L1", "hi") | {field: value}
    _check_file(tiny_engine, [(json.dumps(rec).encode(), ("error", field, "L1"))])


def test_over_http_the_servers_refusal_names_the_line_and_field(tiny_engine, tiny_config, tmp_path):
    """Lines the runner cannot judge itself (the context is the server's) are refused by the
    server with a 400 whose ``param`` names the field; the line's error carries it."""
    from carpool.server import ServerConfig, start_server

    rows = [
        _valid("long", "word " * 5000),  # past the 256-token context
        _valid("n", "hi") | {"n": 999},  # a valid integer past the server's --max-n: its own refusal
        _valid("prompt_logprobs", "hi") | {"prompt_logprobs": 1},  # vLLM's, not carpool's engine
        _valid("fine", "hi"),
    ]
    fields = {"long": "messages", "n": "n", "prompt_logprobs": "prompt_logprobs"}
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    cfg = ServerConfig(engine=tiny_config, port=0, embedding_model=None)
    with start_server(cfg, engine=tiny_engine) as srv:
        s = run_batch(src, out, endpoints=[srv.base_url + "/v1"], model="tiny-random", cache="off")
    got = {d["custom_id"]: d for d in (json.loads(x) for x in out.read_text().splitlines())}
    assert got["fine"]["error"] is None and s["ok"] == 1
    for no, (cid, field) in enumerate(fields.items(), 1):
        err = got[cid]["error"]
        assert err["code"] == "invalid_request" and err["line"] == no and f"line {no}" in err["message"], err
        assert err.get("field") == field, err
        assert err["attempts"] == 1  # a 400 is not retried


def test_duplicate_custom_ids_are_line_errors_and_resume_loses_nothing(tmp_path):
    """A custom_id is the journal's key, so two tasks sharing one cannot both be resumed
    safely: the second is an ``invalid_input`` on field custom_id (as OpenAI's Batch API
    refuses duplicates), including a given id equal to an automatic ``line-N``.  Whatever
    prefix of the output a crash leaves, the resumed output accounts for every line once."""
    rows = [{"custom_id": "x", "messages": [{"role": "user", "content": "a"}]},
            {"custom_id": "x", "messages": [{"role": "user", "content": "b"}]},  # duplicate
            {"messages": [{"role": "user", "content": "c"}]},  # automatic id line-3
            {"custom_id": "line-3", "messages": [{"role": "user", "content": "d"}]},  # duplicate of it
            {"custom_id": "y", "messages": [{"role": "user", "content": "e"}]}]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def accounted(path: Path) -> tuple[list[str], list[int]]:
        got = [json.loads(x) for x in path.read_text().splitlines()]
        ok = sorted(d["custom_id"] for d in got if d["error"] is None)
        bad = sorted(d["error"]["line"] for d in got if d["error"] is not None)
        for d in got:
            if d["error"] is not None:
                assert d["error"]["field"] == "custom_id" and "duplicate" in d["error"]["message"], d["error"]
        return ok, bad

    full = tmp_path / "full.jsonl"
    run_batch(src, full, echo=True, cache="off")
    assert accounted(full) == (["line-3", "x", "y"], [2, 4])
    lines = full.read_text().splitlines(keepends=True)
    for k in range(len(lines)):  # a crash after k lines, then the same command again
        out = tmp_path / f"resume{k}.jsonl"
        out.write_text("".join(lines[:k]))
        run_batch(src, out, echo=True, cache="off")
        assert accounted(out) == (["line-3", "x", "y"], [2, 4]), k


@pytest.mark.parametrize("how", ["http", "echo", "engine"])
@pytest.mark.parametrize("cache", ["off", "sqlite"])
def test_lone_surrogate_escapes_are_line_errors_not_lost_lines(tiny_engine, logging_fault_server, tmp_path,
                                                               how, cache):
    """``"\\ud800"`` is valid JSON but no Unicode text: it cannot be sent, cached or written.
    The line must come back as an error naming it (and its field), never vanish."""
    lines = ['{"custom_id": "s1", "temperature": 0, "messages": [{"role": "user", "content": "a \\ud800 b"}]}',
             ('{"custom_id": "s2", "temperature": 0, "stop": ["\\udfff"], "messages": [{"role": "user", '
              '"content": "x"}]}'),
             json.dumps(_valid("fine", "ok \U0001F600 emoji"))]  # a proper surrogate pair is fine
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    kw: dict = {"cache": "off" if cache == "off" else f"sqlite:///{tmp_path / 'c.sqlite'}"}
    if how == "http":
        kw |= {"endpoints": [logging_fault_server(FaultConfig()).url], "model": "m"}
    elif how == "echo":
        kw["echo"] = True
    else:
        kw["engine"] = tiny_engine
    summary = run_batch(src, out, **kw)
    got = {d["custom_id"]: d for d in (json.loads(x) for x in out.read_text().splitlines())}
    assert len(got) == 3 and summary["done"] == 3, (sorted(got), summary["done"])
    assert got["fine"]["error"] is None
    for no, (cid, field) in enumerate((("s1", "messages"), ("s2", "stop")), 1):
        err = got[cid]["error"]
        assert err["code"] == "invalid_input" and err["line"] == no and f"line {no}" in err["message"], err
        assert err["field"].startswith(field), err
