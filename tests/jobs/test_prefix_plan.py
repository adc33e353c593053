"""Prefix-aware order over the whole input file: groups reach the server together,
the file is never held in memory, and resume, dedup and duplicate ids work as in file order."""

import json
import random
import tracemalloc

from carpool.jobs.input.prefix_order import PlannedSource
from carpool.jobs.input.readers import Reader
from carpool.jobs.input.tasks import Task
from carpool.jobs.python_api.run import run_batch
from carpool.testing.fault_server import FaultConfig


def doc(d: int, n: int = 1200) -> str:
    return f"Document {d}: " + " ".join(f"w{d}x{i}" for i in range(n // 6))


def write_docs(path, docs=30, questions=4, seed=0, extra=None):
    """``docs`` long documents with ``questions`` questions each, shuffled; custom_id d<doc>q<question>."""
    rows = [{"custom_id": f"d{d}q{q}", "temperature": 0, "max_tokens": 4,
             "messages": [{"role": "user", "content": doc(d) + f"\nQuestion {q}?"}]}
            for d in range(docs) for q in range(questions)]
    random.Random(seed).shuffle(rows)
    rows += extra or []
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


def doc_runs(order):
    """How many runs of consecutive tasks of one document the server saw."""
    docs = [cid.split("q")[0] for cid in order]
    return sum(1 for i, d in enumerate(docs) if i == 0 or docs[i - 1] != d)


def test_default_groups_a_shuffled_file_past_the_window(fault_server, tmp_path):
    srv = fault_server(FaultConfig())
    src = tmp_path / "in.jsonl"
    write_docs(src, docs=30, questions=4)
    out = tmp_path / "out.jsonl"
    # The window (8 tasks) is far smaller than the file: only the whole-file plan can group it.
    s = run_batch(src, out, endpoints=[srv.url], model="m", cache="off", concurrency=1, prefix_window=8)
    assert doc_runs(srv.server.order) == 30  # each document's questions sent one after another
    assert s["prefix_order"]["mode"] == "planned" and s["prefix_order"]["groups"] == 30
    got = {json.loads(x)["custom_id"] for x in out.read_text().splitlines()}
    assert got == {f"d{d}q{q}" for d in range(30) for q in range(4)} and s["ok"] == 120


def test_off_and_short_prompts_keep_the_file_order(fault_server, tmp_path):
    srv = fault_server(FaultConfig())
    src = tmp_path / "in.jsonl"
    rows = write_docs(src, docs=10, questions=3)
    run_batch(src, tmp_path / "a.jsonl", endpoints=[srv.url], model="m", cache="off", concurrency=1,
              prefix_order=False)
    assert srv.server.order == [r["custom_id"] for r in rows]
    short = tmp_path / "short.jsonl"
    with open(short, "w") as f:  # a shared short instruction: not worth moving anything
        for i in range(40):
            f.write(json.dumps({"custom_id": f"s{i}", "temperature": 0, "max_tokens": 4, "messages": [
                {"role": "system", "content": ["Be brief.", "Be kind."][i % 2]},
                {"role": "user", "content": f"q{i}"}]}) + "\n")
    srv.server.reset_counts()
    srv.server.order.clear()
    s = run_batch(short, tmp_path / "b.jsonl", endpoints=[srv.url], model="m", cache="off", concurrency=1)
    assert srv.server.order == [f"s{i}" for i in range(40)]
    assert s["prefix_order"]["mode"] == "short prompts"


def test_resume_with_order_on_sends_only_what_is_not_done(fault_server, tmp_path):
    srv = fault_server(FaultConfig())
    src = tmp_path / "in.jsonl"
    write_docs(src, docs=12, questions=4, seed=3)
    out = tmp_path / "out.jsonl"
    run_batch(src, out, endpoints=[srv.url], model="m", cache="off", concurrency=2)
    keep = out.read_text().splitlines(keepends=True)[:17]
    out.write_text("".join(keep))
    done_before = {json.loads(x)["custom_id"] for x in keep}
    srv.server.reset_counts()
    s = run_batch(src, out, endpoints=[srv.url], model="m", cache="off", concurrency=2)
    ids = [json.loads(x)["custom_id"] for x in out.read_text().splitlines()]
    assert sorted(ids) == sorted(f"d{d}q{q}" for d in range(12) for q in range(4))
    assert s["skipped_done_before"] == 17 and s["done"] == 31
    assert not done_before & set(srv.server.seen)


def test_dedup_and_repeated_ids_as_in_file_order(fault_server, tmp_path):
    srv = fault_server(FaultConfig())
    src = tmp_path / "in.jsonl"
    twin = {"custom_id": "twin", "temperature": 0, "max_tokens": 4,
            "messages": [{"role": "user", "content": doc(0) + "\nQuestion 0?"}]}  # the same request as d0q0
    # d3q1 again at the end of the file: the plan would send its group early, yet the later
    # line must still be the one refused.
    again = {"custom_id": "d3q1", "temperature": 0, "max_tokens": 4,
             "messages": [{"role": "user", "content": doc(0) + "\nQuestion 9?"}]}
    write_docs(src, docs=6, questions=2, extra=[twin, again])
    out = tmp_path / "out.jsonl"
    s = run_batch(src, out, endpoints=[srv.url], model="m", cache="off", concurrency=4)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    by_id = {d["custom_id"]: d for d in lines}
    assert len(lines) == 14 and "d3q1#line-14" in by_id and by_id["d3q1#line-14"]["error"] is not None
    assert by_id["d3q1"]["error"] is None
    # twin and d0q0 (next to each other once planned): one request between them
    assert s["dedup_fanouts"] == 1 and s["sent"] == 12
    assert srv.server.seen.get("twin", 0) + srv.server.seen.get("d0q0", 0) == 1


def test_plan_holds_a_few_bytes_a_line_never_the_tasks(tmp_path):
    src = tmp_path / "big.jsonl"
    groups, per = 2000, 10  # 20,000 lines, groups far apart in the file
    rng = random.Random(1)
    ids = [(g, q) for g in range(groups) for q in range(per)]
    rng.shuffle(ids)
    with open(src, "w") as f:
        for g, q in ids:
            f.write(json.dumps({"custom_id": f"g{g}q{q}", "prompt": f"[{g}] " + "shared context " * 60 + f"q{q}"})
                    + "\n")
    source = PlannedSource(Reader(src))
    tracemalloc.start()
    try:
        source.prepare()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    n = groups * per
    assert source.info.mode == "planned" and source.info.lines == n
    assert source.info.bytes_held <= 80 * n
    # The prompts alone are ~20 MB; the pass holds its arrays and a few temporaries.
    assert peak < 200 * n + (2 << 20)
    seen_groups, last = set(), None
    for item in source:
        assert isinstance(item, Task)
        g = item.custom_id.split("q")[0]
        if g != last:
            assert g not in seen_groups  # a group is never split
            seen_groups.add(g)
            last = g
    assert len(seen_groups) == groups and source.max_held == 1


def test_summary_sums_the_cached_prompt_tokens_per_endpoint(fault_server, tmp_path):
    a = fault_server(FaultConfig(prefix_cache_blocks=10_000))
    b = fault_server(FaultConfig(prefix_cache_blocks=10_000))
    src = tmp_path / "in.jsonl"
    write_docs(src, docs=8, questions=4)
    s = run_batch(src, tmp_path / "out.jsonl", endpoints=[a.url, b.url], model="m", cache="off", concurrency=2)
    pc = s["prompt_cache"]
    servers = {a.url: a.server, b.url: b.server}
    assert set(pc["endpoints"]) == set(servers)
    for url, e in pc["endpoints"].items():
        assert e["cached_prompt_tokens"] == servers[url].prefix_hits  # what that server said it reused
        assert e["prompt_tokens"] == servers[url].prefix_queries
    assert pc["cached_prompt_tokens"] == a.server.prefix_hits + b.server.prefix_hits > 0
    assert s["cached_prompt_tokens"] == pc["cached_prompt_tokens"]
    assert 0 < pc["cached_share"] < 1 and pc["answers_reporting_cached"] == 32


def test_summary_says_when_the_server_reports_no_cached_tokens(fault_server, tmp_path):
    from carpool.jobs.summary.prompt_reuse import PromptReuse

    srv = fault_server(FaultConfig())
    src = tmp_path / "in.jsonl"
    write_docs(src, docs=2, questions=2)
    s = run_batch(src, tmp_path / "out.jsonl", endpoints=[srv.url], model="m", cache="off")
    assert s["prompt_cache"]["answers"] == 4 and s["prompt_cache"]["cached_share"] is None
    reuse = PromptReuse()
    reuse.add(srv.url, 100, 0, False)
    assert "not reported" in reuse.summary_row(f"http {srv.url}")[1] and reuse.progress_text() == ""


def test_ordered_output_keeps_input_order_while_windows_group(fault_server, tmp_path):
    srv = fault_server(FaultConfig())
    src = tmp_path / "in.jsonl"
    rows = write_docs(src, docs=6, questions=4)
    out = tmp_path / "out.jsonl"
    # A window larger than --max-pending must not wait for slots that only it could free.
    s = run_batch(src, out, endpoints=[srv.url], model="m", cache="off", concurrency=1, ordered=True,
                  max_pending=12, prefix_window=64)
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == [r["custom_id"] for r in rows]
    assert "prefix_order" not in s  # --ordered: no whole-file plan
    sent = srv.server.order
    for half in (sent[:12], sent[12:]):  # each window of 12 (max_pending) sent grouped
        docs = [cid.split("q")[0] for cid in half]
        assert doc_runs(half) == len(set(docs))


def test_routing_summary_counts_requests_that_followed_their_group(fault_server, tmp_path):
    a, b = fault_server(FaultConfig()), fault_server(FaultConfig())
    src = tmp_path / "in.jsonl"
    write_docs(src, docs=5, questions=4)
    s = run_batch(src, tmp_path / "out.jsonl", endpoints=[a.url, b.url], model="m", cache="off", concurrency=2)
    assert s["routing"]["followed"] == 15 and s["routing"]["overflowed"] == 0  # the first of each group is new


def test_bad_and_blank_lines_keep_their_line_numbers_when_planned(tmp_path):
    src = tmp_path / "in.jsonl"
    rows = write_docs(src, docs=5, questions=3)
    lines = src.read_text().splitlines()
    lines.insert(4, "")  # line 5: blank
    lines.insert(7, '{"custom_id": "broken", "messages": [')  # line 8: not JSON
    src.write_text("\r\n".join(lines) + "\r\n")  # CRLF lines plan as well
    source = PlannedSource(Reader(src))
    items = list(source)
    assert source.info.mode == "planned" and len(items) == len(rows) + 1
    bad = [i for i in items if not isinstance(i, Task)]
    assert len(bad) == 1 and bad[0].line_no == 8 and bad[0].custom_id == "line-8"
    by_id = {i.custom_id: i.line_no for i in items if isinstance(i, Task)}
    for n, line in enumerate(lines, 1):
        if line.startswith('{"custom_id": "d'):
            assert by_id[json.loads(line)["custom_id"]] == n
    cr = tmp_path / "cr.jsonl"
    cr.write_bytes(src.read_bytes().replace(b"\r\n", b"\r"))
    assert not PlannedSource.usable(Reader(cr))  # old Mac lines: read in windows instead


def test_who_plans_by_default():
    from carpool.jobs.options import RunOptions
    from carpool.jobs.parts import wants_plan

    assert wants_plan(RunOptions("in", "out", endpoints=["http://x/v1"]))
    assert wants_plan(RunOptions("in", "out"))  # the in-process engine: its prefix cache thrashes alike
    assert not wants_plan(RunOptions("in", "out", echo=True))
    assert not wants_plan(RunOptions("in", "out", ordered=True, prefix_order=True))  # windows instead
    assert not wants_plan(RunOptions("in", "out", endpoints=["http://x/v1"], prefix_order=False))
