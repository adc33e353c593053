"""Every way a task can go gives back the slots it took: the limiter's (one per attempt)
and the pipeline's (one from reading the task to writing its line).

Real jobs against a fault server on 127.0.0.1 drive each branch: an answer at once, a retry
after a 500, a 429 with Retry-After, a read timeout to the last attempt, a follower of an
identical task (dedup), an exact cache hit, and tasks cancelled in flight by a stop.  After
each job the limiter has nothing in flight or decoding and the pipeline no slot in use.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from carpool.client.pool import Timeouts
from carpool.jobs.input.tasks import TaskDefaults
from carpool.jobs.options import RunOptions
from carpool.jobs.runner import Runner
from carpool.testing.fault_server import Fault, FaultConfig, FaultServer


def _task(cid: str, text: str) -> dict:
    return {"custom_id": cid, "messages": [{"role": "user", "content": text}]}


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _lines(path: Path) -> dict[str, dict]:
    return {d["custom_id"]: d for d in map(json.loads, path.read_text().splitlines())}


def _options(src: Path, out: Path, url: str, tmp_path: Path, **kw) -> RunOptions:
    kw.setdefault("timeouts", Timeouts(read_s=0.3, total_s=5.0))
    return RunOptions(input=str(src), output=str(out), endpoints=[url], progress=False, quiet=True, stream=True,
                      cache=f"sqlite:///{tmp_path / 'cache.sqlite'}", concurrency=4, max_attempts=2,
                      defaults=TaskDefaults(model="m", max_tokens=4, temperature=0), **kw)


def _assert_all_given_back(runner: Runner) -> None:
    pipeline = runner.spread.pipeline
    assert pipeline is not None
    limiter = pipeline.parts.limiter
    assert (limiter.in_flight, limiter.decoding) == (0, 0)
    assert pipeline._slots.in_use == 0


def test_every_branch_gives_its_slots_back(tmp_path):
    faults = [Fault("500", times=1, match="retry me"), Fault("429", times=1, match="rate me", retry_after=0.01),
              Fault("stall", times=0, match="stall me", stall_s=2.0)]
    # The twins come first: read together, the second and third follow the first in flight.
    src = _write(tmp_path / "in.jsonl", [
        _task("twin-a", "twins"), _task("twin-b", "twins"), _task("twin-c", "twins"),
        _task("plain", "answer me"), _task("retry", "retry me"), _task("rate", "rate me"), _task("stall", "stall me")])

    async def main() -> tuple[Runner, Runner]:
        async with FaultServer(FaultConfig(latency_s=0.05, faults=faults)) as srv:
            first = Runner(_options(src, tmp_path / "out1.jsonl", srv.url, tmp_path, max_pending=3))
            await first.run()
            _assert_all_given_back(first)
            again = Runner(_options(src, tmp_path / "out2.jsonl", srv.url, tmp_path))
            await again.run()
            _assert_all_given_back(again)
            return first, again

    first, again = asyncio.run(main())
    one = first.spread.pipeline.stats  # type: ignore[union-attr]
    assert one.retries  # the 500 and the 429 were retried
    assert one.dedup_fanouts == 2  # the twins after the first took its answer
    out = _lines(tmp_path / "out1.jsonl")
    assert set(out) == {"plain", "retry", "rate", "stall", "twin-a", "twin-b", "twin-c"}
    assert out["stall"]["error"]["code"] == "read_timeout"
    assert all(out[c]["error"] is None for c in ("plain", "retry", "rate", "twin-a", "twin-b", "twin-c"))
    assert again.spread.pipeline.stats.cache_hits == 6  # type: ignore[union-attr]  # all but the failed one


def test_tasks_cancelled_in_flight_give_their_slots_back(tmp_path):
    src = _write(tmp_path / "in.jsonl", [_task(f"t{i}", f"hang {i}") for i in range(6)])

    async def main() -> Runner:
        async with FaultServer(FaultConfig(faults=[Fault("stall", times=0, match="hang", stall_s=3.0)])) as srv:
            runner = Runner(_options(src, tmp_path / "out.jsonl", srv.url, tmp_path, max_pending=4,
                                     timeouts=Timeouts(read_s=60.0, total_s=60.0)))
            job = asyncio.ensure_future(runner.run())
            while srv.in_flight < 4:
                await asyncio.sleep(0.02)
            runner.request_stop(0.1)  # a SIGTERM: the requests in flight are cancelled after 0.1 s
            stats = await asyncio.wait_for(job, 20)
            assert stats.interrupted and stats.done == 0
            _assert_all_given_back(runner)
            return runner

    asyncio.run(main())
    assert not (tmp_path / "out.jsonl").read_text().strip()  # nothing written: all run on resume
