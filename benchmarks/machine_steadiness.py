"""How steady is this machine?  The same engine step, timed over and over.

    python benchmarks/machine_steadiness.py [--seconds 240] [--window 6]

Runs one request shape through carpool's engine (``LLMEngine``, synchronously, one torch
thread) again and again: a 256-token prompt (one prefill step) and 19 decode steps of
a single sequence.  Every step of a kind does the same work, so any change in its time
is the machine, not the engine.  Per window it reports the median prefill and decode
step and the CPU time the hypervisor stole (``/proc/stat``).

This is the floor under ``simulator_validation.py``: a cost model fitted at one minute
cannot predict steps that run 10% slower the next, and the P99 of a stream near
saturation turns a few percent of speed into tens of percent of latency.
Prints one JSON object.
"""

from __future__ import annotations

from carpool.engine.process import configure_process

configure_process()  # as the carpool command does: before anything imports torch (OMP_WAIT_POLICY)

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from carpool.engine import EngineConfig
from carpool.engine.llm_engine import LLMEngine
from carpool.engine.protocol import GenerateRequest, SamplingParams


def cpu_times() -> tuple[int, int]:
    """(steal, total) jiffies over all CPUs; 0, 0 where /proc/stat has no steal column."""
    try:
        with open("/proc/stat") as f:
            v = f.readline().split()
        return int(v[8]), sum(int(x) for x in v[1:])
    except (OSError, IndexError, ValueError):
        return 0, 0


def spread(values: list[float]) -> float:
    """(max - min) / median."""
    return (max(values) - min(values)) / statistics.median(values)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--seconds", type=float, default=240.0)
    ap.add_argument("--window", type=float, default=6.0, help="seconds per reported window")
    ap.add_argument("--prompt-len", type=int, default=256)
    args = ap.parse_args()

    eng = LLMEngine(EngineConfig(model=args.model, max_num_seqs=8, max_num_batched_tokens=512, num_threads=1))
    vocab = eng.model_config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    def one(i: int) -> list[float]:
        ids = [rng.randrange(10, vocab - 1) for _ in range(args.prompt_len)]  # new tokens: no prefix-cache hit
        eng.add_request(GenerateRequest(f"s{i}", params, prompt_token_ids=ids))
        times = []
        while eng.has_unfinished():
            t = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t)
        return times

    for i in range(3):  # warm-up: first forwards of a shape are slow
        one(-1 - i)
    windows, prefill, decode = [], [], []
    t0 = w0 = time.monotonic()
    s0 = cpu_times()
    i = 0
    while time.monotonic() - t0 < args.seconds:
        times = one(i)
        i += 1
        prefill.append(times[0])
        decode += times[1:]
        if time.monotonic() - w0 >= args.window:
            s1 = cpu_times()
            windows.append({"t_s": round(time.monotonic() - t0, 1),
                            "prefill_ms": round(statistics.median(prefill) * 1e3, 1),
                            "decode_ms": round(statistics.median(decode) * 1e3, 1),
                            "steal_pct": round(100 * (s1[0] - s0[0]) / max(s1[1] - s0[1], 1), 2)})
            prefill, decode, w0, s0 = [], [], time.monotonic(), s1
    for w in windows:
        print(json.dumps(w), file=sys.stderr)
    pf = [w["prefill_ms"] for w in windows]
    dc = [w["decode_ms"] for w in windows]
    print(json.dumps({
        "benchmark": "machine_steadiness", "model": args.model, "prompt_len": args.prompt_len,
        "seconds": args.seconds, "window_s": args.window, "windows": len(windows),
        "prefill_ms": {"median": round(statistics.median(pf), 1), "min": min(pf), "max": max(pf)},
        "decode_ms": {"median": round(statistics.median(dc), 1), "min": min(dc), "max": max(dc)},
        # (max - min) / median of the window medians: how far the same step's time moves.
        "prefill_spread": round(spread(pf), 3), "decode_spread": round(spread(dc), 3),
        "max_steal_pct": max(w["steal_pct"] for w in windows),
        "load_average_1m": round(os.getloadavg()[0], 1),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
