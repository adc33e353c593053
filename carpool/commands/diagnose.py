"""``carpool diagnose [--endpoint URL] tasks.jsonl``: explain where the time goes."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from carpool.bench.datasets import load_jsonl
from carpool.bench.diagnose import Diagnoser, Diagnosis
from carpool.commands import flags
from carpool.errors import DatasetError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("tasks", help="workload JSONL (messages or prompt, max_tokens per line)")
    flags.add_target_flags(p)
    p.add_argument("--concurrency", type=flags.positive_int, default=8,
                   help="the client's concurrency to test (default 8)")
    p.add_argument("--num-tasks", type=flags.positive_int, default=64, help="tasks read from the file (default 64)")
    p.add_argument("--serial-tasks", type=flags.positive_int, default=8, help="tasks in the serial phases (default 8)")
    p.add_argument("--max-tokens", type=flags.positive_int, default=None, help="override every task's max_tokens")
    flags.add_json_flag(p, "the diagnosis too")


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
            api_key=flags.api_key(args.api_key),
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
    print(diagnosis.format(), file=sys.stderr if args.json_out == "-" else sys.stdout)
    if args.json_out:
        flags.write_json(json.dumps(diagnosis.to_dict(), indent=2), args.json_out)
    return 0
