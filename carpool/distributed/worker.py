"""What runs inside one Ray worker: the batch pipeline on one shard of the input.

``ShardWorker`` composes ``carpool.jobs.pipeline.Pipeline`` from the default parts of
the job's ``RunOptions`` (``carpool.jobs.parts.build_parts``) with three of its own:
- the source is its shard's lines only (``ShardReader``), numbered as in the whole file,
  so errors say the same line and default custom_ids (``line-<n>``) are the same as in
  a single-process run;
- its RPM/TPM budget is the Redis one shared by every worker (``RedisBudget``);
- with several endpoints, its balancer shares cooldowns through Redis (``SharedBalancer``).
Its output file is the shard's output *and* its journal (the pipeline's design), so a
shard that was cut short resumes where it stopped, on whichever worker gets it next.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from carpool.client.endpoints import split_credentials
from carpool.client.retry import ErrorKind
from carpool.distributed.shards import Shard, iter_shard_lines
from carpool.jobs.endpoints_file import job_endpoints
from carpool.jobs.input.readers import Reader, parse_jsonl_lines
from carpool.jobs.input.tasks import BadLine, Task, TaskDefaults, Template, repeat_id, repeat_reason
from carpool.jobs.options import LiveParts, RunOptions
from carpool.jobs.parts import build_parts, job_defaults
from carpool.jobs.pipeline import Pipeline
from carpool.jobs.summary.stats import JobStats
from carpool.journal.done import SeenIds
from carpool.journal.recovery import line_id
from carpool.journal.writer import error_line

if TYPE_CHECKING:
    from carpool.client.balancer import Balancer
    from carpool.client.budget import Budget
    from carpool.client.models import ModelIdentity
    from carpool.engine.protocol import EngineClient


@dataclass
class SharedState:
    """Where the workers meet: one Redis for the budget and the endpoint cooldowns."""

    redis: str | None = None
    budget_name: str = "default"
    window_s: float = 60.0  # the window the provider counts its per-minute limits in
    burst_s: float = 1.0


def default_budget_name(opts: RunOptions) -> str:
    """Jobs against the same endpoints and model share one budget (it is the provider's)."""
    urls = sorted(split_credentials(u)[0] for u in opts.endpoints)  # a password is no part of a name
    ident = json.dumps([urls, opts.defaults.model or opts.engine_model])
    return "job-" + hashlib.sha1(ident.encode()).hexdigest()[:12]


class ShardReader(Reader):
    """A ``Reader`` that yields only the lines of one shard (JSONL) or rows (Parquet)."""

    def __init__(self, path: str | os.PathLike, shard: Shard, fmt: str | None = None,
                 template: Template | None = None, defaults: TaskDefaults | None = None):
        super().__init__(path, fmt, template, defaults)
        self.shard = shard
        self.yielded = 0  # tasks (and bad lines) handed to the pipeline: each must get a line

    def _counted(self, items: Iterator[Task | BadLine]) -> Iterator[Task | BadLine]:
        for item in items:
            self.yielded += 1
            yield item

    def __iter__(self) -> Iterator[Task | BadLine]:
        if self.fmt == "parquet":
            return self._counted(self._rows(self._parquet_range()))
        if self.fmt == "csv":
            return self._counted(super().__iter__())  # CSV is planned as one shard (quoted newlines)
        return self._counted(self._jsonl_range())

    def count(self) -> int | None:
        return self.shard.lines

    def _jsonl_range(self) -> Iterator[Task | BadLine]:
        yield from parse_jsonl_lines(iter_shard_lines(self.path, self.shard), self.defaults)

    def _parquet_range(self) -> Iterator[tuple[int, dict]]:
        # For Parquet a shard's start/end are row-group indices and first_line a row number.
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(self.path)
        n = self.shard.first_line - 1
        for batch in pf.iter_batches(batch_size=2048, row_groups=list(range(self.shard.start, self.shard.end))):
            for row in batch.to_pylist():
                n += 1
                yield n, row


async def _shared_parts(opts: RunOptions, shared: SharedState | None
                        ) -> tuple[Budget | None, Balancer | None, list[Callable[[], Awaitable[None]]]]:
    """The budget and balancer the workers share through Redis (None: the local ones), and
    how to close them (the balancer first: it flushes into the cooldown client)."""
    if shared is None or not shared.redis:
        return None, None, []
    budget: Budget | None = None
    balancer: Balancer | None = None
    closers: list[Callable[[], Awaitable[None]]] = []
    if len(opts.endpoints) > 1 and not opts.echo:
        from carpool.distributed.redis_cooldown import RedisCooldown, SharedBalancer

        cooldown = RedisCooldown(shared.redis, name=shared.budget_name)
        shared_balancer = SharedBalancer(job_endpoints(opts), cooldown)
        balancer = shared_balancer
        closers += [shared_balancer.flush, cooldown.close]
    if opts.rpm or opts.tpm:
        from carpool.distributed.redis_budget import RedisBudget

        redis_budget = RedisBudget(shared.redis, rpm=opts.rpm, tpm=opts.tpm, name=shared.budget_name,
                                   window_s=shared.window_s, burst_s=shared.burst_s)
        budget = redis_budget
        closers.append(redis_budget.close)
    return budget, balancer, closers


def shard_paths(workdir: Path, shard: Shard, with_errors: bool) -> tuple[Path, Path | None, Path]:
    """(output, errors or None, done marker) of one shard."""
    base = workdir / shard.name
    return (Path(f"{base}.jsonl"), Path(f"{base}.errors.jsonl") if with_errors else None,
            Path(f"{base}.done.json"))


def reorder_by_input(path: Path, reader: Reader) -> None:
    """Rewrite a shard output in input order (after a resume appended out of order).

    Memory: one (offset, length) per line of the shard, not the lines themselves.
    """
    if not path.exists():
        return
    index: dict[str, list[tuple[int, int]]] = {}
    with open(path, "rb") as f:
        offset = 0
        for line in f:
            cid = line_id(line)
            index.setdefault(cid or "", []).append((offset, len(line)))
            offset += len(line)
    tmp = path.with_name(path.name + ".ordered")
    with open(path, "rb") as src, open(tmp, "wb") as out:
        for item in reader:
            slots = index.get(item.custom_id)
            if not slots:
                continue  # this task's line is in the other file (errors vs results)
            off, n = slots.pop(0)
            src.seek(off)
            out.write(src.read(n))
        for slots in index.values():  # lines for ids not in the input (should not happen): keep them
            for off, n in slots:
                src.seek(off)
                out.write(src.read(n))
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


def start_embedded_engine(opts: RunOptions, loop: asyncio.AbstractEventLoop) -> EngineClient | None:
    """The in-process engine ``opts`` asks for, started on ``loop``; None when the job goes to
    endpoints or is an echo run. Shared by ``ShardWorker`` and ``ray_data.CarpoolMapper``,
    which each keep the one they get for all their shards or batches."""
    if opts.endpoints or opts.echo:
        return None
    from carpool.engine import AsyncEngine, EngineConfig

    engine = AsyncEngine(EngineConfig(model=opts.engine_model, **opts.engine_config))
    loop.run_until_complete(engine.start())
    return engine


class ShardWorker:
    """A Ray Data actor (``map_batches`` callable class): runs whole shards, one at a time.

    It keeps one event loop, and with the embedded engine one engine, for all the shards
    it is given, so the model is loaded once per worker, not once per shard.
    """

    def __init__(self, job: dict):
        self.opts: RunOptions = job["opts"]
        # The model identity the driver settled (None: told from the options), so every shard's
        # fingerprint and cache keys are the ones a single-process run would use.
        self.identity: ModelIdentity | None = job.get("identity")
        self.shared: SharedState | None = job.get("shared")
        self.workdir = Path(job["workdir"])
        self.loop = asyncio.new_event_loop()
        self.engine: EngineClient | None = None
        # Set when a shard stopped by an outage (--outage-timeout): the next shards would
        # only wait out the same outage, so this worker hands them back unstarted.
        self.outage: str | None = None

    def _engine(self) -> EngineClient | None:
        if self.engine is None:
            self.engine = start_embedded_engine(self.opts, self.loop)
        return self.engine

    def _reader(self, shard: Shard) -> ShardReader:
        o = self.opts
        return ShardReader(o.input, shard, o.fmt, o.template, job_defaults(o))

    async def _run(self, opts: RunOptions, source: ShardReader, engine: EngineClient | None) -> Pipeline:
        budget, balancer, closers = await _shared_parts(opts, self.shared)
        live = LiveParts(engine=engine, budget=budget, identity=self.identity)
        parts = build_parts(opts, live, source=source, balancer=balancer)
        parts.closers += closers
        pipeline = Pipeline(parts, opts)
        await pipeline.run()
        return pipeline

    def run_shard(self, shard: Shard) -> dict:
        out, err, marker = shard_paths(self.workdir, shard, bool(self.opts.errors))
        if marker.exists():
            return json.loads(marker.read_text())
        if self.outage is not None:
            return {"shard": shard.index, "stats": JobStats().to_dict(), "stopped_by_outage": True,
                    "outage_stop": self.outage, "pid": os.getpid(), "host": os.uname().nodename,
                    "messages": [f"shard {shard.index}: not started (an earlier shard of this worker stopped "
                                 "by an outage); it runs on resume"]}
        opts = dataclasses.replace(self.opts, output=str(out), errors=str(err) if err else None, progress=False,
                                   quiet=True, report=None, fresh=False)
        source = self._reader(shard)
        started = time.time()
        pipeline = self.loop.run_until_complete(self._run(opts, source, self._engine()))
        stats = pipeline.stats
        if opts.ordered and stats.skipped:
            for path in (out, err):
                if path is not None:
                    reorder_by_input(path, self._reader(shard))
        summary: dict[str, Any] = {"shard": shard.index, "stats": stats.to_dict(), "messages": pipeline.messages,
                   "pid": os.getpid(), "host": os.uname().nodename, "started": started, "finished": time.time()}
        # Tasks read but without a line in the output (a task that crashed, or one an outage
        # kept from running): not finished.
        unwritten = max(0, source.yielded - stats.done - stats.skipped)
        if stats.stopped_by_outage:
            self.outage = stats.outage_stop or "paused: endpoint down"
            summary.update(stopped_by_outage=True, outage_stop=self.outage)
            summary["messages"].append(f"shard {shard.index}: stopped by an outage ({self.outage}, past "
                                       f"--outage-timeout {opts.outage_timeout:g} s); its unfinished tasks "
                                       "run on resume")
        elif unwritten:
            summary["messages"].append(f"shard {shard.index}: {unwritten} tasks got no output line; "
                                       "the shard is not marked finished (run again to resume)")
        if not stats.interrupted and not stats.stopped_by_outage and not unwritten:
            tmp = marker.with_suffix(".tmp")
            tmp.write_text(json.dumps(summary))
            os.replace(tmp, marker)
        return summary

    def __call__(self, batch: dict) -> dict:
        results = []
        for i in range(len(batch["index"])):
            shard = Shard(**{f.name: int(batch[f.name][i]) for f in dataclasses.fields(Shard)})
            results.append(json.dumps(self.run_shard(shard)))
        return {"summary": results}


def _ids(path: Path) -> Iterator[str]:
    with open(path, "rb") as f:
        for line in f:
            cid = line_id(line)
            if cid is not None:
                yield cid


def fix_cross_shard_duplicates(shards: list[Shard], parts: list[tuple[Path, Path | None, Path]],
                               make_reader: Callable[[Shard], Reader]) -> int:
    """Give a custom_id used in an earlier shard the single-process treatment.

    Each shard's runner refuses repeats inside its shard, but cannot see the others'. Here,
    shard by shard in input order, a result whose custom_id an earlier shard already used
    becomes the runner's duplicate error line (under ``<id>#line-<n>``), in place, so the
    merged output is the one a single process writes.  (Such a task was sent once in vain.)
    Returns how many lines were rewritten.
    """
    earlier = SeenIds()
    # Every id in every shard's files: a name made up for a repeat must be none of them (a user
    # may have named a task ``a#line-2`` in another shard).
    taken = SeenIds()
    for out, err, _marker in parts:
        for p in (out, err):
            if p is not None and p.exists():
                for cid in _ids(p):
                    taken.add(cid)
    fixed = 0
    for shard, (out, err, _marker) in zip(shards, parts, strict=True):
        files = [p for p in (out, err) if p is not None and p.exists()]
        # Within a shard ids are unique (the runner renamed repeats), so a refused add means
        # an earlier shard used the id.
        dups = {cid for p in files for cid in _ids(p) if not earlier.add(cid)}
        if not dups:
            continue
        line_of = {}
        for item in make_reader(shard):
            if item.custom_id in dups and item.custom_id not in line_of:
                line_of[item.custom_id] = item.line_no
        moved: list[bytes] = []  # error lines that belong in the errors file, when there is one
        for p in files:
            tmp = p.with_name(p.name + ".dedup")
            with open(p, "rb") as src, open(tmp, "wb") as dst:
                for line in src:
                    dup = line_id(line)
                    if dup is not None and dup in dups:
                        n = line_of.get(dup, 0)
                        # The same name and words as the runner's own refusal.
                        bad = BadLine(n, repeat_id(dup, n, taken.add), "custom_id", repeat_reason(dup))
                        line = error_line(bad.custom_id, ErrorKind.INVALID_INPUT, bad.message, n, "custom_id")
                        fixed += 1
                        if p == out and err is not None:
                            moved.append(line)
                            continue
                    dst.write(line)
            os.replace(tmp, p)
        if moved and err is not None:
            with open(err, "ab") as f:
                f.writelines(moved)
    return fixed
