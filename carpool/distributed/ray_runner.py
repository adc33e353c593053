"""``carpool run --ray [ADDRESS]``: one job spread over a Ray cluster.

The driver (this module, on the machine where the command runs) is the ``Spread`` of a
job's ``carpool.jobs.runner.Runner`` (``RayShards``): the Runner settles the start as for
any job (the start-up checks, with this spread's own refusals, the prices, the model, the
output's lock) and writes a Parquet or CSV ``-o`` at the end; in between, the driver:
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
stopped by an outage (``--outage-timeout``) is not finished; the job's ``JobStats`` say
``stopped_by_outage`` (``carpool run --ray`` exits 4, as a single-process run does).
Shared state: with ``--redis URL`` every worker takes its requests from one RPM/TPM
budget and sees the others' endpoint cooldowns; ``--cache redis://...`` shares the exact
cache.  On a multi-node cluster the input and the work directory must be on a file
system every node sees (NFS, a mounted bucket); see docs/distributed.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from carpool.distributed.shards import Shard, load_or_make_plan, merge_files
from carpool.errors import PlanMismatch, RayRunError
from carpool.extras import require
from carpool.jobs.summary.stats import JobStats, ShardsRun
from carpool.redact import redact_url

if TYPE_CHECKING:
    from carpool.client.endpoints import EndpointSpec
    from carpool.jobs.options import LiveParts, RunOptions
    from carpool.jobs.spread import StartedJob


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


def _combine(summaries: list[dict]) -> JobStats:
    """One job's statistics from its shards' (counts add up; latency percentiles are per shard)."""
    stats = JobStats()
    add = {"done": "done", "ok": "ok", "skipped_done_before": "skipped", "failed_before": "failed_before",
           "bad_lines": "bad_lines", "prompt_tokens": "prompt_tokens", "completion_tokens": "completion_tokens",
           "cached_prompt_tokens": "cached_prompt_tokens", "sent": "sent", "cache_hits": "cache_hits",
           "semantic_hits": "semantic_hits", "dedup_fanouts": "dedup_fanouts", "saved_tokens": "saved_tokens",
           "saved_prompt_tokens": "saved_prompt_tokens", "saved_completion_tokens": "saved_completion_tokens"}
    worst: dict[str, float] = {}
    for s in summaries:
        st = s["stats"]
        for key, name in add.items():
            setattr(stats, name, getattr(stats, name) + (st.get(key) or 0))
        stats.errors.update(st.get("errors") or {})
        stats.retries.update(st.get("retries") or {})
        for k in ("ttft", "tpot", "e2e"):
            v = st.get(f"{k}_ms_p99")
            if v is not None:
                worst[f"{k}_ms"] = max(worst.get(f"{k}_ms", v), v)
    stats.shards = ShardsRun(worst_p99_ms={f"{k}_ms": worst.get(f"{k}_ms") for k in ("ttft", "tpot", "e2e")},
                             summaries=[{k: s.get(k) for k in ("shard", "host", "pid", "started", "finished")}
                                        for s in summaries])
    return stats


@dataclass
class _Files:
    """Where a ``--ray`` job reads and writes, resolved once by the driver (workers on other
    nodes see the same absolute paths on a shared file system)."""

    input: Path
    output: Path  # the JSONL journal; a Parquet/CSV -o is written from it by the Runner
    errors: Path | None
    workdir: Path
    fmt: str

    @classmethod
    def of(cls, opts: RunOptions, ray_opts: RayOptions) -> _Files:
        from carpool.jobs.input.readers import detect_format
        from carpool.jobs.output.table import output_target

        input_path = Path(opts.input).resolve()
        if not input_path.exists():
            raise FileNotFoundError(f"input file {str(opts.input)!r} does not exist")
        output = output_target(opts.output).journal.resolve()
        return cls(input_path, output, Path(opts.errors).resolve() if opts.errors else None,
                   Path(ray_opts.workdir or f"{output}.ray").resolve(), opts.fmt or detect_format(input_path))

    def shard(self, shard: Shard) -> tuple[Path, Path | None, Path]:
        from carpool.distributed.worker import shard_paths

        return shard_paths(self.workdir, shard, self.errors is not None)

    def start_over(self) -> None:
        """``--fresh``: the shards and the output of an earlier run go."""
        shutil.rmtree(self.workdir, ignore_errors=True)
        for p in (self.output, self.errors):
            if p is not None and p.exists():
                p.unlink()


def _backend_label(opts: RunOptions, workers: int) -> str:
    return f"ray x{workers}: " + (f"http {redact_url(', '.join(opts.endpoints))}" if opts.endpoints
                                  else "echo" if opts.echo else f"engine {opts.engine_model}")


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """For as long as the block runs, Ctrl-C and SIGTERM raise ``KeyboardInterrupt`` in this
    thread.  The driver waits on the cluster in the thread of the job's event loop, so a
    handler the loop would run (``carpool run``'s graceful stop, asyncio's own) could not run
    until the whole job ended; raised there, they end the wait at once, Ray is shut down and
    the finished shards are kept for a resume."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in before:
        signal.signal(sig, interrupt)
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


class RayShards:
    """The tasks of a job run as shards on a Ray cluster: the ``Spread`` of ``carpool run
    --ray`` (``carpool.jobs.runner.Runner`` runs it).

    ``on_shard`` is called with each shard's summary as it finishes (``carpool run
    --ray`` prints a line).  Starts a local Ray if none is running, and stops it again.
    """

    def __init__(self, ray_opts: RayOptions | None = None, on_shard: Callable[[dict], None] | None = None):
        self.ray_opts = ray_opts or RayOptions()
        self.on_shard = on_shard

    def check(self, opts: RunOptions, live: LiveParts) -> list[str]:
        require("ray", "carpool run --ray")
        if opts.report:  # refused at start, not found out after the whole job
            raise RayRunError("--report is not written for --ray runs (the shards' requests are timed in "
                              "their workers): leave it out; --summary-json keeps the job's figures")
        if opts.retry_errors:
            raise RayRunError("--retry-errors runs in one process: resume without --ray")
        if live.engine is not None:
            raise RayRunError("an in-process engine object cannot be shipped to Ray workers; "
                              "leave engine=None (each worker starts its own) or pass endpoints")
        if live.budget is not None:  # dropping it would let the workers spend past the limit
            raise RayRunError("a budget object cannot be shipped to Ray workers; give rpm/tpm, and a Redis URL "
                              "(--redis) for one budget shared by every worker")
        return []

    def probe_targets(self, opts: RunOptions) -> list[EndpointSpec]:
        # The workers, not this driver, talk to the endpoints (on a cluster they may reach
        # what the driver cannot), and each shard pauses through an outage on its own.
        return []

    async def run(self, job: StartedJob) -> tuple[JobStats, list[str]]:
        """The shards to their end.  The driver blocks this thread (and the loop on it) while
        the cluster works: Ray's waits are not awaitable, and the loop has nothing else to do
        meanwhile; Ctrl-C reaches it as ``KeyboardInterrupt`` (``_signals_raise``)."""
        with _signals_raise():
            return self._drive(job.opts, job.live)

    def request_stop(self, grace_s: float | None = None) -> None:
        """Nothing to do: while the shards run, a stop comes as ``KeyboardInterrupt``."""

    def _drive(self, opts: RunOptions, live: LiveParts) -> tuple[JobStats, list[str]]:
        import ray

        started = time.monotonic()
        files = _Files.of(opts, self.ray_opts)
        if opts.fresh:
            files.start_over()
        if not files.workdir.exists() and files.output.exists() and files.output.stat().st_size > 0:
            done = _finished_before(files.output, files.input)
            if done is not None:
                return done
            raise RayRunError(
                f"{files.output} already holds results of a run that did not finish here (no {files.workdir}); "
                "resume it without --ray, or pass --fresh to start over on Ray")
        own_ray = not ray.is_initialized()
        if own_ray:
            address = None if self.ray_opts.address in (None, "", "local") else self.ray_opts.address
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
            kwargs.update(self.ray_opts.init_kwargs)
            ray.init(address=address, **kwargs)
        try:
            stats, messages = self._run_on(ray, opts, live, files)
        finally:
            if own_ray:
                ray.shutdown()
        stats.started = started
        stats.finished = time.monotonic()
        return stats, messages

    def _workers(self, ray: Any) -> tuple[int, list[str]]:
        """How many workers the cluster has room for, and a note when fewer than asked."""
        ro = self.ray_opts
        cpus = float(ray.cluster_resources().get("CPU", 1.0))
        fit = int(cpus // max(ro.cpus_per_worker, 0.01))
        if ro.gpus_per_worker:
            fit = min(fit, int(ray.cluster_resources().get("GPU", 0.0) // ro.gpus_per_worker))
        if fit < 1:
            raise RayRunError(f"the Ray cluster has no room for one worker of {ro.cpus_per_worker:g} CPU "
                              f"and {ro.gpus_per_worker:g} GPU ({ray.cluster_resources()})")
        notes = []
        if ro.workers and ro.workers > fit:
            notes.append(f"--ray-workers {ro.workers}: the cluster has room for {fit} workers of "
                         f"{ro.cpus_per_worker:g} CPU / {ro.gpus_per_worker:g} GPU; running {fit}")
        return min(ro.workers or fit, fit), notes

    def _job(self, opts: RunOptions, live: LiveParts, files: _Files, workers: int,
             pending: list[Shard]) -> tuple[dict, list[str]]:
        """What every worker is given (the options of a shard's run, the model identity the
        driver settled, the shared state), and a note."""
        from carpool.distributed.worker import SharedState, default_budget_name

        ro = self.ray_opts
        notes = []
        job_opts = dataclasses.replace(opts, input=str(files.input), output=str(files.output),
                                       errors=str(files.errors) if files.errors else None, progress=False,
                                       quiet=True)
        if (opts.rpm or opts.tpm) and not ro.redis:
            # Without a shared bucket each worker would spend the whole budget: split it.
            n = min(workers, len(pending)) or 1
            job_opts = dataclasses.replace(job_opts, rpm=opts.rpm / n if opts.rpm else None,
                                           tpm=opts.tpm / n if opts.tpm else None)
            notes.append(f"without --redis the --rpm/--tpm budget is split evenly over {n} workers; "
                         "--redis URL shares one budget (faster when shards differ)")
        shared = SharedState(redis=ro.redis, budget_name=ro.budget_name or default_budget_name(opts),
                             window_s=ro.rpm_window_s, burst_s=ro.rpm_burst_s) if ro.redis else None
        job = {"opts": job_opts, "identity": live.identity, "shared": shared, "workdir": str(files.workdir)}
        return job, notes

    def _run_on(self, ray: Any, opts: RunOptions, live: LiveParts, files: _Files) -> tuple[JobStats, list[str]]:
        workers, notes = self._workers(ray)
        shards = _plan(files.input, files.fmt, files.workdir, self.ray_opts.shards or 4 * workers)
        pending = [s for s in shards if not files.shard(s)[2].exists()]
        job, job_notes = self._job(opts, live, files, workers, pending)
        notes += job_notes
        run_error = None
        seen: list[dict] = []  # the summaries of this run's shards, finished or not
        if pending:
            try:
                seen = _run_pending(ray, pending, job, min(workers, len(pending)), self.ray_opts, self.on_shard)
            except Exception as e:  # noqa: BLE001  (a worker crashed: finished shards are kept)
                run_error = e
        markers = [files.shard(s)[2] for s in shards]
        summaries = [json.loads(m.read_text()) for m in markers if m.exists()]
        missing = [s.index for s, m in zip(shards, markers, strict=True) if not m.exists()]
        stats = _combine(summaries)
        assert stats.shards is not None
        stats.shards.shards, stats.shards.shards_done = len(shards), len(summaries)
        stats.shards.workers, stats.shards.workdir = workers, str(files.workdir)
        stats.backend = _backend_label(opts, workers)
        messages = notes + [m for s in summaries for m in s.get("messages", [])]
        if missing:
            messages.append(_unfinished(stats, seen, run_error, opts, f"{len(missing)} of {len(shards)}"))
            return stats, messages
        messages += self._merge(opts, live, files, shards)
        stats.shards.complete = True
        return stats, messages

    def _merge(self, opts: RunOptions, live: LiveParts, files: _Files, shards: list[Shard]) -> list[str]:
        """The shard outputs, in shard order, into the job's output (and errors file)."""
        from carpool.distributed.worker import ShardReader, fix_cross_shard_duplicates

        messages = []
        parts = [files.shard(s) for s in shards]
        dups = fix_cross_shard_duplicates(
            shards, parts, lambda sh: ShardReader(str(files.input), sh, opts.fmt, opts.template, opts.defaults))
        if dups:
            messages.append(f"{dups} tasks reused a custom_id of an earlier line: "
                            "refused as input errors (custom_ids must be unique in a file)")
        merge_files([out for out, _err, _marker in parts], files.output)
        if files.errors is not None:
            merge_files([err for _out, err, _marker in parts if err is not None], files.errors)
        _write_state(files.output, files.input, opts, live)
        if not self.ray_opts.keep_workdir:
            shutil.rmtree(files.workdir, ignore_errors=True)
        return messages


def _unfinished(stats: JobStats, seen: list[dict], run_error: Exception | None, opts: RunOptions,
                missing: str) -> str:
    """Mark ``stats`` as stopped by an outage or unfinished, and say so."""
    assert stats.shards is not None
    workdir = stats.shards.workdir
    outage = next((s["outage_stop"] for s in seen if s.get("stopped_by_outage")), None)
    if outage is not None:
        stats.stopped_by_outage = True
        stats.outage_stop = outage
        return (f"stopped by an outage ({outage}, past --outage-timeout {opts.outage_timeout:g} s): "
                f"{missing} shards did not finish; finished work is kept in {workdir}. "
                "Run the same command again once the endpoint is back to resume.")
    first = str(run_error).strip().splitlines()[0][:300] if run_error and str(run_error).strip() else ""
    why = f" ({type(run_error).__name__}: {first})" if run_error else ""
    stats.unfinished = f"{missing} shards did not finish{why}"
    return f"{stats.unfinished}; finished work is kept in {workdir}. Run the same command again to resume."


def run_on_ray(opts: RunOptions, ray_opts: RayOptions | None = None,
               on_shard: Callable[[dict], None] | None = None) -> JobStats:
    """Run the job described by ``opts`` on Ray: the ``Runner`` with its tasks spread over
    the cluster (``RayShards``).  ``stats.shards.complete`` says whether every shard
    finished and the output was merged."""
    from carpool.jobs.runner import Runner

    return asyncio.run(Runner(opts, RayShards(ray_opts, on_shard)).run())


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


def _finished_before(output: Path, input_path: Path) -> tuple[JobStats, list[str]] | None:
    """The statistics of an earlier run into ``output`` that finished on this very input
    (nothing to do), else None."""
    try:
        state = json.loads(Path(f"{output}.carpool.json").read_text())
    except (OSError, ValueError):
        return None
    if not state.get("finished") or state.get("input") != str(input_path) \
            or state.get("input_size") != input_path.stat().st_size:
        return None
    with open(output, "rb") as f:
        lines = sum(1 for _ in f)
    stats = JobStats(skipped=lines, shards=ShardsRun(complete=True, already_done=True))
    stats.finished = stats.started
    return stats, [f"{output} is already complete ({lines:,} lines); nothing to do (--fresh reruns it)"]


def _write_state(output: Path, input_path: Path, opts: RunOptions, live: LiveParts) -> None:
    # The runner's state file beside the output, so a later single-process ``carpool run``
    # into the same output resumes from it like from its own.
    from carpool.jobs.fingerprint import make_fingerprint
    from carpool.journal.journal import Journal

    Journal(output, opts.errors, fingerprint=make_fingerprint(opts, live)).write_state(str(input_path), finished=True,
                                                                                argv=opts.argv)


def run_batch_on_ray(input: str, output: str, *, address: str | None = None, workers: int | None = None,
                     redis: str | None = None, ray_options: RayOptions | None = None, **options) -> dict:
    """Python API: ``run_batch`` spread over Ray; ``options`` are those of ``carpool.run_batch``
    (RunOptions fields, plus the ``model``/``max_tokens``/``temperature`` shortcuts).  Returns
    the summary ``run_batch`` returns (``JobStats.to_dict`` and the messages)."""
    from carpool.jobs.python_api.arguments import make_job
    from carpool.jobs.runner import Runner

    ray_options = ray_options or RayOptions(address=address, workers=workers, redis=redis)
    opts, live = make_job(input, output, **options)
    runner = Runner(opts, RayShards(ray_options), live=live)
    stats = asyncio.run(runner.run())
    return {**stats.to_dict(), "messages": runner.messages}
