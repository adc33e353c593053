"""`carpool run` against a server that misbehaves on 30% of requests.

Every kind of fault of the fault server is on at once (429 and 503 with Retry-After,
500/502, resets before and after the body, stalls past the read timeout before and
during the stream, truncated streams, invalid JSON).  The server logs, per task, what it
did with each request, and the test checks the runner against that log:

- greedy (temperature 0, idempotent) tasks are retried through anything and all succeed;
- a sampled (temperature 0.7) task is sent again only after a refusal the client can
  recognise (429, 503); after any fault where the work may have run (for the client a
  reset before the body was read looks like one after), it is never sent again and its
  line is an error of kind ``maybe_executed``;
- the summary JSON counts every retry by kind and every final error by kind, exactly as
  the server log says.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
from aiohttp import web
from reliability_helpers import (
    CLIENT_KIND,
    MAY_HAVE_RUN,
    REFUSALS,
    Fault,
    FaultConfig,
    FaultServer,
    ThreadedFaultServer,
    chat_task,
    read_jsonl,
    run_cli,
    write_jsonl,
)

from carpool.jobs.python_api.run import run_batch

ALL_KINDS = ["429", "503", "500", "502", "reset_before_body", "reset_after_body", "stall", "stall_mid_stream",
             "truncate", "invalid_json"]
STREAM_ONLY = {"stall_mid_stream", "truncate"}  # a plain JSON answer has no stream to cut
MAX_ATTEMPTS = 12


@pytest.mark.slow
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "no-stream"])
def test_thirty_percent_faults_job_completes_and_counts_each_kind(logging_fault_server, tmp_path, stream):
    kinds = [k for k in ALL_KINDS if stream or k not in STREAM_ONLY]
    rate = 1 - 0.7 ** (1 / len(kinds))  # each kind drawn independently: 30% of requests fail
    faults = [Fault(k, rate=rate, retry_after=0.05 if k in ("429", "503") else None, stall_s=2.5) for k in kinds]
    srv = logging_fault_server(FaultConfig(faults=faults, seed=7, completion_tokens=4))
    n = 240
    rows = [chat_task(f"{'g' if i % 2 else 's'}{i}", f"question {i}", temperature=0.0 if i % 2 else 0.7)
            for i in range(n)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out, summary_path = tmp_path / "out.jsonl", tmp_path / "summary.json"
    res = run_cli([str(src), "-o", str(out), "--endpoint", srv.url, "--model", "m", "--cache", "off",
                   "--concurrency", "16", "--read-timeout", "1.0", "--max-attempts", str(MAX_ATTEMPTS),
                   "--summary-json", str(summary_path), "--quiet"] + ([] if stream else ["--no-stream"]))
    summary = json.loads(summary_path.read_text())
    # Exit 3 when some tasks ended in an error line (maybe_executed, faults past the attempts).
    assert res.returncode == (3 if summary["errors"] else 0), res.stderr.decode()[-3000:]
    lines = {d["custom_id"]: d for d in read_jsonl(out)}
    assert len(lines) == n and summary["done"] == n
    events = srv.server.snapshot()

    expected_retries: Counter = Counter()
    expected_errors: Counter = Counter()
    for i, row in enumerate(rows):
        cid = row["custom_id"]
        ev = events[cid]
        line = lines[cid]
        # Everything but the last event was a failure the runner retried.
        expected_retries.update(CLIENT_KIND[e] for e in ev[:-1])
        assert "ok" not in ev[:-1], (cid, ev)  # an answered request is never sent again
        if cid.startswith("g"):
            assert ev[-1] == "ok" and line["error"] is None, (cid, ev, line["error"])
            continue
        # Sampled: nothing may follow a fault where the work may have run.
        assert not MAY_HAVE_RUN & set(ev[:-1]), (cid, ev)
        if ev[-1] == "ok":
            assert line["error"] is None, (cid, ev, line["error"])
        elif ev[-1] in MAY_HAVE_RUN or ev[-1] == "reset_before_body":
            # A reset before the body was read is a refusal on the server's side, but the
            # client cannot tell it from a reset after: it must treat it as "may have run".
            err = line["error"]
            assert err["code"] == "maybe_executed" and err["line"] == i + 1, (cid, ev, err)
            assert "may already have run" in err["message"] and f"line {i + 1}" in err["message"]
            expected_errors["maybe_executed"] += 1
        else:  # refused MAX_ATTEMPTS times in a row
            assert ev[-1] in REFUSALS and len(ev) == MAX_ATTEMPTS
            assert line["error"]["code"] == CLIENT_KIND[ev[-1]]
            expected_errors[CLIENT_KIND[ev[-1]]] += 1

    injected = sum(len(ev) for ev in events.values()) - sum(ev.count("ok") for ev in events.values())
    attempts = sum(len(ev) for ev in events.values())
    assert 0.2 < injected / attempts < 0.4, (injected, attempts)  # the rate asked for, seeded
    assert summary["errors"] == dict(expected_errors)
    assert summary["retries"] == dict(expected_retries)
    assert summary["ok"] == n - sum(expected_errors.values())
    assert expected_errors["maybe_executed"] > 0  # the non-idempotent path was exercised
    # Every fault kind happened and was seen by the runner as its own kind.
    assert {CLIENT_KIND[k] for k in kinds} <= set(summary["retries"]), summary["retries"]


class _LoneSurrogateServer(FaultServer):
    """Answers every chat request with text holding a lone surrogate escape: valid JSON,
    not valid Unicode (some servers emit it when they cut a multi-byte character)."""

    async def _answer(self, request, raw, key):
        self.completed[key] += 1
        body = ('{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":'
                '"assistant","content":"cut \\ud83d here"},"finish_reason":"length"}],'
                '"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}')
        return web.Response(text=body, content_type="application/json")


@pytest.mark.parametrize("stream", [False, True], ids=["no-stream", "stream"])
def test_an_answer_that_is_not_unicode_is_written_not_lost(tmp_path, stream):
    srv = ThreadedFaultServer(FaultConfig())
    srv.server = _LoneSurrogateServer(FaultConfig())
    src = write_jsonl(tmp_path / "in.jsonl", [chat_task(f"q{i}", f"hi {i}") for i in range(3)])
    out = tmp_path / "out.jsonl"
    with srv:
        s = run_batch(src, out, endpoints=[srv.url], model="m", cache="off", stream=stream)
    rows = read_jsonl(out)
    assert sorted(d["custom_id"] for d in rows) == ["q0", "q1", "q2"] and s["done"] == 3, (s["done"], rows)
    for d in rows:  # kept as the server sent it (the escape), or an error of its own kind
        if d["error"] is None:
            assert d["response"]["body"]["choices"][0]["message"]["content"] == "cut \ud83d here"
        else:
            assert d["error"]["code"] == "invalid_response"
