"""``carpool diagnose [--endpoint URL] tasks.jsonl``: explain where the time goes."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from carpool.bench.datasets import DatasetError, load_jsonl
from carpool.bench.diagnose import Diagnoser, Diagnosis


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("tasks", help="workload JSONL (messages or prompt, max_tokens per line)")
    p.add_argument(
        "--endpoint", help="OpenAI base URL, e.g. http://host:8000/v1 (default: the embedded engine)"
    )
    p.add_argument("--model", help="model name sent to the endpoint, or the embedded engine's model")
    p.add_argument("--api-key", help="bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--concurrency", type=int, default=8, help="the client's concurrency to test (default 8)")
    p.add_argument("--num-tasks", type=int, default=64, help="tasks read from the file (default 64)")
    p.add_argument("--serial-tasks", type=int, default=8, help="tasks in the serial phases (default 8)")
    p.add_argument("--max-tokens", type=int, default=None, help="override every task's max_tokens")
    p.add_argument("--json", dest="json_out", help="also write the diagnosis as JSON to this path")


async def _run(args: argparse.Namespace) -> Diagnosis:
    tasks = load_jsonl(args.tasks, args.num_tasks)
    if args.max_tokens:
        for t in tasks:
            t.max_tokens = args.max_tokens
    if args.endpoint:
        d = Diagnoser(
            tasks,
            args.concurrency,
            args.serial_tasks,
            endpoint=args.endpoint,
            model=args.model,
            api_key=args.api_key,
        )
        return await d.run()
    from carpool.engine import AsyncEngine
    from carpool.engine.config import EngineConfig

    async with AsyncEngine(EngineConfig(model=args.model or "smollm2")) as engine:
        return await Diagnoser(tasks, args.concurrency, args.serial_tasks, engine=engine).run()


def main(args: argparse.Namespace) -> int:
    try:
        diagnosis = asyncio.run(_run(args))
    except (DatasetError, ValueError, RuntimeError) as e:
        print(f"carpool diagnose: {e}", file=sys.stderr)
        return 2
    print(diagnosis.format())
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(diagnosis.to_dict(), indent=2), encoding="utf-8")
    return 0
