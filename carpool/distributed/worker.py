"""What runs inside one Ray worker: the batch runner's pipeline on one shard of the input.

``ShardRunner`` is ``carpool.jobs.runner.Runner`` with three changes, none of which
copies its code:
- it reads only its shard's lines (``ShardReader``), numbered as in the whole file, so
  errors say the same line and default custom_ids (``line-<n>``) are the same as in a
  single-process run;
- its RPM/TPM budget is the Redis one shared by every worker (``RedisBudget``);
- with several endpoints, its balancer shares cooldowns through Redis (``SharedBalancer``).
Its output file is the shard's output *and* its journal (the runner's design), so a
shard that was cut short resumes where it stopped, on whichever worker gets it next.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from carpool.distributed.shards import Shard, iter_shard_lines
from carpool.jobs.journal import _line_id  # the journal's own cheap custom_id decoder
from carpool.jobs.readers import Reader, parse_jsonl_lines
from carpool.jobs.runner import Runner, RunOptions
from carpool.jobs.tasks import BadLine, Task


@dataclass
class SharedState:
    """Where the workers meet: one Redis for the budget and the endpoint cooldowns."""

    redis: str | None = None
    budget_name: str = "default"
    window_s: float = 60.0  # the window the provider counts its per-minute limits in
    burst_s: float = 1.0


def default_budget_name(opts: RunOptions) -> str:
    """Jobs against the same endpoints and model share one budget (it is the provider's)."""
    ident = json.dumps([sorted(opts.endpoints), opts.defaults.model or opts.engine_model])
    return "job-" + hashlib.sha1(ident.encode()).hexdigest()[:12]


class ShardReader(Reader):
    """A ``Reader`` that yields only the lines of one shard (JSONL) or rows (Parquet)."""

    def __init__(self, path: str | os.PathLike, shard: Shard, fmt: str | None = None, template=None,
                 defaults=None):
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


class ShardRunner(Runner):
    """``opts.input`` is the shard's small stand-in file (see ``ShardWorker``); the tasks
    come from ``source`` = (the real input, its format) through ``ShardReader``."""

    def __init__(self, opts: RunOptions, shard: Shard, source: tuple[str, str | None],
                 shared: SharedState | None = None):
        super().__init__(opts)
        self.shard = shard
        self.source = source
        self.shared = shared
        self._redis_parts: list = []

    def make_shard_reader(self) -> ShardReader:
        o = self.opts
        return ShardReader(self.source[0], self.shard, self.source[1], o.template, o.defaults)

    async def _make_backend(self):
        backend = await super()._make_backend()
        balancer = getattr(backend, "balancer", None)
        if self.shared and self.shared.redis and balancer is not None and len(self.opts.endpoints) > 1:
            from carpool.distributed.redis_cooldown import RedisCooldown, SharedBalancer

            cooldown = RedisCooldown(self.shared.redis, name=self.shared.budget_name)
            backend.balancer = SharedBalancer(self.opts.endpoints, cooldown)
            self._redis_parts += [backend.balancer, cooldown]
        return backend

    async def _produce(self, reader, done, writer) -> None:
        # Called by Runner.run once the executor exists: swap in the shared budget and the
        # shard's own reader, then run the unchanged pipeline.
        o = self.opts
        if self.shared and self.shared.redis and (o.rpm or o.tpm):
            from carpool.distributed.redis_budget import RedisBudget

            budget = RedisBudget(self.shared.redis, rpm=o.rpm, tpm=o.tpm, name=self.shared.budget_name,
                                 window_s=self.shared.window_s, burst_s=self.shared.burst_s)
            self.executor.budget = budget
            self._redis_parts.append(budget)
        self.shard_reader = self.make_shard_reader()
        await super()._produce(self.shard_reader, done, writer)

    @property
    def unwritten(self) -> int:
        """Tasks read but without a line in the output (a task that crashed): not finished."""
        reader = getattr(self, "shard_reader", None)
        if reader is None:
            return 0
        return max(0, reader.yielded - self.stats.done - self.stats.skipped)

    async def _close(self) -> None:
        try:
            await super()._close()
        finally:
            for part in self._redis_parts:  # balancer first: it flushes into the cooldown client
                if hasattr(part, "flush"):
                    await part.flush()
                if hasattr(part, "close"):
                    await part.close()


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
            cid = _line_id(line)
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


def start_embedded_engine(opts: RunOptions, loop: asyncio.AbstractEventLoop):
    """The in-process engine ``opts`` asks for, started on ``loop``; None when the job goes to
    endpoints or is a dry run. Shared by ``ShardWorker`` and ``ray_data.CarpoolMapper``,
    which each keep the one they get for all their shards or batches."""
    if opts.endpoints or opts.dry_run:
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
        self.shared: SharedState | None = job.get("shared")
        self.workdir = Path(job["workdir"])
        self.loop = asyncio.new_event_loop()
        self.engine = None

    def _engine(self):
        if self.engine is None:
            self.engine = start_embedded_engine(self.opts, self.loop)
        return self.engine

    def run_shard(self, shard: Shard) -> dict:
        out, err, marker = shard_paths(self.workdir, shard, bool(self.opts.errors))
        if marker.exists():
            return json.loads(marker.read_text())
        # The runner opens (and counts, for its progress bar) ``opts.input`` itself; a one-line
        # stand-in describing the shard keeps it from scanning the whole input once per shard.
        stand_in = self.workdir / f"{shard.name}.input.jsonl"
        if not stand_in.exists():
            stand_in.write_text(json.dumps({"input": self.opts.input, **dataclasses.asdict(shard)}) + "\n")
        opts = dataclasses.replace(self.opts, input=str(stand_in), fmt="jsonl", output=str(out),
                                   errors=str(err) if err else None, progress=False, quiet=True, report=None,
                                   fresh=False, engine=self._engine())
        runner = ShardRunner(opts, shard, (self.opts.input, self.opts.fmt), self.shared)
        started = time.time()
        stats = self.loop.run_until_complete(runner.run())
        if opts.ordered and stats.skipped:
            for path in (out, err):
                if path is not None:
                    reorder_by_input(path, runner.make_shard_reader())
        summary = {"shard": shard.index, "stats": stats.to_dict(), "messages": runner.messages,
                   "pid": os.getpid(), "host": os.uname().nodename, "started": started, "finished": time.time()}
        if runner.unwritten:
            summary["messages"].append(f"shard {shard.index}: {runner.unwritten} tasks got no output line; "
                                       "the shard is not marked finished (run again to resume)")
        if not stats.interrupted and not runner.unwritten:
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
            cid = _line_id(line)
            if cid is not None:
                yield cid


def fix_cross_shard_duplicates(shards: list[Shard], parts: list[tuple[Path, Path | None, Path]],
                               make_reader) -> int:
    """Give a custom_id used in an earlier shard the single-process treatment.

    Each shard's runner refuses repeats inside its shard, but cannot see the others'. Here,
    shard by shard in input order, a result whose custom_id an earlier shard already used
    becomes the runner's duplicate error line (under ``<id>#line-<n>``), in place, so the
    merged output is the one a single process writes.  (Such a task was sent once in vain.)
    Returns how many lines were rewritten.
    """
    from carpool.client.retry import ErrorKind
    from carpool.jobs.journal import SeenIds
    from carpool.jobs.writer import error_line

    earlier = SeenIds()
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
                    cid = _line_id(line)
                    if cid in dups:
                        n = line_of.get(cid, 0)
                        # The same words as the runner's own refusal (carpool/jobs/runner.py).
                        bad = BadLine(n, f"{cid}#line-{n}", "custom_id",
                                      f"duplicate custom_id {cid!r}: it was used on an earlier line; "
                                      "custom_ids must be unique in a file")
                        line = error_line(bad.custom_id, ErrorKind.INVALID_INPUT, bad.message, n, "custom_id")
                        fixed += 1
                        if p == out and err is not None:
                            moved.append(line)
                            continue
                    dst.write(line)
            os.replace(tmp, p)
        if moved:
            with open(err, "ab") as f:
                f.writelines(moved)
    return fixed
