"""`carpool bench` and diagnose on the embedded engine (tiny-random model)."""

from __future__ import annotations

import asyncio
import json

import pytest

from carpool.bench.datasets import random_requests
from carpool.bench.diagnose import Diagnoser
from carpool.cli import main

engine_mod = pytest.importorskip("carpool.engine")


def test_bench_cli_on_embedded_engine(tmp_path):
    out = tmp_path / "r.json"
    rc = main(
        [
            "bench",
            "--model",
            "tiny-random",
            "--dataset",
            "shared-prefix",
            "--num-prompts",
            "6",
            "--num-prefixes",
            "2",
            "--prefix-len",
            "64",
            "--suffix-len",
            "8",
            "--random-output-len",
            "6",
            "--max-concurrency",
            "2",
            "--result-file",
            str(out),
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["backend"] == "carpool-engine" and res["completed"] == 6
    assert res["total_output_tokens"] == 36  # EOS ignored: 6 tokens each
    assert res["total_input_tokens"] >= 6 * 64  # the engine's own prompt token count
    assert res["total_cached_tokens"] > 0  # later prompts of a group hit the prefix cache
    assert res["mean_ttft_ms"] > 0 and res["mean_tpot_ms"] > 0


def test_diagnose_on_embedded_engine():
    from carpool.engine import AsyncEngine
    from carpool.engine.config import EngineConfig

    async def go():
        async with AsyncEngine(EngineConfig(model="tiny-random")) as engine:
            reqs = random_requests(9, input_len=16, output_len=12)
            return await Diagnoser(reqs, concurrency=3, serial_tasks=3, engine=engine, scale_up=1).run()

    d = asyncio.run(go())
    # No connection phase in-process, no phase past C (scale_up=1); a check phase when the
    # advice names a concurrency not measured.
    assert [p.concurrency for p in d.phases][:2] == [1, 3]
    assert all(p.name.startswith("check") for p in d.phases[2:])
    assert d.server_metrics  # engine.stats() stands in for /metrics
    assert d.verdict in {"client-bound", "server-queueing", "decode-bound", "prefill-bound"}
    assert all(p.errors == 0 for p in d.phases)
    assert d.phases[1].server.peak_running >= 1
