"""Replay a workload through carpool's *own* scheduler and block manager, no model.

``carpool.engine.scheduler.Scheduler`` + ``BlockManager`` + ``Sequence`` are driven
step by step on a virtual clock; a cost model gives each step's duration and sampling
is replaced by a fixed token.  It is slower than ``simulator.Simulator`` (it builds real
token lists and hash chains) and exists to check that the simulator's scheduler model
makes the same decisions as the engine's, step for step.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

from carpool.extras import require
from carpool.tune.cost import CostModel, StepShape
from carpool.tune.engine_load import num_sampling_rows, prompt_token_ids
from carpool.tune.simulator import SimConfig
from carpool.tune.workload import SimRequest


@contextlib.contextmanager
def _virtual_clock(module, clock: list[float]) -> Iterator[None]:
    """The scheduler reads time.monotonic() for queue waits: point it at our clock."""
    real = module.time
    module.time = types.SimpleNamespace(monotonic=lambda: clock[0], perf_counter=lambda: clock[0])
    try:
        yield
    finally:
        module.time = real


def replay(requests: list[SimRequest], cfg: SimConfig, cost: CostModel, num_blocks: int,
           vocab: int = 49152) -> dict:
    """Steps (shape, preemptions) and per-request first-token / finish times."""
    require("engine", "replaying a workload through carpool's scheduler")
    from carpool.engine import scheduler as sched_mod
    from carpool.engine.block_manager import BlockManager
    from carpool.engine.protocol import SamplingParams
    from carpool.engine.sequence import Sequence

    bm = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
    sch = sched_mod.Scheduler(bm, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.scheduling_policy,
                              cfg.enable_chunked_prefill)
    pending = sorted(requests, key=lambda r: r.arrival)
    clock = [pending[0].arrival if pending else 0.0]
    steps: list[dict] = []
    out: dict[str, dict] = {}
    want = {r.request_id: r.output_len for r in requests}
    i = 0
    with _virtual_clock(sched_mod, clock):
        while i < len(pending) or sch.has_unfinished():
            while i < len(pending) and pending[i].arrival <= clock[0] + 1e-12:
                r = pending[i]
                seq = Sequence(r.request_id, prompt_token_ids(r, vocab), SamplingParams(max_tokens=r.output_len),
                               cfg.block_size, r.priority, r.arrival)
                sch.add(seq)
                out[r.request_id] = {"submit": r.arrival, "first_token": None, "finish": None}
                i += 1
            if not sch.has_unfinished():
                clock[0] = pending[i].arrival
                continue
            so = sch.schedule()
            shape = StepShape.of([(seq.num_computed_tokens, n) for seq, n in so.scheduled], so.num_decode_tokens,
                                 num_sampling_rows(so.scheduled))
            steps.append({"t": clock[0], "num_prefill_tokens": so.num_prefill_tokens,
                          "num_decode_tokens": so.num_decode_tokens, "num_seqs": len(so.scheduled),
                          "num_preempted": len(so.preempted), "free_blocks": bm.num_free_blocks})
            if not so.scheduled:
                continue
            clock[0] += cost.step_time(shape)
            for seq, n in so.scheduled:
                seq.num_computed_tokens += n
                bm.cache_full_blocks(seq)
                if seq.num_computed_tokens == seq.num_tokens:
                    seq.token_ids.append(7 + seq.num_output_tokens % 1000)  # a token, whatever its value
                    rec = out[seq.request_id]
                    if rec["first_token"] is None:
                        rec["first_token"] = clock[0]
                    if seq.num_output_tokens >= want[seq.request_id]:
                        rec["finish"] = clock[0]
                        sch.finish(seq)
    return {"steps": steps, "requests": out, "num_preemptions": sch.num_preemptions}
