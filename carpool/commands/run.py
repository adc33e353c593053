"""``carpool run``: run every task of a file, against the embedded engine or endpoints.

The flags (the Ray ones included), the translation of flags into ``RunOptions`` /
``RayOptions``, and everything the command prints: the summary table, the messages the
job collected, ``--summary-json``, and the per-shard lines of a ``--ray`` run.  The job
itself is ``carpool.jobs.runner``'s ``Runner``, which makes the start-up checks and runs
the tasks in one process, over Ray (``carpool.distributed.ray_runner.RayShards``) or
through a provider's batch API; either way it ends in ``JobStats``, rendered and turned
into an exit code the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from carpool.cache import DEFAULT_TTL_S
from carpool.cache.keys import SEMANTIC_THRESHOLD as SEMANTIC_DEFAULT
from carpool.client.pool import Timeouts
from carpool.commands import flags
from carpool.commands.batch_flags import add_batch_arguments, batch_options
from carpool.jobs.input.readers import FORMATS
from carpool.jobs.input.tasks import TaskDefaults, Template
from carpool.redact import redact_doc, redact_text

if TYPE_CHECKING:
    from rich.console import Console

    from carpool.distributed.ray_runner import RayOptions, RayShards
    from carpool.jobs.options import RunOptions
    from carpool.jobs.runner import Runner
    from carpool.jobs.summary.stats import JobStats


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of ``carpool run``, group by group as ``--help`` shows them."""
    p.add_argument("input", help="tasks file: .jsonl (plain or OpenAI Batch format), .csv, .parquet")
    p.add_argument("-o", "--output", help="results: .jsonl (OpenAI Batch output lines), .parquet or .csv "
                                          "(flat columns, written at the end from a journal <output>.jsonl); "
                                          "default <input>.results.jsonl; running again with the same "
                                          "output resumes")
    p.add_argument("--errors", help="write failed tasks here instead of into the output")
    _add_input_arguments(p.add_argument_group("input"))
    _add_target_arguments(p.add_argument_group("target"))
    _add_throughput_arguments(p.add_argument_group("throughput"))
    _add_reliability_arguments(p.add_argument_group("reliability"))
    _add_cache_arguments(p.add_argument_group("cache"))
    _add_reporting_arguments(p.add_argument_group("reporting"))
    _add_ray_arguments(p)
    add_batch_arguments(p)


def _add_input_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--format", choices=FORMATS, help="default: from the file extension")
    g.add_argument("--template", help="CSV/Parquet: build the prompt from columns, e.g. 'Classify: {review}'")
    g.add_argument("--system", help="with --template: a system message")
    g.add_argument("--id-column", help="with --template: the column holding custom_id")
    g.add_argument("--kind", choices=("chat", "completion", "embedding"), default="chat",
                   help="with --template: the task kind (default chat)")
    g.add_argument("--max-tokens", type=flags.positive_int,
                   help="for tasks that do not set max_tokens (sent as max_completion_tokens to OpenAI "
                        "reasoning models: o1, o3, gpt-5, ...)")
    g.add_argument("--max-completion-tokens", type=flags.positive_int, metavar="N",
                   help="for tasks that set no limit: max_completion_tokens N (what OpenAI's reasoning models take)")
    g.add_argument("--temperature", type=flags.non_negative_float, help="for tasks that do not set temperature")


def _add_target_arguments(g: argparse._ArgumentGroup) -> None:
    flags.add_target_flags(g, many=True)
    g.add_argument("--wait-for-endpoint", type=flags.duration_or_zero, default=0.0, metavar="DURATION",
                   help="at start, wait up to this long (e.g. 2m) for an endpoint that does not answer yet "
                        "(a server that is starting); default: refuse the start at once (exit 2)")
    g.add_argument("--endpoints", metavar="FILE",
                   help="endpoints.yaml (or .json): per endpoint base_url, model, api_key_env, headers, weight, "
                        "rpm/tpm, fallback, kind: azure (docs/run.md); instead of --endpoint/--model")
    g.add_argument("--header", action="append", default=[], metavar="'NAME: VALUE'",
                   help="an HTTP header sent to every endpoint (repeat for several)")
    g.add_argument("--api-version", help="Azure OpenAI endpoints: the api-version query parameter "
                                         "(default 2024-10-21); an *.openai.azure.com --endpoint is sent "
                                         "the api-key header and the deployment path, --model naming the deployment")
    g.add_argument("--max-num-seqs", type=flags.positive_int,
                   help="embedded engine: requests batched per step (default: measured for this machine, "
                        "`carpool engine plan` shows it)")
    g.add_argument("--max-num-batched-tokens", type=flags.positive_int,
                   help="embedded engine: tokens of a step at most (default: the engine plan's, measured for "
                        "throughput on this machine; `carpool engine plan` shows it)")
    g.add_argument("--quantization", choices=["int8"],
                   help="embedded engine: int8 linear weights, per-output-channel scales; "
                        "measured 1.24-1.29x bf16's decode tok/s on a 2-core Zen 4 (docs/engine.md)")
    g.add_argument("--kv-cache-dtype", choices=["auto", "int8"],
                   help="embedded engine: int8 keys and values (a scale per token and head); default: auto "
                        "(the model dtype)")
    g.add_argument("--no-stream", action="store_true", help="HTTP: do not stream (no TTFT/TPOT)")


def _add_throughput_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--concurrency", type=flags.positive_int,
                   help="fixed number of requests in flight (default: adaptive)")
    g.add_argument("--max-concurrency", type=flags.positive_int, help="cap for the adaptive limiter")
    g.add_argument("--rpm", type=flags.positive_float, help="requests per minute budget")
    g.add_argument("--tpm", type=flags.positive_float, help="tokens per minute budget")
    g.add_argument("--ordered", action="store_true", help="write results in input order")
    g.add_argument("--prefix-order", dest="prefix_order", action="store_true", default=None,
                   help="send tasks sharing a long prompt prefix together, over the whole JSONL file "
                        "(default: on when the file's prompts share long prefixes)")
    g.add_argument("--no-prefix-order", dest="prefix_order", action="store_false",
                   help="send tasks in the file's order")
    g.add_argument("--no-prefix-routing", dest="prefix_routing", action="store_false",
                   help="several endpoints: send by load alone (default: tasks sharing a prompt prefix go to "
                        "the endpoint that had it, while that one is not overloaded)")
    g.add_argument("--prefix-window", type=flags.positive_int, default=1024,
                   help="tasks sorted together where the whole file cannot be planned (--ordered, CSV, Parquet)")
    g.add_argument("--max-pending", type=flags.positive_int, default=2048, help="tasks held in memory at once")


def _add_reliability_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--max-attempts", type=flags.positive_int, default=6)
    g.add_argument("--idempotent", choices=("auto", "on", "off"), default="auto",
                   help="may a request that might have run be sent again? auto: yes for temperature 0 "
                        "and embeddings")
    g.add_argument("--connect-timeout", type=flags.duration, default=10.0, metavar="DURATION")
    g.add_argument("--read-timeout", type=flags.duration, default=60.0, metavar="DURATION",
                   help="seconds between two chunks (grows to twice the slowest first token of the endpoint "
                        "lately: a request queued in the server is not re-sent)")
    g.add_argument("--total-timeout", type=flags.duration, default=600.0, metavar="DURATION",
                   help="for one attempt (default 600 s)")
    g.add_argument("--outage-timeout", type=flags.duration, default=900.0, metavar="DURATION",
                   help="while every endpoint is down the job pauses (nothing fails); after this long "
                        "(seconds, or 30s / 15m / 2h / 1d; default 15m) it stops with exit code 4 and the same "
                        "command resumes the unfinished tasks")
    g.add_argument("--fresh", action="store_true", help="ignore (delete) an earlier output instead of resuming")
    g.add_argument("--force", action="store_true",
                   help="resume even when the output was started with another model or other defaults "
                        "(the run fingerprint beside it)")
    g.add_argument("--retry-errors", action="store_true",
                   help="on resume, run again the tasks whose line is an error line (one final line per id)")


def _add_cache_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--cache", default=None, help="sqlite:///path, redis://host:6379/0 or off "
                                                 "(default: the SQLite file in ~/.cache/carpool)")
    g.add_argument("--cache-ttl", type=_ttl, default=DEFAULT_TTL_S, metavar="DURATION",
                   help="how long a stored answer is served: seconds, or 30m / 12h / 7d; 0 or none: for ever "
                        "(default 7d)")
    g.add_argument("--cache-namespace", metavar="NAME",
                   help="a cache of its own: answers stored under NAME are served only to runs with NAME "
                        "(default: none, the shared cache); `carpool cache clear --namespace NAME` empties it")
    g.add_argument("--cache-sampled", action="store_true", help="also cache temperature > 0 results")
    g.add_argument("--semantic-cache", type=float, metavar="THRESHOLD", nargs="?", const=SEMANTIC_DEFAULT,
                   help="reuse results of near-identical label-like tasks: candidates with cosine >= THRESHOLD "
                        f"(default {SEMANTIC_DEFAULT}) that the verification stage finds asking the same thing")
    g.add_argument("--semantic-audit", type=flags.non_negative_int, default=0, metavar="N",
                   help="after the job, re-ask N random semantic hits for real and report how many disagreed")
    g.add_argument("--no-dedup", action="store_true", help="send identical tasks separately")


def _add_reporting_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--report", help="write an HTML report with plots")
    flags.add_json_flag(g, "the summary", "--summary-json", dest="summary_json")
    g.add_argument("--dry-run", action="store_true",
                   help="validate the input and say what a run would do; nothing is sent, -o is not touched")
    g.add_argument("--estimate", action="store_true",
                   help="count the input's tokens with the model's tokenizer and print tokens and $; "
                        "nothing is sent, -o is not touched")
    g.add_argument("--price-in", type=flags.non_negative_float, metavar="USD",
                   help="$ per million input tokens (default: the built-in table for OpenAI model names)")
    g.add_argument("--price-out", type=flags.non_negative_float, metavar="USD", help="$ per million output tokens")
    g.add_argument("--prices", metavar="FILE",
                   help="a JSON/YAML price table in LiteLLM's model_prices shape (input_cost_per_token, "
                        "output_cost_per_token per model), looked up before the built-in table")
    g.add_argument("--echo-backend", action="store_true",
                   help="answer every task with an empty reply, no model (carpool's own overhead); writes -o")
    g.add_argument("--quiet", action="store_true")


def _ttl(value: str) -> float | None:
    """``--cache-ttl``: a duration (``3600``, ``30m``, ``7d``); ``0``, ``none``, ``never``: None (for ever)."""
    if value.strip().lower() in ("none", "never", "off"):
        return None
    try:
        seconds = flags.duration_or_zero(value)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"--cache-ttl {value!r}: give seconds (3600) or 30m, 12h, 7d; 0 or none "
                                         "to keep entries for ever") from None
    return seconds or None


def _ray_address(value: str) -> str:
    if value.endswith((".jsonl", ".json", ".ndjson", ".csv", ".tsv", ".parquet", ".pq")):
        raise argparse.ArgumentTypeError(
            f"{value!r} looks like the input file, not a Ray address: put --ray after the input "
            "(carpool run tasks.jsonl --ray) or give the address (--ray auto)")
    return value


def _add_ray_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--ray`` flags (they import nothing heavy; Ray only when ``--ray`` runs)."""
    g = p.add_argument_group("distributed (Ray)")
    g.add_argument("--ray", nargs="?", const="local", default=None, type=_ray_address, metavar="ADDRESS",
                   help="run on Ray: no ADDRESS = this machine (or its running cluster), 'auto', "
                        "HOST:6379 or ray://HOST:10001; put it after the input file")
    g.add_argument("--ray-workers", type=int, help="worker actors (default: cluster CPUs / --ray-cpus)")
    g.add_argument("--ray-shards", type=int, help="pieces the input is cut into (default 4 per worker)")
    g.add_argument("--ray-cpus", type=float, default=1.0, help="CPUs per worker (default 1)")
    g.add_argument("--ray-gpus", type=float, default=0.0, help="GPUs per worker (embedded engine on GPU nodes)")
    g.add_argument("--ray-workdir", help="shard outputs and plan (default <output>.ray; shared by all nodes)")
    g.add_argument("--ray-keep-workdir", action="store_true", help="keep the shard files after the merge")
    g.add_argument("--redis", help="redis://HOST:6379/0 shared by all workers: one --rpm/--tpm budget for "
                                   "the whole job and shared endpoint cooldowns")
    g.add_argument("--budget-name", help="with --redis: jobs with the same name share one budget "
                                         "(default: derived from the endpoints and model)")
    g.add_argument("--rpm-window", type=float, default=60.0,
                   help="seconds the provider counts --rpm/--tpm over (default 60; 1 if it enforces per second)")


def _headers(values: list[str]) -> dict[str, str]:
    """``--header 'Name: value'`` flags as a mapping; raises ``StartRefused`` on a bad one."""
    from carpool.client.endpoints import header_problem
    from carpool.errors import StartRefused
    from carpool.redact import redact_header

    out: dict[str, str] = {}
    for v in values:
        name, sep, value = v.partition(":")
        if not sep or not name.strip() or any(c.isspace() for c in name.strip()):
            raise StartRefused(f"--header {redact_header(v)!r}: write it as 'Name: value', e.g. "
                               "--header 'OpenAI-Organization: org-1'")
        problem = header_problem(name.strip(), value.strip())
        if problem:
            raise StartRefused(f"--header {redact_header(v)!r}: {problem}")
        out[name.strip()] = value.strip()
    return out


def _endpoint_specs(args: argparse.Namespace) -> list:
    """The endpoints of ``--endpoints FILE`` (empty without it); refuses flags it replaces."""
    from carpool.errors import EndpointsFileError
    from carpool.jobs.endpoints_file import load_endpoints

    if not args.endpoints:
        return []
    for flag, given in (("--endpoint", args.endpoint), ("--model", args.model), ("--api-key", args.api_key),
                        ("--api-version", args.api_version)):
        if given:
            raise EndpointsFileError(f"{flag} and --endpoints: give one; with --endpoints each endpoint names its "
                                     "own base_url, model, api_key_env and api_version in the file")
    return load_endpoints(args.endpoints)


def options_from_args(args: argparse.Namespace) -> RunOptions:
    from carpool.jobs.options import RunOptions
    from carpool.jobs.start.checks import check_files

    template = None
    if args.template:
        template = Template(args.template, system=args.system, id_column=args.id_column, kind=args.kind)
    specs = _endpoint_specs(args)
    batch = batch_options(args, specs)
    endpoints = [s.url for s in specs] or list(args.endpoint or []) or ([batch.url] if batch else [])
    defaults = TaskDefaults(model=args.model if endpoints else None, max_tokens=args.max_tokens,
                            max_completion_tokens=args.max_completion_tokens,
                            temperature=args.temperature, idempotent=args.idempotent)
    engine_config = {}
    if args.max_num_seqs:
        engine_config["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens:
        engine_config["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.quantization:
        engine_config["quantization"] = args.quantization
    if args.kv_cache_dtype and args.kv_cache_dtype != "auto":
        engine_config["kv_cache_dtype"] = args.kv_cache_dtype
    output = args.output or (os.path.splitext(args.input)[0] + ".results.jsonl")
    opts = RunOptions(
        input=args.input, output=output, errors=args.errors, fmt=args.format, template=template,
        defaults=defaults, endpoints=endpoints, endpoint_specs=specs, headers=_headers(args.header),
        api_version=args.api_version,
        api_key=flags.api_key(args.api_key),
        engine_model=(args.model if not endpoints and args.model else "smollm2"), engine_config=engine_config,
        concurrency=args.concurrency, max_concurrency=args.max_concurrency, rpm=args.rpm, tpm=args.tpm,
        stream=not args.no_stream,
        timeouts=Timeouts(args.connect_timeout, args.read_timeout, args.total_timeout),
        max_attempts=args.max_attempts, outage_timeout=args.outage_timeout,
        wait_for_endpoint=args.wait_for_endpoint, ordered=args.ordered,
        prefix_order=args.prefix_order, prefix_routing=args.prefix_routing,
        prefix_window=args.prefix_window, cache=args.cache, cache_ttl=args.cache_ttl,
        cache_namespace=args.cache_namespace or None,
        cache_sampled=args.cache_sampled, semantic_cache=args.semantic_cache, semantic_audit=args.semantic_audit,
        dedup=not args.no_dedup, fresh=args.fresh, progress=args.progress, report=args.report,
        max_pending=args.max_pending, dry_run=args.dry_run, echo=args.echo_backend, force=args.force,
        retry_errors=args.retry_errors, argv=["run", *_original_argv()], quiet=args.quiet,
        price_in=args.price_in, price_out=args.price_out, prices=args.prices, batch_api=batch,
    )
    check_files(opts, more=[("--summary-json", args.summary_json, "summary.json")])
    return opts


def ray_options_from_args(args: argparse.Namespace) -> RayOptions:
    from carpool.distributed.ray_runner import RayOptions

    return RayOptions(address=args.ray, workers=args.ray_workers, shards=args.ray_shards,
                      cpus_per_worker=args.ray_cpus, gpus_per_worker=args.ray_gpus, workdir=args.ray_workdir,
                      redis=args.redis, budget_name=args.budget_name, rpm_window_s=args.rpm_window,
                      keep_workdir=args.ray_keep_workdir)


def _original_argv() -> list[str]:
    argv = sys.argv[1:]
    return argv[1:] if argv and argv[0] == "run" else argv


def _say(msg: str) -> None:
    """A message on stderr; every message of a job passes here or ``_tell``."""
    print(redact_text(msg), file=sys.stderr, flush=True)


def _tell(msg: str) -> None:
    print(redact_text(msg), file=sys.stderr)


def _say_all(msgs: list[str]) -> None:
    for msg in msgs:
        _say(f"carpool run: {msg}")


def write_summary_json(doc: dict, target: str) -> None:
    """``--summary-json PATH`` (indented) or ``-`` (one line on stdout)."""
    text = json.dumps(redact_doc(doc), indent=None if target == "-" else 2)
    if target == "-":
        print(text)
    else:
        with open(target, "w") as f:
            f.write(text + "\n")


def main(args: argparse.Namespace) -> int:
    """The job, and its exit code (``carpool.jobs.summary.exit_codes``: the table is in docs/run.md)."""
    from carpool.errors import MissingExtra
    from carpool.jobs.summary.exit_codes import ExitCode

    try:
        return int(_main(args))
    except KeyboardInterrupt:  # a --dry-run or --estimate stopped while it read or checked
        _tell("carpool run: interrupted; nothing was sent or written")
        return int(ExitCode.INTERRUPTED)
    except MissingExtra as e:  # e.g. the engine asked for on a slim install: a refused start
        _tell(f"carpool run: {e}")
        return int(ExitCode.REFUSED)
    except Exception:  # noqa: BLE001  (a bug: say so with the traceback, exit 1 as documented)
        import traceback

        _tell(traceback.format_exc().rstrip())  # redacted: an exception's text may hold a URL
        print("carpool run: crashed (a bug in carpool; please report it with the traceback above). "
              "The complete lines already in the output are kept: the same command resumes.", file=sys.stderr)
        return int(ExitCode.CRASHED)


def _main(args: argparse.Namespace) -> int:
    if args.estimate:  # before --ray: an estimate sends nothing, on Ray or not
        return _main_estimate(args)
    if args.dry_run and args.ray is None:
        return _main_dry_run(args)
    from carpool.errors import CarpoolError
    from carpool.jobs.runner import Runner
    from carpool.jobs.summary.exit_codes import ExitCode

    command = "carpool run" if args.ray is None else "carpool run --ray"
    try:
        opts = options_from_args(args)
        runner = Runner(opts, _ray_shards(args), notify=_say)
        stats = run_with_signals(runner)
    except (CarpoolError, OSError) as e:
        return _ended_early(e, command)
    except KeyboardInterrupt:
        # Only a --ray run gets here (its driver waits on the cluster, where a stop can only
        # come as KeyboardInterrupt): finished shards and the partial shard outputs (their
        # journals) stay in the workdir.
        print(f"\n{command}: interrupted; finished work is kept. Resume with the same command.", file=sys.stderr)
        return ExitCode.INTERRUPTED
    if not runner.started:  # stopped during the start: nothing ran, there is nothing to sum up
        for msg in runner.messages:
            _tell(f"carpool run: {msg}")
        return ExitCode.INTERRUPTED
    return _finish(args, opts, runner, stats)


def _ray_shards(args: argparse.Namespace) -> RayShards | None:
    """With ``--ray``, the job's tasks spread over a cluster (``carpool.distributed.ray_runner``);
    without it, None: the ``Runner``'s own choice (this process, or the batch API asked for)."""
    if args.ray is None:
        return None
    from carpool.distributed.ray_runner import RayShards

    def shard_done(s: dict) -> None:
        for msg in s.get("messages", []):
            if msg.startswith(f"shard {s['shard']}:"):
                _say(f"carpool run --ray: {msg}")
        if not args.quiet and not s.get("stopped_by_outage"):
            st = s["stats"]
            _say(f"carpool run --ray: shard {s['shard']} done on {s['host']}:{s['pid']} "
                 f"({st['done']} written, {st['skipped_done_before']} resumed)")

    return RayShards(ray_options_from_args(args), on_shard=shard_done)


def _finish(args: argparse.Namespace, opts: RunOptions, runner: Runner, stats: JobStats) -> int:
    """Everything said after a job that ran, and its exit code (``carpool.jobs.summary.exit_codes``)."""
    from carpool.jobs.summary.exit_codes import ExitCode, exit_code

    if not args.quiet:
        render_summary(stats)
    for msg in runner.messages:
        _tell(msg)
    if args.summary_json:
        write_summary_json(stats.to_dict(), args.summary_json)
    if not args.quiet and (stats.shards is None or stats.shards.complete):
        print(f"results: {opts.output}" + (f", errors: {opts.errors}" if opts.errors else "")
              + (f", report: {opts.report}" if opts.report else ""), file=sys.stderr)
    code = exit_code(stats)
    if code == ExitCode.TASKS_FAILED and not args.quiet:
        failed = stats.n_errors + stats.failed_before
        print(f"carpool run: {failed:,} tasks failed (exit 3); their error lines say why. "
              "Rerun with --retry-errors to run only those again.", file=sys.stderr)
    return code


def _ended_early(error: Exception, command: str = "carpool run") -> int:
    """Say why the job ended before it could run or finish, and return its exit code, read
    from the error tree (``carpool.jobs.summary.exit_codes.code_for_error``); what the tree calls a
    crash (an engine failure, an unexpected error) is raised on to ``main``, which says so
    with the traceback."""
    from carpool.errors import OutputError
    from carpool.jobs.summary.exit_codes import ExitCode, code_for_error

    code = code_for_error(error)
    if code == ExitCode.CRASHED:
        raise error
    if code == ExitCode.OUTPUT_FAILED:  # disk full, a path under a file, ...
        what = str(error) if isinstance(error, OutputError) else f"cannot write the output: {error}"
    else:  # a refusal's message (the model loader's too) says what is wrong and what to do
        what = str(error)
    _tell(f"{command}: {what}")
    return code


def _look_ahead(args: argparse.Namespace, produce: Callable[[RunOptions], Coroutine[Any, Any, dict]]) -> dict | None:
    """``--dry-run`` and ``--estimate``: the document ``produce`` makes of the options, its messages
    printed and ``--summary-json`` written; None (after saying why) when the start is refused."""
    from carpool.errors import CarpoolError
    from carpool.jobs.options import LiveParts
    from carpool.jobs.runner import default_spread
    from carpool.jobs.start.checks import check_start

    async def look(opts: RunOptions) -> dict:
        # The same start-up check as a run's; an estimate sends nothing, not even a probe.
        checked = await check_start(opts, LiveParts(), default_spread(opts), probe=not args.estimate, say=_say)
        _say_all(checked)
        return await produce(opts)

    try:
        doc = asyncio.run(look(options_from_args(args)))
    except (CarpoolError, FileNotFoundError) as e:
        _ended_early(e)
        return None
    for msg in doc.get("messages", []):
        _tell(msg)
    if args.summary_json:
        write_summary_json(doc, args.summary_json)
    return doc


def _main_dry_run(args: argparse.Namespace) -> int:
    """``--dry-run``: validate, count and check; nothing sent, nothing written."""
    from carpool.jobs.dry_run import plan
    from carpool.jobs.summary.exit_codes import ExitCode

    doc = _look_ahead(args, plan)
    if doc is None:
        return ExitCode.REFUSED
    if not args.quiet:
        kinds = ", ".join(f"{n:,} {k}" for k, n in sorted(doc["kinds"].items())) or "none"
        print(f"carpool run --dry-run: {doc['tasks_to_send']:,} tasks would be sent ({kinds}); "
              f"{doc['bad_lines']:,} bad lines; {doc['already_done']:,} already done in {doc['output']}"
              + (f" ({doc['failed_before']:,} of them error lines)" if doc["failed_before"] else "")
              + (f"; model {doc['model']!r}" if doc["model"] else ""), file=sys.stderr)
        for line in doc["first_bad_lines"]:
            print(f"  {line}", file=sys.stderr)
        print("nothing was sent and the output was not touched", file=sys.stderr)
    return ExitCode.OK


def usd(value: float | None) -> str:
    """$ with the cents that matter: small jobs cost fractions of a cent."""
    if value is None:
        return "unknown"
    return f"${value:,.2f}" if value >= 1 else f"${value:.4f}" if value >= 0.0001 else f"${value:.6f}"


def _main_estimate(args: argparse.Namespace) -> int:
    """``--estimate``: tokens and $ of what a run would send; nothing sent, nothing written."""
    from carpool.jobs.cost.estimate import estimate
    from carpool.jobs.summary.exit_codes import ExitCode

    doc = _look_ahead(args, estimate)
    if doc is None:
        return ExitCode.REFUSED
    if not args.quiet:
        prompt = "not counted" if doc["prompt_tokens"] is None else f"{doc['prompt_tokens']:,}"
        p = doc["prices"]
        priced = (f"at ${p['input_per_million']:g} / ${p['output_per_million']:g} per million in / out "
                  f"({p['source']})") if p else "(no prices: pass --price-in and --price-out, or --prices FILE)"
        print(f"carpool run --estimate: {doc['tasks']:,} tasks for {doc['model']!r}"
              + (f" ({doc['already_done']:,} already done)" if doc["already_done"] else "")
              + (f", {doc['bad_lines']:,} bad lines" if doc["bad_lines"] else "")
              + f"; tokenizer {doc['tokenizer'] or 'none'}", file=sys.stderr)
        print(f"  input tokens   {prompt:>14}   {usd(doc['input_usd'])}", file=sys.stderr)
        print(f"  output tokens  {doc['output_tokens_max']:>14,}   {usd(doc['output_usd_max'])}   at most "
              "(max_tokens)", file=sys.stderr)
        print(f"  total                          {usd(doc['total_usd_max'])}   at most, {priced}", file=sys.stderr)
        print("nothing was sent and the output was not touched", file=sys.stderr)
    return ExitCode.OK


def run_with_signals(runner: Runner) -> JobStats:
    """Run the job on a fresh event loop; Ctrl-C (SIGINT) and SIGTERM stop it gracefully."""

    async def main() -> JobStats:
        loop = asyncio.get_running_loop()
        for sig, stop in ((signal.SIGINT, runner.request_stop), (signal.SIGTERM, runner.terminate)):
            with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
                loop.add_signal_handler(sig, stop)
        return await runner.run()

    return asyncio.run(main())


def render_summary(stats: JobStats, console: Console | None = None) -> None:
    """The summary table (rich) on stderr."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(stderr=True)
    d = stats.to_dict()

    def f(v: float | None, unit: str = "") -> str:
        return "-" if v is None else f"{v:,}{unit}" if isinstance(v, int) else f"{v:,.2f}{unit}"

    title = " (stopped: outage)" if stats.stopped_by_outage else " (interrupted)" if stats.interrupted else ""
    t = Table(title="carpool run" + title, show_header=False)
    t.add_column("metric", style="bold")
    t.add_column("value", justify="right")
    t.add_row("backend", d["backend"])
    if stats.shards is not None:
        sh = stats.shards
        t.add_row("shards", f"{sh.shards_done:,} / {sh.shards:,} done on {sh.workers} workers"
                            + ("" if sh.complete else f", the rest kept in {sh.workdir}"))
    total = "?" if d["total"] is None else f"{d['total']:,}"
    t.add_row("tasks written / total", f"{d['done']:,} / {total}")
    if d["skipped_done_before"]:
        t.add_row("already done (resumed)", f(d["skipped_done_before"]))
    cached = d["succeeded"] - d["ok"]
    t.add_row("succeeded", f(d["succeeded"]) + (f" ({cached:,} from the cache)" if cached else ""))
    t.add_row("errors", f(stats.n_errors))
    for kind, n in sorted(stats.errors.items(), key=lambda kv: -kv[1]):
        t.add_row(f"  {kind}", f(n))
    start = d.get("engine_start_s")
    t.add_row("elapsed", f(d["elapsed_s"], " s") + (f" (engine start {start:.1f} s)" if start else ""))
    t.add_row("throughput", f"{f(d['requests_per_s'])} req/s, {f(d['tokens_per_s'])} tok/s "
                            f"({f(d['output_tokens_per_s'])} out tok/s)")
    t.add_row("tokens in / out", f"{d['prompt_tokens']:,} / {d['completion_tokens']:,}")
    for name, text in (("answers cut at max_tokens", stats.answers.cut_text()),
                       ("structured answers failing their schema", stats.answers.parse_error_text())):
        if text:  # said only when it happened: each means answers that may be of no use
            t.add_row(f"[yellow]{name}", f"[yellow]{text}")
    t.add_row(*stats.prompt_reuse.summary_row(d["backend"]))
    po = stats.prefix_order
    if po is not None and po["mode"] == "planned":
        t.add_row("prefix order", f"{po['grouped_tasks']:,} tasks in {po['groups']:,} shared-prefix groups sent "
                                  f"together ({po['moved']:,} moved; --no-prefix-order: file order)")
    t.add_row("TTFT P50 / P99", f"{f(d['ttft_ms_p50'])} / {f(d['ttft_ms_p99'])} ms")
    t.add_row("TPOT P50 / P99", f"{f(d['tpot_ms_p50'])} / {f(d['tpot_ms_p99'])} ms")
    if stats.concurrency is not None:
        c = stats.concurrency
        t.add_row("concurrency", f"{c['mode']} {c['limit']:g}: {c['why']}")
    if stats.engine_max_num_seqs is not None:
        t.add_row("engine's max_num_seqs", f"{stats.engine_max_num_seqs:,} sequences a step at most")
    t.add_row("retries", ", ".join(f"{k} {v}" for k, v in stats.retries.items()) or "0")
    if stats.stopped_by_outage:
        t.add_row("stopped", stats.outage_stop.removeprefix("paused: ") + ", past --outage-timeout")
    elif stats.outages and stats.outages["outages"]:
        o = stats.outages
        periods = ", ".join(f"{p['start']} for {p['seconds']:.0f} s" for p in o["periods"][-3:])
        t.add_row("paused (endpoint down)", f"{o['outages']} time(s), {o['paused_s']:.0f} s in all: {periods}")
    t.add_row("cache", d["cache"])
    t.add_row("cache hits / semantic / dedup", f"{d['cache_hits']:,} / {d['semantic_hits']:,} / {d['dedup_fanouts']:,}")
    if d["saved_tokens"]:
        t.add_row("saved", f"{d['saved_tokens']:,} tokens, ~{d['saved_time_s']:.1f} s")
    cost = d["cost"]
    t.add_row("$ spent / saved by cache and dedup", f"{usd(cost['spent_usd'])} / {usd(cost['saved_usd'])}"
              + ("" if cost["prices"] else " (no prices: --price-in/--price-out or --prices FILE)"))
    if stats.semantic_audit is not None:
        a = stats.semantic_audit
        t.add_row("semantic audit", f"{a['asked']:,} re-asked, {a['disagreed']:,} disagreed, {a['failed']:,} failed")
    console.print(t)
