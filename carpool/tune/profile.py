"""Fit the profiled cost model on carpool's engine, on this machine.

Runs calibration workloads through an in-process ``AsyncEngine`` with a
``StepRecorder`` attached, then fits step time on prefill tokens, decode tokens, the KV
vectors the attention kernel loads, attention pairs, sequences and logits rows
(non-negative least squares).  Before that, one small workload is timed twice: how far apart
the two are says how steady the machine is (``fit_info["repeat_spread"]``,
``carpool.tune.steadiness``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from carpool.tune.cost import ProfiledCost, StepShape
from carpool.tune.engine_load import StepRecorder, run_load
from carpool.tune.workload import SimRequest, synthetic


def calibration_workloads(seed: int = 100) -> list[list[SimRequest]]:
    """Shapes that pull the terms apart: pure decode at a few batch sizes and contexts,
    prefill-heavy bursts, long prompts that arrive alone, lone prefill chunks of many
    lengths, and a mixed open-loop stream
    (kept last: the validation benchmark reuses it as its speed probe)."""
    return [
        synthetic(8, float("inf"), "uniform:16,64", "fixed:24", seed),  # small-batch decode
        # Staggered finishes: decode steps with 6 down to 1 sequences.  An open-loop stream at
        # moderate load spends most of its steps there, and the workloads above (every
        # sequence finishing together) gave the fit almost none of them.
        synthetic(6, float("inf"), "uniform:16,160", "uniform:8,80", seed + 5),
        synthetic(24, float("inf"), "uniform:32,96", "fixed:24", seed + 1),  # larger-batch decode
        synthetic(12, float("inf"), "uniform:300,700", "fixed:24", seed + 2),  # long prompts: prefill, KV reads
        # Long prompts trickling in: steps holding one whole chunk of a single prompt, where
        # attention pairs and kernel KV loads are largest per token.  A burst gives only a
        # few such steps; without them the KV-load cost is pinned by long-context decodes
        # alone, where it is nearly collinear with the decode term, and it drifted 7x
        # between fits (so did the predicted time of every lone long prefill).
        synthetic(10, 0.7, "uniform:200,900", "fixed:4", seed + 4),
        isolated_prefills(),
        synthetic(24, 6.0, "uniform:16,400", "uniform:4,40", seed + 3),  # mixed stream
    ]


# Prompt lengths for isolated_prefills: whole prompts up to one 512-token chunk, and longer
# ones whose later chunks attend to 512+ cached tokens.
ISOLATED_PROMPT_LENS = (48, 96, 160, 256, 352, 448, 512, 640, 768, 900, 1000)


def isolated_prefills(lengths: tuple[int, ...] = ISOLATED_PROMPT_LENS, seconds_per_token: float = 2.6e-3,
                      gap_s: float = 0.4) -> list[SimRequest]:
    """One prompt at a time (each arrives after the last should be done), 2 output tokens:
    steps that hold a single prefill chunk, fresh or after 512 cached tokens.

    The fit is a compromise over the shapes it is given, and before these it was given
    almost no lone prefill chunks: the bursts mix many chunks with decodes.  It then
    priced a lone 500-token prompt at ~0.86 s where the engine took ~0.96 s, and in a
    mixed stream those prompts are the slowest requests and stall every decode behind
    them.  Timed alone, such chunks follow base + 1.16 ms/token + 2.05 ms per thousand
    (query, key) pairs within 5%, fresh or not.  The spacing assumes ~2.6 ms per prompt
    token; on a slower machine prompts overlap a little, which only mixes a few steps.
    """
    out, t = [], 0.0
    for i, n in enumerate(lengths):
        out.append(SimRequest(f"iso{i}", t, n, 2))
        t += gap_s + n * seconds_per_token
    return out


def record_engine(engine: Any, workloads: list[list[SimRequest]], tag: str = "cal") -> list[tuple[StepShape, float]]:
    """Run each workload through ``engine`` (an ``AsyncEngine``) and return the step samples."""
    rec = StepRecorder(engine.engine)
    for i, w in enumerate(workloads):
        reqs = [SimRequest(f"{tag}{i}-{r.request_id}", r.arrival, r.prompt_len, r.output_len, r.priority,
                           r.prefix_group, r.prefix_len) for r in w]
        asyncio.run(run_load(engine, reqs))
    return rec.fit_samples()


def repeat_spread(engine: Any, workload: list[SimRequest], times: int = 2) -> float:
    """``workload`` run ``times`` times on ``engine``: the slowest run's time over the fastest's, minus 1."""
    durations = []
    for i in range(times):
        reqs = [SimRequest(f"steady{i}-{r.request_id}", r.arrival, r.prompt_len, r.output_len) for r in workload]
        t0 = time.perf_counter()
        asyncio.run(run_load(engine, reqs))
        durations.append(time.perf_counter() - t0)
    return max(durations) / max(min(durations), 1e-9) - 1.0


def kv_capacity_tokens(engine: Any) -> int:
    e = engine.engine
    return e.num_blocks * e.block_size


def fit_engine(engine: Any, workloads: list[list[SimRequest]] | None = None, name: str | None = None,
               warmup: bool = True) -> ProfiledCost:
    if warmup:  # first forwards of new shapes are slow (allocator, kernels): keep them out of the fit
        record_engine(engine, [synthetic(4, float("inf"), "uniform:32,400", "fixed:4", 7)], "warm")
    spread = repeat_spread(engine, synthetic(8, float("inf"), "uniform:16,64", "fixed:24", 99))
    samples = record_engine(engine, workloads or calibration_workloads())
    cost = ProfiledCost.fit(samples, kv_tokens=kv_capacity_tokens(engine),
                            name=name or f"carpool-engine:{engine.model_name}")
    cost.fit_info["repeat_spread"] = spread
    return cost
