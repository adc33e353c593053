"""``carpool run --ray [ADDRESS]``: one job spread over a Ray cluster.

The driver (this module, on the machine where the command runs):
1. cuts the input into shards of whole lines without loading it (``shards.py``) and saves
   the plan in the work directory (default ``<output>.ray/``);
2. hands the shards that are not finished yet to a Ray Data actor pool
   (``map_batches(ShardWorker, ...)``); each actor runs carpool's own async pipeline on
   one shard at a time against the endpoints, or against an engine of its own;
3. once every shard is done, merges the shard outputs, in shard order, into the one
   output file the user asked for.  Each shard output is in input order with
   ``--ordered``, so the merged file is too.

Resume: each shard output is that shard's journal (keyed by custom_id, as in a
single-process run), and a finished shard leaves a ``.done.json`` marker; running the
same command again runs only what is missing, whatever the number of workers.  A shard
stopped by an outage (``--outage-timeout``) is not finished; the result says
``stopped_by_outage`` (``carpool run --ray`` exits 4, as a single-process run does).
Shared state: with ``--redis URL`` every worker takes its requests from one RPM/TPM
budget and sees the others' endpoint cooldowns; ``--cache redis://...`` shares the exact
cache.  On a multi-node cluster the input and the work directory must be on a file
system every node sees (NFS, a mounted bucket); see docs/distributed.md.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from carpool.distributed.shards import PlanMismatch, Shard, load_or_make_plan, merge_files
from carpool.errors import StartRefused
from carpool.extras import require
from carpool.redact import redact_url

if TYPE_CHECKING:
    from carpool.jobs.options import RunOptions


@dataclass
class RayOptions:
    address: str | None = None  # None: a running local cluster if any, else a new one; "auto"; "ray://h:10001"
    workers: int | None = None  # actors; default: the cluster's CPUs / cpus_per_worker
    shards: int | None = None  # default: 4 per worker (small shards balance and resume finer)
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0  # > 0 with the embedded engine on GPU nodes
    workdir: str | None = None  # default: <output>.ray (must be shared by all nodes)
    redis: str | None = None  # shared RPM/TPM budget and endpoint cooldowns
    budget_name: str | None = None  # default: derived from the endpoints and model
    rpm_window_s: float = 60.0  # the window the provider counts its per-minute limits in
    rpm_burst_s: float = 1.0  # burst allowed, in seconds of traffic (capped at half the window)
    keep_workdir: bool = False  # keep the shard files after a successful merge
    init_kwargs: dict = field(default_factory=dict)  # extra ray.init arguments (tests: num_cpus)


class RayRunError(StartRefused):
    """A ``--ray`` run asked for something it cannot do (exit 2)."""


def _plan(input_path: Path, fmt: str, workdir: Path, n_shards: int) -> list[Shard]:
    if fmt == "parquet":
        return _parquet_plan(input_path, workdir, n_shards)
    if fmt == "csv":
        n_shards = 1  # a quoted field may hold newlines: byte ranges are not safe, one shard
    return load_or_make_plan(input_path, workdir, n_shards)


def _parquet_plan(path: Path, workdir: Path, n_shards: int) -> list[Shard]:
    """Parquet shards are ranges of row groups (start/end = row-group indices)."""
    import pyarrow.parquet as pq

    plan_file = workdir / "plan.json"
    st = path.stat()
    fp = {"input": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if plan_file.exists():
        saved = json.loads(plan_file.read_text())
        if {k: saved.get(k) for k in fp} == fp:
            return [Shard(**s) for s in saved["shards"]]
        if any(workdir.glob("shard-*")):
            raise PlanMismatch(f"{workdir} holds a partial run of another version of the input; "
                               "remove it to start over")
    meta = pq.ParquetFile(path).metadata
    rows = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    total = sum(rows)
    shards: list[Shard] = []
    start, acc, first = 0, 0, 1
    for i, n in enumerate(rows):
        acc += n
        if acc >= total * (len(shards) + 1) / n_shards or i == len(rows) - 1:
            lines = sum(rows[start:i + 1])
            shards.append(Shard(len(shards), start, i + 1, first, lines))
            first += lines
            start = i + 1
    workdir.mkdir(parents=True, exist_ok=True)
    plan_file.write_text(json.dumps({**fp, "shards": [dataclasses.asdict(s) for s in shards]}))
    return shards


def _combine(summaries: list[dict]) -> dict:
    """One job summary from the shards' (counts add up; latency percentiles are per shard)."""
    add = ("done", "ok", "succeeded", "skipped_done_before", "bad_lines", "prompt_tokens", "completion_tokens",
           "cached_prompt_tokens", "sent", "cache_hits", "semantic_hits", "dedup_fanouts", "saved_tokens",
           "saved_prompt_tokens", "saved_completion_tokens")
    out: dict = dict.fromkeys(add, 0)
    errors: Counter = Counter()
    retries: Counter = Counter()
    p99 = {k: [] for k in ("ttft_ms_p99", "tpot_ms_p99", "e2e_ms_p99")}
    for s in summaries:
        st = s["stats"]
        for k in add:
            out[k] += st.get(k) or 0
        errors.update(st.get("errors") or {})
        retries.update(st.get("retries") or {})
        for k, vals in p99.items():
            if st.get(k) is not None:
                vals.append(st[k])
    out["errors"] = dict(errors)
    out["retries"] = dict(retries)
    # The worst shard's P99 is a bound on the job's, not the job's own figure: named so.
    for k, vals in p99.items():
        out[k.replace("_p99", "_p99_worst_shard")] = max(vals) if vals else None
    return out


def run_on_ray(opts: RunOptions, ray_opts: RayOptions | None = None,
               on_shard: Callable[[dict], None] | None = None) -> dict:
    """Run the job described by ``opts`` on Ray.

    Returns the combined summary (``complete`` says whether every shard finished and the
    output was merged).  ``on_shard`` is called with each shard's summary as it finishes
    (``carpool run --ray`` prints a line).  Starts a local Ray if none is running, and
    stops it again.
    """
    require("ray", "carpool run --ray")
    import ray

    from carpool.distributed.worker import (
        ShardReader,
        SharedState,
        default_budget_name,
        fix_cross_shard_duplicates,
        shard_paths,
    )
    from carpool.jobs.output_format import output_target, write_table
    from carpool.jobs.prices import cost_doc
    from carpool.jobs.readers import detect_format
    from carpool.jobs.runner import job_prices
    from carpool.jobs.target import resolve_target_sync

    ray_opts = ray_opts or RayOptions()
    if opts.retry_errors:
        raise RayRunError("--retry-errors runs in one process: resume without --ray")
    prices = job_prices(opts)  # a bad --price-in refuses the start, as without --ray
    started = time.monotonic()
    # The model is settled once here (GET /models), not by every worker.
    opts, resolve_notes = resolve_target_sync(opts)
    input_path = Path(opts.input).resolve()
    if not input_path.exists():
        raise FileNotFoundError(f"input file {str(opts.input)!r} does not exist")
    target = output_target(opts.output)
    output = target.journal.resolve()  # the JSONL lines; a Parquet -o is written from it at the end
    errors = Path(opts.errors).resolve() if opts.errors else None
    workdir = Path(ray_opts.workdir or f"{output}.ray").resolve()
    fmt = opts.fmt or detect_format(input_path)
    if opts.engine is not None:
        raise RayRunError("an in-process engine object cannot be shipped to Ray workers; "
                          "leave engine=None (each worker starts its own) or pass endpoints")
    if opts.fresh:
        shutil.rmtree(workdir, ignore_errors=True)
        for p in (output, errors):
            if p is not None and p.exists():
                p.unlink()
    if not workdir.exists() and output.exists() and output.stat().st_size > 0:
        done = _finished_before(output, input_path)
        if done is not None:
            return done
        raise RayRunError(
            f"{output} already holds results of a run that did not finish here (no {workdir}); "
            "resume it without --ray, or pass --fresh to start over on Ray")
    own_ray = not ray.is_initialized()
    if own_ray:
        address = None if ray_opts.address in (None, "", "local") else ray_opts.address
        kwargs = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
        kwargs.update(ray_opts.init_kwargs)
        ray.init(address=address, **kwargs)
    try:
        cpus = float(ray.cluster_resources().get("CPU", 1.0))
        fit = int(cpus // max(ray_opts.cpus_per_worker, 0.01))
        if ray_opts.gpus_per_worker:
            fit = min(fit, int(ray.cluster_resources().get("GPU", 0.0) // ray_opts.gpus_per_worker))
        if fit < 1:
            raise RayRunError(f"the Ray cluster has no room for one worker of {ray_opts.cpus_per_worker:g} CPU "
                              f"and {ray_opts.gpus_per_worker:g} GPU ({ray.cluster_resources()})")
        workers = min(ray_opts.workers or fit, fit)
        notes = list(resolve_notes)
        if ray_opts.workers and ray_opts.workers > fit:
            notes.append(f"--ray-workers {ray_opts.workers}: the cluster has room for {fit} workers of "
                         f"{ray_opts.cpus_per_worker:g} CPU / {ray_opts.gpus_per_worker:g} GPU; running {fit}")
        shards = _plan(input_path, fmt, workdir, ray_opts.shards or 4 * workers)
        pending = [s for s in shards if not shard_paths(workdir, s, errors is not None)[2].exists()]
        job_opts = dataclasses.replace(opts, input=str(input_path), output=str(output),
                                       errors=str(errors) if errors else None, progress=False, quiet=True)
        if (opts.rpm or opts.tpm) and not ray_opts.redis:
            # Without a shared bucket each worker would spend the whole budget: split it.
            n = min(workers, len(pending)) or 1
            job_opts = dataclasses.replace(job_opts, rpm=opts.rpm / n if opts.rpm else None,
                                           tpm=opts.tpm / n if opts.tpm else None)
            notes.append(f"without --redis the --rpm/--tpm budget is split evenly over {n} workers; "
                         "--redis URL shares one budget (faster when shards differ)")
        shared = SharedState(redis=ray_opts.redis, budget_name=ray_opts.budget_name or default_budget_name(opts),
                             window_s=ray_opts.rpm_window_s, burst_s=ray_opts.rpm_burst_s) if ray_opts.redis else None
        run_error = None
        seen: list[dict] = []  # the summaries of this run's shards, finished or not
        if pending:
            try:
                seen = _run_pending(ray, pending, {"opts": job_opts, "shared": shared, "workdir": str(workdir)},
                             min(workers, len(pending)), ray_opts, on_shard)
            except Exception as e:  # noqa: BLE001  (a worker crashed: finished shards are kept)
                run_error = e
        summaries, missing = [], []
        for s in shards:
            marker = shard_paths(workdir, s, errors is not None)[2]
            if marker.exists():
                summaries.append(json.loads(marker.read_text()))
            else:
                missing.append(s.index)
        result = _combine(summaries)
        result["cost"] = cost_doc(prices, result["prompt_tokens"], result["completion_tokens"],
                                  result["saved_prompt_tokens"], result["saved_completion_tokens"])
        result.update(shards=len(shards), shards_done=len(summaries), workers=workers, workdir=str(workdir),
                      complete=not missing, elapsed_s=round(time.monotonic() - started, 3),
                      backend=f"ray x{workers}: " + (f"http {redact_url(', '.join(opts.endpoints))}" if opts.endpoints
                                                     else "echo" if opts.echo else f"engine {opts.engine_model}"))
        result["messages"] = notes + [m for s in summaries for m in s.get("messages", [])]
        if opts.report:
            result["messages"].append("--report is not written for --ray runs (use --summary-json)")
        result["shard_summaries"] = [{k: s.get(k) for k in ("shard", "host", "pid", "started", "finished")}
                                     for s in summaries]
        outage = next((s["outage_stop"] for s in seen if s.get("stopped_by_outage")), None)
        result["stopped_by_outage"] = bool(missing) and outage is not None
        if result["stopped_by_outage"]:
            result["messages"].append(
                f"stopped by an outage ({outage}, past --outage-timeout {opts.outage_timeout:g} s): "
                f"{len(missing)} of {len(shards)} shards did not finish; finished work is kept in {workdir}. "
                "Run the same command again once the endpoint is back to resume.")
            return result
        if missing:
            first = str(run_error).strip().splitlines()[0][:300] if run_error and str(run_error).strip() else ""
            why = f" ({type(run_error).__name__}: {first})" if run_error else ""
            result["messages"].append(
                f"{len(missing)} of {len(shards)} shards did not finish{why}; finished work is kept in "
                f"{workdir}. Run the same command again to resume.")
            return result
        parts = [shard_paths(workdir, s, errors is not None) for s in shards]
        reader_opts = (str(input_path), opts.fmt, opts.template, opts.defaults)
        dups = fix_cross_shard_duplicates(shards, parts, lambda sh: ShardReader(reader_opts[0], sh, *reader_opts[1:]))
        if dups:
            result["messages"].append(f"{dups} tasks reused a custom_id of an earlier line: "
                                      "refused as input errors (custom_ids must be unique in a file)")
        merge_files([p[0] for p in parts], output)
        if errors is not None:
            merge_files([p[1] for p in parts], errors)
        _write_state(output, input_path, opts)
        if target.is_table:
            rows = write_table(target)
            result["messages"].append(f"wrote {target.path} ({rows:,} rows) from its journal {output}")
        if not ray_opts.keep_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        return result
    finally:
        if own_ray:
            ray.shutdown()


def _run_pending(ray: Any, pending: list[Shard], job: dict, workers: int, ray_opts: RayOptions,
                 on_shard: Callable[[dict], None] | None) -> list[dict]:
    """Run the shards on an actor pool; the summary of each, as each worker returned it."""
    from carpool.distributed.worker import ShardWorker

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    # Start every actor before handing out shards: otherwise the first actor up takes the
    # first shards while the others are still importing, and the pool runs lopsided.
    ctx.wait_for_min_actors_s = 600
    items = [dataclasses.asdict(s) for s in pending]
    ds = ray.data.from_items(items, override_num_blocks=len(items))
    out = ds.map_batches(
        ShardWorker,
        fn_constructor_kwargs={"job": job},
        batch_size=1,
        # One shard per actor at a time: a queue per actor would let a fast-starting actor
        # take every shard while the others are still starting.
        compute=ray.data.ActorPoolStrategy(size=workers, max_tasks_in_flight_per_actor=1),
        num_cpus=ray_opts.cpus_per_worker,
        num_gpus=ray_opts.gpus_per_worker or None,
    )
    seen = []
    for row in out.iter_rows():
        summary = json.loads(row["summary"])
        seen.append(summary)
        if on_shard is not None:
            on_shard(summary)
    return seen


def _finished_before(output: Path, input_path: Path) -> dict | None:
    """The summary of an earlier run into ``output`` that finished on this very input, else None."""
    try:
        state = json.loads(Path(f"{output}.carpool.json").read_text())
    except (OSError, ValueError):
        return None
    if not state.get("finished") or state.get("input") != str(input_path) \
            or state.get("input_size") != input_path.stat().st_size:
        return None
    with open(output, "rb") as f:
        lines = sum(1 for _ in f)
    return {"complete": True, "already_done": True, "done": 0, "ok": 0, "succeeded": 0, "errors": {},
            "skipped_done_before": lines,
            "shards": 0, "shards_done": 0, "workers": 0, "elapsed_s": 0.0, "shard_summaries": [],
            "messages": [f"{output} is already complete ({lines:,} lines); nothing to do (--fresh reruns it)"]}


def _write_state(output: Path, input_path: Path, opts) -> None:
    # The runner's state file beside the output, so a later single-process ``carpool run``
    # into the same output resumes from it like from its own.
    from carpool.jobs.fingerprint import make_fingerprint
    from carpool.jobs.journal import Journal

    Journal(output, opts.errors, fingerprint=make_fingerprint(opts)).write_state(str(input_path), finished=True,
                                                                                argv=opts.argv)


def run_batch_on_ray(input: str, output: str, *, address: str | None = None, workers: int | None = None,
                     redis: str | None = None, ray_options: RayOptions | None = None, **options) -> dict:
    """Python API: ``run_batch`` spread over Ray; ``options`` are those of ``carpool.run_batch``
    (RunOptions fields, plus the ``model``/``max_tokens``/``temperature`` shortcuts)."""
    from carpool.jobs.api import make_options

    ray_options = ray_options or RayOptions(address=address, workers=workers, redis=redis)
    return run_on_ray(make_options(input, output, **options), ray_options)
