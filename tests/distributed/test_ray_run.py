"""``carpool run --ray`` on a local 2-CPU Ray cluster, against real HTTP servers and Redis."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from carpool.commands import run as run_command
from carpool.distributed.ray_runner import RayOptions, run_batch_on_ray, run_on_ray
from carpool.jobs.input.tasks import TaskDefaults
from carpool.jobs.options import RunOptions
from carpool.jobs.python_api.run import run_batch
from carpool.testing.fault_server import FaultConfig, ThreadedFaultServer

pytestmark = pytest.mark.timeout(300)


def write_tasks(path: Path, n: int, bad_at: tuple[int, ...] = (), dup_at: tuple[int, ...] = ()) -> Path:
    """n lines: chat tasks, every third with its own custom_id, the others get line-<n>;
    lines listed in ``bad_at`` (1-based) are broken JSON, those in ``dup_at`` reuse the
    custom_id "task-3"; one line is blank."""
    lines = []
    for i in range(1, n + 1):
        if i in bad_at:
            lines.append('{"messages": [broken')
            continue
        rec = {"messages": [{"role": "user", "content": f"review number {i}: fine"}], "max_tokens": 3,
               "temperature": 0}
        if i % 3 == 0 or i in dup_at:
            rec = {"custom_id": "task-3" if i in dup_at else f"task-{i}", **rec}
        lines.append(json.dumps(rec))
    lines.insert(n // 2, "")  # a blank line: skipped, but it shifts the line numbers after it
    path.write_text("\n".join(lines) + "\n")
    return path


def normalised(path: Path) -> list[str]:
    """The output lines minus what differs between any two runs (random line ids, the
    server's wall-clock 'created')."""
    out = []
    for line in path.read_text().splitlines():
        doc = json.loads(line)
        doc.pop("id")
        body = (doc.get("response") or {}).get("body") or {}
        body.pop("created", None)
        out.append(json.dumps(doc, sort_keys=True))
    return out


@pytest.fixture(scope="module")
def zero_server():
    with ThreadedFaultServer(FaultConfig.zero()) as srv:
        yield srv


def test_ray_run_writes_the_same_lines_as_one_process(ray_cluster, zero_server, tmp_path):
    # Two broken lines, and two tasks reusing the custom_id of line 3 (one in the same shard,
    # one in the last shard, which no runner but the driver can tell).
    tasks = write_tasks(tmp_path / "tasks.jsonl", 120, bad_at=(7, 64), dup_at=(10, 110))
    single = tmp_path / "single.jsonl"
    stats = run_batch(str(tasks), str(single), endpoints=[zero_server.url], ordered=True, cache="off",
                      defaults=TaskDefaults(model="m"))
    assert stats["ok"] == 116 and stats["bad_lines"] == 4

    # The Ray side goes through the command line, as a user would run it.
    parser = argparse.ArgumentParser()
    run_command.add_arguments(parser)
    out = tmp_path / "ray.jsonl"
    args = parser.parse_args([str(tasks), "-o", str(out), "--endpoint", zero_server.url, "--model", "m",
                              "--ordered", "--cache", "off", "--ray", "--ray-workers", "2", "--ray-shards", "5",
                              "--quiet"])
    assert run_command.main(args) == 3  # `carpool run ... --ray` dispatches to Ray; 4 bad lines: exit 3
    assert normalised(out) == normalised(single)
    # The bad lines are reported with their line numbers in the whole file, not in a shard.
    errors = [json.loads(x)["error"] for x in out.read_text().splitlines() if json.loads(x)["error"]]
    assert sorted(e["line"] for e in errors) == [7, 10, 65, 111]
    assert not Path(f"{out}.ray").exists()  # the shard files are gone after the merge


def test_two_workers_stay_under_a_shared_rpm_limit(ray_cluster, rate_window_server, redis_url, redis_name,
                                                   tmp_path):
    # The "provider": at most 6 requests in any 1 s window, 429 past it.
    srv = rate_window_server(limit=6, window_s=1.0)
    tasks = write_tasks(tmp_path / "tasks.jsonl", 24)
    out = tmp_path / "out.jsonl"
    opts = RunOptions(input=str(tasks), output=str(out), endpoints=[srv.url], cache="off", rpm=360,
                      defaults=TaskDefaults(model="m"), quiet=True)
    stats = run_on_ray(opts, RayOptions(workers=2, shards=2, redis=redis_url, budget_name=redis_name,
                                        rpm_window_s=1.0, rpm_burst_s=0.5))
    assert stats.shards is not None and stats.shards.complete and stats.ok == 24
    result = stats.to_dict()  # the same JobStats as a single-process run, with its shards
    assert len(out.read_text().splitlines()) == 24
    assert srv.rejected == 0, f"the provider answered 429 {srv.rejected} times"
    assert srv.max_in_window() <= 6
    # Two workers really ran, one shard each (else this would not test sharing anything).
    assert len({(s["host"], s["pid"]) for s in result["shard_summaries"]}) == 2


@pytest.mark.slow
def test_each_worker_runs_an_engine_of_its_own(ray_cluster, tmp_path):
    # No endpoint: every Ray worker starts its own carpool engine (the tiny random model),
    # greedy decoding, so the texts must match a single-process run exactly.
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"custom_id": f"e{i}", "prompt": f"The number {i} is", "max_tokens": 4,
                                         "temperature": 0}) + "\n" for i in range(16)))

    def texts(path: Path) -> list[tuple]:
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        return [(r["custom_id"], r["response"]["body"]["choices"][0]["text"],
                 r["response"]["body"]["usage"]["completion_tokens"]) for r in rows]

    single = tmp_path / "single.jsonl"
    run_batch(str(tasks), str(single), engine_model="tiny-random", cache="off", ordered=True)
    out = tmp_path / "ray.jsonl"
    # Through the Python API, with run_batch's shortcuts (model= means the engine's model here).
    result = run_batch_on_ray(tasks, out, model="tiny-random", cache="off", ordered=True, quiet=True,
                              ray_options=RayOptions(workers=2, shards=2))
    assert result["complete"] and result["ok"] == 16
    assert texts(out) == texts(single)
    assert all(t[2] == 4 for t in texts(out))


_DRIVER = r"""
import sys
from carpool.distributed.ray_runner import RayOptions, run_on_ray
from carpool.jobs.options import RunOptions
from carpool.jobs.input.tasks import TaskDefaults
address, tasks, out, url = sys.argv[1:5]
run_on_ray(RunOptions(input=tasks, output=out, endpoints=[url], cache="off", ordered=True, concurrency=2,
                      defaults=TaskDefaults(model="m"), quiet=True),
           RayOptions(address=address, workers=2, shards=6))
"""


def _complete_ids(path: Path) -> list[str]:
    if not path.exists():
        return []
    data = path.read_bytes()
    lines = data.split(b"\n")[:-1]  # the part after the last newline is not a complete line
    return [json.loads(x)["custom_id"] for x in lines]


def test_killed_driver_then_resume_sends_nothing_twice(ray_cluster, tmp_path):
    import subprocess
    import sys
    import time

    tasks = write_tasks(tmp_path / "tasks.jsonl", 90)
    out = tmp_path / "out.jsonl"
    work = Path(f"{out}.ray")
    address = ray_cluster.get_runtime_context().gcs_address
    with ThreadedFaultServer(FaultConfig(latency_s=0.2)) as srv:
        driver = subprocess.Popen([sys.executable, "-c", _DRIVER, address, str(tasks), str(out), srv.url])
        try:
            deadline = time.monotonic() + 180
            while len(list(work.glob("*.done.json"))) < 2:
                assert driver.poll() is None, "the driver ended before it could be killed"
                assert time.monotonic() < deadline, "no shard finished in time"
                time.sleep(0.05)
        finally:
            driver.kill()  # SIGKILL: no cleanup, Ray kills the job's actors with it
            driver.wait()
        # Wait until the killed job's actors have really stopped sending.
        last, quiet_since = -1, time.monotonic()
        while time.monotonic() - quiet_since < 2.0:
            if srv.server.total_requests != last:
                last, quiet_since = srv.server.total_requests, time.monotonic()
            time.sleep(0.1)
        assert len(list(work.glob("*.done.json"))) < 6  # really interrupted
        assert not out.exists()
        shard_outputs = sorted(p for p in work.glob("shard-*.jsonl") if not p.name.endswith(".input.jsonl"))
        done_before = {cid for p in shard_outputs for cid in _complete_ids(p)}
        # A kill in the middle of a write leaves half a line: make sure one shard has one.
        unfinished = [p for p in shard_outputs if not Path(str(p)[:-len(".jsonl")] + ".done.json").exists()]
        if unfinished:
            with open(unfinished[0], "ab") as f:
                f.write(b'{"custom_id":"line-8","id":"batch_req_')
        srv.server.reset_counts()

        result = run_on_ray(RunOptions(input=str(tasks), output=str(out), endpoints=[srv.url], cache="off",
                                       ordered=True, concurrency=2, defaults=TaskDefaults(model="m"), quiet=True),
                            RayOptions(workers=2, shards=6))
        assert result.shards is not None and result.shards.complete
        assert done_before.isdisjoint(srv.server.seen)  # nothing finished was sent again
        assert all(n == 1 for n in srv.server.seen.values())
        ids = _complete_ids(out)
        expected = [json.loads(x).get("custom_id") or f"line-{i}"
                    for i, x in enumerate(tasks.read_text().splitlines(), 1) if x.strip()]
        assert ids == expected  # every task once, in input order


def test_carpool_map_adds_results_to_a_ray_dataset(ray_cluster, zero_server, redis_url, redis_name):
    from carpool.distributed.ray_data import carpool_map

    rows = [{"custom_id": f"r{i}" if i % 2 else None, "review": f"review {i}", "stars": i % 5} for i in range(30)]
    ds = ray_cluster.data.from_items(rows)
    cache = f"{redis_url}?prefix={redis_name}:"  # the cache room's Redis store, shared by every worker
    options = {"template": "Stars {stars}: {review}", "endpoints": [zero_server.url], "cache": cache,
               "defaults": TaskDefaults(model="m", max_tokens=2, temperature=0)}
    zero_server.server.reset_counts()
    out = carpool_map(ds, workers=1, batch_size=8, **options).take_all()
    assert zero_server.server.total_requests == 30
    assert len(out) == 30
    by_review = {r["review"]: r for r in out}
    for i in range(30):
        r = by_review[f"review {i}"]
        assert r["stars"] == i % 5  # the row's own columns are kept
        assert r["error"] is None
        assert json.loads(r["response"])["choices"][0]["message"]["content"]
        if i % 2:
            assert r["custom_id"] == f"r{i}"
        else:
            assert r["custom_id"].startswith("row-")
    # A second pipeline (new actors) gets every answer from the shared cache: nothing is sent.
    again = carpool_map(ray_cluster.data.from_items(rows), workers=1, batch_size=8, **options).take_all()
    assert zero_server.server.total_requests == 30
    assert sorted(json.loads(r["response"])["choices"][0]["message"]["content"] for r in again) == \
        sorted(json.loads(r["response"])["choices"][0]["message"]["content"] for r in out)


def test_a_ray_run_reports_dollars_spent_and_saved(ray_cluster, zero_server, tmp_path):
    tasks = write_tasks(tmp_path / "tasks.jsonl", 8)
    common = {"input": str(tasks), "endpoints": [zero_server.url], "defaults": TaskDefaults(model="m"),
              "cache": f"sqlite:///{tmp_path / 'c.db'}", "price_in": 1.0, "price_out": 4.0}
    ray_opts = RayOptions(workers=1, shards=2)
    first = run_on_ray(RunOptions(output=str(tmp_path / "a.jsonl"), **common), ray_opts).to_dict()
    spent = (first["prompt_tokens"] * 1.0 + first["completion_tokens"] * 4.0) / 1e6
    assert first["prompt_tokens"] > 0 and first["cost"]["spent_usd"] == pytest.approx(spent)
    again = run_on_ray(RunOptions(output=str(tmp_path / "b.jsonl"), **common), ray_opts).to_dict()
    assert again["cache_hits"] == 8 and again["cost"]["spent_usd"] == 0
    assert again["cost"]["saved_usd"] == pytest.approx(spent)


def test_an_outage_stops_a_ray_run_with_exit_4_and_a_rerun_finishes(ray_cluster, tmp_path):
    # The endpoint is down from the start (a closed port).  Before: the shard stopped by the
    # outage was just "not finished" and `carpool run --ray` exited 1, as for a crash.
    from carpool.testing.fault_server import FaultServer
    from carpool.testing.fixtures import free_port

    port = free_port()
    tasks = write_tasks(tmp_path / "tasks.jsonl", 12)
    out = tmp_path / "out.jsonl"
    parser = argparse.ArgumentParser()
    run_command.add_arguments(parser)
    args = [str(tasks), "-o", str(out), "--endpoint", f"http://127.0.0.1:{port}/v1", "--model", "m",
            "--cache", "off", "--outage-timeout", "2s", "--ray", "--ray-workers", "1", "--ray-shards", "3",
            "--quiet", "--summary-json", str(tmp_path / "summary.json")]
    assert run_command.main(parser.parse_args(args)) == 4
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stopped_by_outage"] is True and summary["complete"] is False
    assert not out.exists()  # nothing merged; no error line was written for the unrun tasks
    shard_lines = [json.loads(x) for p in Path(f"{out}.ray").glob("shard-*.jsonl") for x in p.read_text().splitlines()]
    assert [d for d in shard_lines if d["error"] is not None] == []

    srv = ThreadedFaultServer(FaultConfig.zero())
    srv.server = FaultServer(FaultConfig.zero(), port=port)
    with srv:
        assert run_command.main(parser.parse_args(args)) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 12 and all(d["error"] is None for d in lines)
