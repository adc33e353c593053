"""The scheduler on a clock it is given: what the simulator relies on to run it on simulated time."""

from __future__ import annotations

from carpool.engine.block_manager import BlockManager
from carpool.engine.protocol import SamplingParams
from carpool.engine.scheduler import SampledToken, Scheduler
from carpool.engine.sequence import Sequence


def seq(rid: str, n: int, arrival: float) -> Sequence:
    return Sequence(rid, list(range(10, 10 + n)), SamplingParams(max_tokens=4), 16, 0, arrival)


def test_a_given_now_times_the_queue_waits():
    sch = Scheduler(BlockManager(64, 16), max_num_seqs=1, max_num_batched_tokens=64)
    first, second = seq("a", 20, 1.0), seq("b", 20, 2.0)
    sch.add(first)
    sch.add(second)
    out = sch.schedule(now=5.0)
    assert [s.request_id for s, _ in out.scheduled] == ["a"]
    assert first.first_scheduled_time == 5.0 and first.wait_accum == 4.0
    sch.finish(first, "length")
    sch.schedule(now=9.5)
    assert second.first_scheduled_time == 9.5 and second.wait_accum == 7.5


def test_a_preempted_sequence_waits_from_the_given_now():
    """Three blocks for two sequences that each grow into a second one: the second decode of
    the step finds no block, preempts itself and waits again from the step's time."""
    bm = BlockManager(3, 16)
    sch = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64)
    a, b = seq("a", 16, 0.0), seq("b", 16, 0.0)
    sch.add(a)
    sch.add(b)
    out = sch.schedule(now=1.0)
    sch.update_from_output(out.scheduled, [SampledToken(s, 7) for s in out.sampling()], now=1.5)
    out = sch.schedule(now=2.5)
    assert [s.request_id for s, _ in out.scheduled] == ["a"] and out.preempted == [b]
    assert b.waiting_since == 2.5 and b.wait_accum == 1.0 and sch.num_preemptions == 1
