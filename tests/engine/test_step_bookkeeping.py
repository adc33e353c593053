"""``Scheduler.update_from_output``: what a step that ran leaves behind, recorded in one place for
the engine and both simulators (computed tokens, cached blocks, sampled tokens, finishes)."""

from __future__ import annotations

from carpool.engine.block_manager import BlockManager
from carpool.engine.protocol import SamplingParams
from carpool.engine.scheduler import SampledToken, Scheduler
from carpool.engine.sequence import Sequence, SequenceStatus


def seq(rid: str, prompt: list[int], arrival: float = 0.0) -> Sequence:
    return Sequence(rid, prompt, SamplingParams(max_tokens=4), 16, 0, arrival)


def test_a_step_computes_caches_appends_and_finishes():
    bm = BlockManager(16, 16)
    sch = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = seq("a", list(range(10, 50))), seq("b", list(range(60, 80)))
    sch.add(a)
    sch.add(b)
    out = sch.schedule(now=1.0)
    assert out.sampling() == [a, b]  # both prompts fit whole: both sample
    finished = sch.update_from_output(out.scheduled, [SampledToken(a, 5), SampledToken(b, 6, "stop")], now=2.0)
    assert finished == [b]
    assert a.num_computed_tokens == 40 and a.output_token_ids == [5] and a.first_token_time == 2.0
    assert a.status is SequenceStatus.RUNNING and sch.running == [a]
    assert b.output_token_ids == [6] and b.finish_reason == "stop" and b.finished_time == 2.0
    assert b.status is SequenceStatus.FINISHED and b.block_table == []
    # a's two full prompt blocks are in the prefix cache now: the same prompt computes only its tail
    again = seq("a2", list(range(10, 50)), 3.0)
    sch.add(again)
    out = sch.schedule(now=3.0)
    assert (again, 40 - 32) in out.scheduled and again.num_cached_tokens == 32


def test_a_middle_prefill_chunk_samples_nothing_and_the_last_one_does():
    sch = Scheduler(BlockManager(16, 16), max_num_seqs=4, max_num_batched_tokens=32)
    long = seq("long", list(range(10, 60)))  # 50 tokens: two steps of at most 32
    sch.add(long)
    out = sch.schedule(now=0.0)
    assert out.scheduled == [(long, 32)] and out.sampling() == []
    assert sch.update_from_output(out.scheduled, [], now=1.0) == []
    assert long.num_computed_tokens == 32 and long.first_token_time is None
    out = sch.schedule(now=1.0)
    assert out.scheduled == [(long, 18)] and out.sampling() == [long]
    assert sch.update_from_output(out.scheduled, [SampledToken(long, 1, "length")], now=2.0) == [long]
    assert long.first_token_time == long.finished_time == 2.0 and long.finish_reason == "length"
    assert not sch.has_unfinished()
