"""Drive carpool's real engine (in-process ``AsyncEngine``) with a workload and time it.

``run_load`` replays ``SimRequest``s at their arrival times (open loop), or keeps at most
``concurrency`` in flight (closed loop), and returns per-request records in the same form
the simulator produces.  ``StepRecorder`` captures every engine step's shape (including
the KV tokens attention reads, which the step listener does not report) and its time,
the samples the profiled cost model is fitted on.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from carpool.tune.cost import StepShape
from carpool.tune.workload import SimRequest


def prompt_token_ids(r: SimRequest, vocab: int) -> list[int]:
    """Deterministic token ids: the shared prefix depends on the group only, the rest on the id."""
    lo, hi = 10, max(vocab - 1, 11)  # stay clear of the special tokens at the bottom of the vocab
    ids: list[int] = []
    if r.prefix_group is not None and r.prefix_len:
        g = random.Random(f"prefix:{r.prefix_group}")
        ids = [g.randrange(lo, hi) for _ in range(min(r.prefix_len, r.prompt_len))]
    u = random.Random(f"req:{r.request_id}")
    ids += [u.randrange(lo, hi) for _ in range(r.prompt_len - len(ids))]
    return ids


class StepRecorder:
    """Wraps one ``LLMEngine``'s scheduler to record (shape, duration, cycle) per step.

    ``cycle_s`` is the time from this step's schedule() to the next one's when the engine
    went straight on (it had work left): the whole loop iteration, delivery included,
    which is what a request actually waits per step.
    """

    def __init__(self, llm_engine: Any):
        self.samples: list[dict] = []
        self._pending: tuple[float, StepShape] | None = None
        sched = llm_engine.scheduler
        orig = sched.schedule

        def schedule():
            t = time.perf_counter()
            out = orig()
            shape = StepShape.of([(seq.num_computed_tokens, n) for seq, n in out.scheduled],
                                 out.num_decode_tokens, len(out.sampling()))
            if self.samples and self.samples[-1]["busy_after"] and self.samples[-1]["cycle_s"] is None:
                self.samples[-1]["cycle_s"] = t - self.samples[-1]["t"]
            self._pending = (t, shape)
            return out

        sched.schedule = schedule
        llm_engine.add_step_listener(self._on_step)

    def _on_step(self, info: dict) -> None:
        if self._pending is None:
            return
        t, shape = self._pending
        self._pending = None
        if shape.num_seqs == 0:
            return
        busy = info.get("num_running", 0) + info.get("num_waiting", 0) > 0
        self.samples.append({"t": t, "shape": shape, "duration_s": info["duration_s"], "busy_after": busy,
                             "cycle_s": None})

    def fit_samples(self, start: int = 0, end: int | None = None) -> list[tuple[StepShape, float]]:
        """(shape, seconds) pairs of samples[start:end]: the cycle time where known, else the
        step's own duration plus the median gap between the two."""
        gaps = sorted(s["cycle_s"] - s["duration_s"] for s in self.samples if s["cycle_s"] is not None)
        gap = gaps[len(gaps) // 2] if gaps else 0.0
        return [(s["shape"], s["cycle_s"] if s["cycle_s"] is not None else s["duration_s"] + gap)
                for s in self.samples[start:end]]

    def clear(self) -> None:
        self.samples.clear()


async def run_load(engine: Any, requests: list[SimRequest], concurrency: int | None = None,
                   vocab: int | None = None) -> list[dict]:
    """Replay ``requests`` against an ``AsyncEngine``; records have times in seconds from the start.

    Each request is a text completion of token ids (greedy, EOS ignored, ``output_len`` tokens)
    run as ``carpool serve`` runs one (``carpool.openai``'s ``run_request``): what is timed is
    the path a served request takes, minus HTTP."""
    from carpool.openai.requests import Translator

    vocab = vocab or engine.engine.model_config.vocab_size
    translator = Translator(engine)
    prompts = {r.request_id: prompt_token_ids(r, vocab) for r in requests}
    slots = asyncio.Semaphore(concurrency) if concurrency else contextlib.nullcontext()
    t0 = time.monotonic() + 0.02
    records: list[dict] = []

    async def one(r: SimRequest) -> None:
        async with slots:
            records.append(await _timed(engine, translator, r, prompts[r.request_id], t0))

    await replay_arrivals(requests, t0, one)
    return records


async def _timed(engine: Any, translator: Any, r: SimRequest, prompt: list[int], t0: float) -> dict:
    """Run one request on ``engine``; its record (times in seconds from ``t0``)."""
    from carpool.openai.generation import run_request

    rec = {"id": r.request_id, "arrival": r.arrival, "submit": time.monotonic() - t0, "first_token": None,
           "finish": None, "prompt_len": r.prompt_len, "output_len": r.output_len, "error": None}
    body = {"prompt": prompt, "max_tokens": r.output_len, "temperature": 0, "ignore_eos": True,
            "priority": r.priority}
    n = 0

    def on_delta(choice: Any, d: Any) -> None:
        nonlocal n
        if d.token_ids and rec["first_token"] is None:
            rec["first_token"] = time.monotonic() - t0
        n += len(d.token_ids)
        if d.finished:
            rec["finish"] = time.monotonic() - t0
            if d.usage is not None:
                rec["cached_tokens"] = d.usage.cached_tokens

    try:
        prepared = translator.prepare("completion", body, response_id=r.request_id)
        await run_request(engine, prepared, str(engine.model_name), on_delta)
    except Exception as e:  # noqa: BLE001 - an engine error is a failed request, not a crashed run
        rec["error"] = repr(e)
    rec["output_len"] = n or r.output_len
    return rec


async def replay_arrivals(requests: list[SimRequest], t0: float,
                          one: Callable[[SimRequest], Awaitable[None]]) -> None:
    """Start ``one(r)`` for each request at ``t0 + r.arrival`` (monotonic clock), in arrival
    order, and wait for all of them; the open loop of both ``run_load`` and the HTTP evaluator."""
    tasks = []
    for r in sorted(requests, key=lambda x: x.arrival):
        delay = t0 + r.arrival - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(r)))
    await asyncio.gather(*tasks)
