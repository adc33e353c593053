"""The dynamic batcher: merging, limits, queue full, queue timeout, equality with unbatched."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from carpool.embed.dynamic_batcher import DynamicBatcher
from carpool.errors import QueueFullError, QueueTimeoutError


class RecordingModel:
    """A deterministic embed function that records every batch it is given.

    ``gate`` (a threading.Event) lets a test hold the model busy; ``delay_s`` stands in
    for the forward pass so concurrent requests pile up behind it.
    """

    def __init__(self, delay_s: float = 0.0, tokens_per_text: int = 1):
        self.batches: list[list[str]] = []
        self.gate: threading.Event | None = None
        self.delay_s = delay_s
        self.tokens_per_text = tokens_per_text
        self.started = 0  # batches handed to the model so far (counted before the gate)

    def embed(self, texts):
        self.started += 1
        if self.gate is not None:
            self.gate.wait(30)
        if self.delay_s:
            time.sleep(self.delay_s)
        self.batches.append(list(texts))
        return np.array([[len(t), sum(map(ord, t)) % 97] for t in texts], dtype=np.float32)

    def count_tokens_batch(self, texts):
        return [self.tokens_per_text] * len(texts)

    @staticmethod
    def expected(texts):
        return np.array([[len(t), sum(map(ord, t)) % 97] for t in texts], dtype=np.float32)


async def _wait_until(pred, timeout=10.0):
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "condition never became true"
        await asyncio.sleep(0.005)


def test_concurrent_requests_are_merged_within_limits():
    model = RecordingModel(delay_s=0.02)

    async def main():
        async with DynamicBatcher(model, max_queue_delay_us=20_000, max_batch_size=8) as b:
            texts = [f"text number {i}" for i in range(40)]
            outs = await asyncio.gather(*(b.embed([t]) for t in texts))
            return texts, outs, b.stats()

    texts, outs, stats = asyncio.run(main())
    for t, o in zip(texts, outs, strict=True):
        assert np.array_equal(o, RecordingModel.expected([t]))
    sizes = [len(batch) for batch in model.batches]
    assert max(sizes) > 1 and max(sizes) <= 8
    assert sum(sizes) == 40 and stats["texts"] == 40 and stats["requests"] == 40
    assert stats["batches"] == len(sizes) < 40
    assert sum(stats["batch_size_counts"].values()) == stats["batches"]
    assert stats["queue_delay_s"]["count"] == 40 and len(stats["recent_queue_delays_s"]) == 40


def test_preferred_size_runs_without_waiting_for_the_delay():
    model = RecordingModel()

    async def main():
        # A 60 s delay: only reaching the preferred size can release this batch.
        async with DynamicBatcher(model, max_queue_delay_us=60_000_000, preferred_batch_sizes=[4],
                                  max_batch_size=16) as b:
            return await asyncio.wait_for(asyncio.gather(*(b.embed([f"t{i}"]) for i in range(4))), 20)

    asyncio.run(main())
    assert [len(x) for x in model.batches] == [4]


def test_delay_bound_releases_a_lone_request():
    model = RecordingModel()

    async def main():
        async with DynamicBatcher(model, max_queue_delay_us=1_000, preferred_batch_sizes=[8]) as b:
            out = await asyncio.wait_for(b.embed(["alone"]), 20)
            return out, b.stats()

    out, stats = asyncio.run(main())
    assert np.array_equal(out, RecordingModel.expected(["alone"]))
    assert stats["batch_size_counts"] == {1: 1}
    assert stats["queue_delay_s"]["max"] >= 0.001  # it did wait for the delay before running alone


def test_token_limit_and_oversized_request():
    model = RecordingModel(tokens_per_text=10)
    model.gate = threading.Event()

    async def main():
        async with DynamicBatcher(model, max_queue_delay_us=0, max_batch_size=64, max_batch_tokens=30) as b:
            first = asyncio.create_task(b.embed(["warm-up"]))  # holds the model while others queue
            await _wait_until(lambda: model.started == 1)
            rest = [asyncio.create_task(b.embed([f"s{i}"])) for i in range(7)]
            big = asyncio.create_task(b.embed([f"b{i}" for i in range(5)]))  # 50 tokens alone
            await _wait_until(lambda: b.stats()["queue_size"] == 8)
            model.gate.set()
            await asyncio.gather(first, *rest)
            return await big

    try:
        big_out = asyncio.run(main())
    finally:
        model.gate.set()
    assert big_out.shape == (5, 2)
    sizes = [len(x) for x in model.batches]
    assert ["b0", "b1", "b2", "b3", "b4"] in model.batches  # the oversized request ran whole, alone
    assert all(n <= 3 for batch, n in zip(model.batches, sizes, strict=True) if batch[0][0] != "b")
    assert sizes.count(3) >= 2  # the seven small ones were packed to the 30-token cap


def test_queue_full_rejects_immediately_then_recovers():
    model = RecordingModel()
    model.gate = threading.Event()

    async def main():
        async with DynamicBatcher(model, max_queue_delay_us=0, max_batch_size=1, max_queue_size=2) as b:
            running = asyncio.create_task(b.embed(["running"]))
            await _wait_until(lambda: model.started == 1)
            queued = [asyncio.create_task(b.embed([f"q{i}"])) for i in range(2)]
            await _wait_until(lambda: b.stats()["queue_size"] == 2)
            with pytest.raises(QueueFullError) as err:
                await b.embed(["one too many"])
            assert err.value.retry_after_s >= 1
            model.gate.set()
            await asyncio.gather(running, *queued)
            after = await b.embed(["after"])  # the queue drained: accepted again
            return after, b.stats()

    try:
        after, stats = asyncio.run(main())
    finally:
        model.gate.set()
    assert np.array_equal(after, RecordingModel.expected(["after"]))
    assert stats["rejected"] == 1
    assert ["one too many"] not in model.batches


def test_queue_timeout_fails_waiting_request_but_not_running_one():
    model = RecordingModel()
    model.gate = threading.Event()

    async def main():
        async with DynamicBatcher(model, max_queue_delay_us=0, max_batch_size=1, queue_timeout_s=0.2) as b:
            running = asyncio.create_task(b.embed(["running"]))
            await _wait_until(lambda: model.started == 1)
            with pytest.raises(QueueTimeoutError):
                await b.embed(["late"])
            model.gate.set()
            out = await running  # started before its timeout, so it still gets its answer
            return out, b.stats()

    try:
        out, stats = asyncio.run(main())
    finally:
        model.gate.set()
    assert np.array_equal(out, RecordingModel.expected(["running"]))
    assert stats["timed_out"] == 1 and stats["queue_size"] == 0
    assert ["late"] not in model.batches  # never ran late


def test_model_error_reaches_callers_and_batcher_keeps_working():
    calls = []

    def flaky(texts):
        calls.append(list(texts))
        if "boom" in texts:
            raise RuntimeError("model exploded")
        return RecordingModel.expected(texts)

    async def main():
        async with DynamicBatcher(flaky, max_queue_delay_us=0, max_batch_size=1) as b:
            with pytest.raises(RuntimeError, match="exploded"):
                await b.embed(["boom"])
            return await b.embed(["fine"]), b.stats()

    out, stats = asyncio.run(main())
    assert np.array_equal(out, RecordingModel.expected(["fine"]))
    assert stats["failed"] == 1


def test_listener_sees_each_batch():
    events = []
    model = RecordingModel(delay_s=0.01)

    async def main():
        async with DynamicBatcher(model, max_queue_delay_us=5_000, max_batch_size=4) as b:
            b.add_batch_listener(events.append)
            await asyncio.gather(*(b.embed([f"x{i}", f"y{i}"]) for i in range(6)))

    asyncio.run(main())
    assert sum(e["batch_size"] for e in events) == 12
    assert all(e["batch_size"] <= 4 and len(e["queue_delays_s"]) == e["num_requests"] for e in events)


@pytest.mark.real_model
def test_real_embedder_batched_equals_unbatched(embedder):
    texts = [f"review {i}: " + "good product " * (i % 7) for i in range(24)]
    expected = embedder.embed(texts)

    async def main():
        async with DynamicBatcher(embedder, max_queue_delay_us=10_000, preferred_batch_sizes=[8],
                                  max_batch_size=16) as b:
            outs = await asyncio.gather(*(b.embed([t]) for t in texts))
            return np.concatenate(outs), b.stats()

    got, stats = asyncio.run(main())
    assert got.shape == (24, 384)
    assert np.abs(got - expected).max() < 1e-5
    assert max(stats["batch_size_counts"]) > 1
