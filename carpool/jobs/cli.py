"""``carpool run``: run every task of a file, against the embedded engine or endpoints."""

from __future__ import annotations

import argparse
import json
import os
import sys

from carpool.cache.keys import SEMANTIC_THRESHOLD as SEMANTIC_DEFAULT
from carpool.client.pool import Timeouts
from carpool.jobs.readers import FORMATS
from carpool.jobs.tasks import TaskDefaults, Template


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", help="tasks file: .jsonl (plain or OpenAI Batch format), .csv, .parquet")
    p.add_argument("-o", "--output", help="results JSONL (default: <input>.results.jsonl); "
                                          "running again with the same output resumes")
    p.add_argument("--errors", help="write failed tasks here instead of into the output")
    g = p.add_argument_group("input")
    g.add_argument("--format", choices=FORMATS, help="default: from the file extension")
    g.add_argument("--template", help="CSV/Parquet: build the prompt from columns, e.g. 'Classify: {review}'")
    g.add_argument("--system", help="with --template: a system message")
    g.add_argument("--id-column", help="with --template: the column holding custom_id")
    g.add_argument("--kind", choices=("chat", "completion", "embedding"), default="chat",
                   help="with --template: the task kind (default chat)")
    g.add_argument("--max-tokens", type=int, help="for tasks that do not set max_tokens")
    g.add_argument("--temperature", type=float, help="for tasks that do not set temperature")
    g = p.add_argument_group("target")
    g.add_argument("--endpoint", action="append", default=[],
                   help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1 (repeat for several); "
                        "default: the embedded engine in-process")
    g.add_argument("--model", help="with --endpoint: the model name sent; without: the embedded engine's "
                                   "model (smollm2, tiny-random or a HF folder; default smollm2)")
    g.add_argument("--api-key", default=None, help="default: $CARPOOL_API_KEY or $OPENAI_API_KEY")
    g.add_argument("--max-num-seqs", type=int, help="embedded engine: requests batched per step")
    g.add_argument("--no-stream", action="store_true", help="HTTP: do not stream (no TTFT/TPOT)")
    g = p.add_argument_group("throughput")
    g.add_argument("--concurrency", type=int, help="fixed number of requests in flight (default: adaptive)")
    g.add_argument("--max-concurrency", type=int, help="cap for the adaptive limiter")
    g.add_argument("--rpm", type=float, help="requests per minute budget")
    g.add_argument("--tpm", type=float, help="tokens per minute budget")
    g.add_argument("--ordered", action="store_true", help="write results in input order")
    g.add_argument("--prefix-order", action="store_true",
                   help="send tasks sharing a prompt prefix together (within --prefix-window tasks)")
    g.add_argument("--prefix-window", type=int, default=1024)
    g.add_argument("--max-pending", type=int, default=2048, help="tasks held in memory at once")
    g = p.add_argument_group("reliability")
    g.add_argument("--max-attempts", type=int, default=6)
    g.add_argument("--idempotent", choices=("auto", "on", "off"), default="auto",
                   help="may a request that might have run be sent again? auto: yes for temperature 0 "
                        "and embeddings")
    g.add_argument("--connect-timeout", type=float, default=10.0)
    g.add_argument("--read-timeout", type=float, default=60.0, help="seconds between two chunks")
    g.add_argument("--total-timeout", type=float, default=600.0, help="seconds for one attempt")
    g.add_argument("--fresh", action="store_true", help="ignore (delete) an earlier output instead of resuming")
    g = p.add_argument_group("cache")
    g.add_argument("--cache", default=None, help="sqlite:///path, redis://host:6379/0 or off "
                                                 "(default: the SQLite file in ~/.cache/carpool)")
    g.add_argument("--cache-ttl", type=float, help="seconds a cached result stays valid")
    g.add_argument("--cache-sampled", action="store_true", help="also cache temperature > 0 results")
    g.add_argument("--semantic-cache", type=float, metavar="THRESHOLD", nargs="?", const=SEMANTIC_DEFAULT,
                   help="reuse results of near-identical label-like tasks: candidates with cosine >= THRESHOLD "
                        f"(default {SEMANTIC_DEFAULT}) that the verification stage finds asking the same thing")
    g.add_argument("--semantic-audit", type=int, default=0, metavar="N",
                   help="after the job, re-ask N random semantic hits for real and report how many disagreed")
    g.add_argument("--no-dedup", action="store_true", help="send identical tasks separately")
    g = p.add_argument_group("reporting")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--report", help="write an HTML report with plots")
    g.add_argument("--summary-json", help="write the summary as JSON here ('-': stdout)")
    g.add_argument("--dry-run", action="store_true", help="validate and write without calling any model")
    g.add_argument("--quiet", action="store_true")

    from carpool.distributed.ray_runner import add_ray_arguments

    add_ray_arguments(p)


def options_from_args(args: argparse.Namespace):
    from carpool.jobs.runner import RunOptions

    template = None
    if args.template:
        template = Template(args.template, system=args.system, id_column=args.id_column, kind=args.kind)
    endpoints = list(args.endpoint or [])
    defaults = TaskDefaults(model=args.model if endpoints else None, max_tokens=args.max_tokens,
                            temperature=args.temperature, idempotent=args.idempotent)
    engine_config = {}
    if args.max_num_seqs:
        engine_config["max_num_seqs"] = args.max_num_seqs
    output = args.output or (os.path.splitext(args.input)[0] + ".results.jsonl")
    return RunOptions(
        input=args.input, output=output, errors=args.errors, fmt=args.format, template=template,
        defaults=defaults, endpoints=endpoints,
        api_key=args.api_key or os.environ.get("CARPOOL_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        engine_model=(args.model if not endpoints and args.model else "smollm2"), engine_config=engine_config,
        concurrency=args.concurrency, max_concurrency=args.max_concurrency, rpm=args.rpm, tpm=args.tpm,
        stream=not args.no_stream,
        timeouts=Timeouts(args.connect_timeout, args.read_timeout, args.total_timeout),
        max_attempts=args.max_attempts, ordered=args.ordered, prefix_order=args.prefix_order,
        prefix_window=args.prefix_window, cache=args.cache, cache_ttl=args.cache_ttl,
        cache_sampled=args.cache_sampled, semantic_cache=args.semantic_cache, semantic_audit=args.semantic_audit,
        dedup=not args.no_dedup,
        fresh=args.fresh, progress=args.progress, report=args.report, max_pending=args.max_pending,
        dry_run=args.dry_run, argv=["run", *_original_argv()], quiet=args.quiet,
    )


def _original_argv() -> list[str]:
    argv = sys.argv[1:]
    return argv[1:] if argv and argv[0] == "run" else argv


def main(args: argparse.Namespace) -> int:
    if getattr(args, "ray", None) is not None:
        from carpool.distributed.ray_runner import main as ray_main

        return ray_main(args)
    from carpool.jobs.runner import Runner, run_with_signals
    from carpool.jobs.summary import render_summary

    try:
        opts = options_from_args(args)
        runner = Runner(opts)
        stats = run_with_signals(runner)
    except (FileNotFoundError, ValueError) as e:
        print(f"carpool run: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the output cannot be written (disk full, a path under a file, ...)
        from carpool.jobs.runner import OutputError

        what = str(e) if isinstance(e, OutputError) else f"cannot write the output: {e}"
        print(f"carpool run: {what}", file=sys.stderr)
        return 1
    if not args.quiet:
        render_summary(stats)
    for msg in runner.messages:
        print(msg, file=sys.stderr)
    if args.summary_json:
        doc = json.dumps(stats.to_dict(), indent=None if args.summary_json == "-" else 2)
        if args.summary_json == "-":
            print(doc)
        else:
            with open(args.summary_json, "w") as f:
                f.write(doc + "\n")
    if not args.quiet:
        print(f"results: {opts.output}" + (f", errors: {opts.errors}" if opts.errors else "")
              + (f", report: {opts.report}" if opts.report else ""), file=sys.stderr)
    if stats.interrupted:
        return 130
    return 0
