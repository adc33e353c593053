"""Python API: ``run_batch("tasks.jsonl", "results.jsonl", endpoints=[...])``.

The same pipeline as ``carpool run``; keyword arguments are the fields of
``carpool.jobs.runner.RunOptions`` (``concurrency``, ``cache``, ``ordered``, ``engine``...).
Returns the job summary as a dict (``JobStats.to_dict()``).
"""

from __future__ import annotations

import asyncio

from carpool.jobs.runner import Runner, RunOptions


async def arun_batch(input: str, output: str, **options) -> dict:
    """Run a job inside a running event loop."""
    runner = Runner(RunOptions(input=str(input), output=str(output), **options))
    stats = await runner.run()
    out = stats.to_dict()
    out["messages"] = runner.messages
    return out


def run_batch(input: str, output: str, **options) -> dict:
    """Run a job to the end (blocking).  ``progress`` defaults to off here."""
    options.setdefault("progress", False)
    return asyncio.run(arun_batch(input, output, **options))
