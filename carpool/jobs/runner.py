"""The batch pipeline: reader -> journal (skip done) -> cache / dedup -> limiter ->
backend (HTTP or the in-process engine) -> cache store -> writer (the journal).

Memory stays bounded whatever the file size: the reader is a generator, and a task takes
one of ``max_pending`` slots from the moment it is read until its line is in the output
file, so at most that many tasks (and, with ``--ordered``, held-back lines) exist at once.
Concurrency towards the backend is the limiter's business, below that bound.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import json
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field

from carpool.client.base import CallResult, Request
from carpool.client.budget import make_budget
from carpool.client.executor import Executor, Stopped
from carpool.client.limiter import FixedLimiter, make_limiter
from carpool.client.pool import Timeouts
from carpool.client.retry import ErrorKind, RetryPolicy
from carpool.jobs.journal import DoneSet, Journal, SeenIds
from carpool.jobs.progress import Progress
from carpool.jobs.readers import Reader
from carpool.jobs.summary import JobStats
from carpool.jobs.tasks import BadLine, Task, TaskDefaults, Template, prefix_key
from carpool.jobs.writer import Appender, ResultWriter, error_line, success_line

try:  # the cache room's package; the pipeline works without it (exact-body dedup only)
    from carpool import cache as _cache

    _cache.open_cache  # noqa: B018  (fail here if the package is still an empty stub)
except (ImportError, AttributeError):
    _cache = None


class OutputError(OSError):
    """The output could not be written; the message says which file, why, and how to resume."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


@dataclass
class RunOptions:
    input: str
    output: str
    errors: str | None = None
    fmt: str | None = None
    template: Template | None = None
    defaults: TaskDefaults = field(default_factory=TaskDefaults)
    endpoints: list[str] = field(default_factory=list)  # empty: the embedded engine
    api_key: str | None = None
    engine_model: str = "smollm2"
    engine_config: dict = field(default_factory=dict)  # extra EngineConfig fields
    engine: object | None = None  # an EngineClient already running (API / tests); not shut down here
    embedder_factory: object | None = None
    concurrency: int | None = None
    max_concurrency: int | None = None
    rpm: float | None = None
    tpm: float | None = None
    budget: object | None = None  # a Budget (e.g. the shared Redis one); None: local buckets from rpm/tpm
    stream: bool = True
    timeouts: Timeouts = field(default_factory=Timeouts)
    max_attempts: int = 6
    ordered: bool = False
    prefix_order: bool = False
    prefix_window: int = 1024
    cache: str | None = None  # None: the default SQLite file; "off"; sqlite:///...; redis://...
    cache_ttl: float | None = None
    cache_sampled: bool = False
    semantic_cache: float | None = None  # cosine threshold, opt-in
    semantic_audit: int = 0  # re-ask this many random semantic hits after the job (carpool/cache/audit.py)
    dedup: bool = True
    fresh: bool = False
    progress: bool | None = None  # None: when stderr is a terminal
    report: str | None = None
    max_pending: int = 2048
    dry_run: bool = False  # answer every task locally without a backend (memory / overhead runs)
    latency_signal: str = "per_token"
    argv: list[str] | None = None
    quiet: bool = False


class DryBackend:
    """Answers at once with a fixed tiny body: the pipeline without any model or network."""

    name = "dry-run"

    async def call(self, req: Request) -> CallResult:
        body = {"id": "dry", "object": "chat.completion", "model": "dry-run",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}
        return CallResult(ok=True, status_code=200, body=body, request_id="dry", ttft_s=0.0)

    async def close(self) -> None:
        return None


def _body_key(req: Request) -> str:
    doc = json.dumps([req.kind, req.body], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(doc.encode()).hexdigest()


def _fallback_cacheable(body: dict, kind: str) -> bool:
    return kind == "embedding" or body.get("temperature", 1.0) == 0


class Runner:
    def __init__(self, opts: RunOptions):
        if opts.endpoints and not opts.dry_run and not opts.defaults.require_model:
            opts.defaults = dataclasses.replace(opts.defaults, require_model=True)
        self.opts = opts
        self.stats = JobStats()
        self._stop = False
        self._pending: set[asyncio.Task] = set()
        self._inflight: dict[str, asyncio.Future] = {}  # dedup: key -> leader's result
        self._recent: collections.OrderedDict[str, CallResult] = collections.OrderedDict()
        self._store = None
        self._sem = None
        self._audit = None
        self._owned_engine = None
        self._warned_cache = False
        self._write_failed = False
        self.executor: Executor | None = None
        self.limiter: FixedLimiter | None = None
        self.backend = None
        self.messages: list[str] = []  # what the user should read after the run (warnings, resume)

    # -- setup ----------------------------------------------------------------------------
    async def _make_backend(self):
        o = self.opts
        if o.dry_run:
            return DryBackend()
        if o.endpoints:
            from carpool.client.http_backend import HttpBackend

            return HttpBackend(o.endpoints, model=o.defaults.model, api_key=o.api_key, stream=o.stream,
                               timeouts=o.timeouts, max_connections=o.max_concurrency or 0)
        from carpool.client.engine_backend import EngineBackend, default_embedder_factory

        engine = o.engine
        if engine is None:
            from carpool.engine import AsyncEngine, EngineConfig

            # Built on first use (the first generation task): a job of embeddings only never
            # loads the generation model.
            engine = AsyncEngine(EngineConfig(model=o.engine_model, **o.engine_config))
            self._owned_engine = engine
        return EngineBackend(engine, o.embedder_factory or default_embedder_factory)

    def _make_limiter(self) -> FixedLimiter:
        o = self.opts
        if o.dry_run and not o.concurrency:
            return FixedLimiter(256)
        if not o.endpoints and not o.concurrency:
            # In-process the engine's own scheduler batches: keep it fed (two per batch slot),
            # nothing to learn from 429s that cannot happen.
            seqs = int(o.engine_config.get("max_num_seqs", 64))
            n = 2 * seqs if not o.max_concurrency else min(2 * seqs, o.max_concurrency)
            return FixedLimiter(n)
        return make_limiter(o.concurrency, o.max_concurrency)

    def _open_caches(self) -> None:
        o = self.opts
        if _cache is None:
            self.stats.cache_backend = "unavailable"
            return
        try:
            self._store = _cache.open_cache(o.cache, ttl_s=o.cache_ttl)
            self.stats.cache_backend = getattr(self._store, "backend", type(self._store).__name__)
            loc = getattr(self._store, "path", None)
            if loc:
                self.stats.cache_backend += f" ({loc})"
        except Exception as e:  # noqa: BLE001  (a bad URL, an unreachable Redis: say so, run uncached)
            self.messages.append(f"cache disabled: {e}")
            self._store = None
            self.stats.cache_backend = "off (error)"
        if o.semantic_cache:
            try:
                sem_dir = _cache.default_semantic_dir(self._store)
                self._sem = _cache.SemanticCache(sem_dir, threshold=o.semantic_cache)
            except Exception as e:  # noqa: BLE001  (no embedder or FAISS: run without it)
                self.messages.append(f"semantic cache disabled: {e}")
                self._sem = None
        if o.semantic_audit and self._sem is None:
            self.messages.append("--semantic-audit: no semantic cache in this run (give --semantic-cache); "
                                 "nothing audited")
        elif o.semantic_audit:
            from carpool.cache.audit import SemanticAudit

            self._audit = SemanticAudit(o.semantic_audit)

    def _endpoint_identity(self) -> str:
        if self.opts.endpoints:
            return ",".join(sorted(self.opts.endpoints))
        return "carpool-engine" if not self.opts.dry_run else "dry-run"

    def _model_of(self, req: Request) -> str:
        if req.body.get("model"):
            return str(req.body["model"])
        return getattr(self.backend, "model_name", None) or self.opts.engine_model

    # -- control --------------------------------------------------------------------------
    def request_stop(self) -> None:
        """First Ctrl-C: stop reading, let in-flight requests finish.  Second: stop now."""
        self.stats.interrupted = True
        if not self._stop:
            self._stop = True
            if self.executor is not None:
                self.executor.stopping = True
            n = self.limiter.in_flight if self.limiter is not None else 0
            print(f"\ncarpool run: stopping; finishing {n} requests in flight "
                  "(Ctrl-C again to stop at once)", file=sys.stderr, flush=True)
            return
        for t in list(self._pending):
            t.cancel()
        slots = getattr(self, "_slots", None)
        if slots is not None:
            slots.release()  # the reader may wait for a slot no cancelled task will free

    def _stop_on_write_error(self) -> None:
        """The output cannot be written (disk full, I/O error): stop at once.  Nothing more can
        be journaled, so requests in flight are abandoned; they run again on resume."""
        self._write_failed = True
        self.stats.interrupted = True
        self._stop = True
        if self.executor is not None:
            self.executor.stopping = True
        for t in list(self._pending):
            t.cancel()
        slots = getattr(self, "_slots", None)
        if slots is not None:
            slots.release()  # the reader may wait for a slot

    def resume_command(self) -> str:
        argv = self.opts.argv if self.opts.argv is not None else sys.argv[1:]
        argv = [a for a in argv if a != "--fresh"]
        return "carpool " + shlex.join(argv)

    # -- the run --------------------------------------------------------------------------
    async def run(self) -> JobStats:
        o = self.opts
        reader = Reader(o.input, o.fmt, o.template, o.defaults)
        journal = Journal(o.output, o.errors)
        done = DoneSet()
        if o.fresh:
            journal.reset()
        elif journal.exists():
            warning = journal.check_state(o.input)
            if warning:
                self.messages.append("warning: " + warning)
            done = journal.recover()
            if journal.cut_bytes:
                self.messages.append(f"cut a half-written last line ({journal.cut_bytes} bytes) from the output")
        journal.write_state(o.input, finished=False, argv=o.argv)
        writer = ResultWriter(Appender(o.output), Appender(o.errors) if o.errors else None, ordered=o.ordered)
        self.backend = await self._make_backend()
        self.stats.backend = (f"http {', '.join(o.endpoints)}" if o.endpoints else
                              "dry-run" if o.dry_run else f"engine {getattr(self.backend, 'model_name', '')}")
        self.limiter = self._make_limiter()
        budget = o.budget if o.budget is not None else make_budget(o.rpm, o.tpm)
        self.executor = Executor(self.backend, self.limiter, budget,
                                 RetryPolicy(max_attempts=o.max_attempts), latency_signal=o.latency_signal)
        self._open_caches()
        progress = Progress(self.stats, o.progress if not o.quiet else False)
        progress.start()
        counter = asyncio.get_running_loop().run_in_executor(None, reader.count)
        counter.add_done_callback(lambda f: setattr(self.stats, "total", f.result()) if not f.exception() else None)
        ticker = asyncio.create_task(self._tick(writer, progress))
        self.stats.started = time.monotonic()
        try:
            await self._produce(reader, done, writer)
            while self._pending:
                await asyncio.gather(*list(self._pending), return_exceptions=True)
            if self._audit is not None and not self._stop:
                await self._run_audit()
        finally:
            ticker.cancel()
            for t in list(self._pending):
                t.cancel()
            writer.close()
            self.stats.finished = time.monotonic()
            self.stats.retries.update(self.executor.retries)
            self.stats.sample(self.limiter.snapshot())
            progress.stop()
            await self._close()
            if writer.error is not None:
                self.stats.interrupted = True
                self.stats.done -= writer.dropped
            journal.write_state(o.input, finished=not self.stats.interrupted, argv=o.argv)
        if writer.error is not None:
            e = writer.error
            raise OutputError(e.errno, f"cannot write {writer.error_path}: {e.strerror or e}. The complete "
                              "lines already in it are kept; fix it (free space, another -o) and resume "
                              f"with:\n  {self.resume_command()}")
        if self.stats.interrupted:
            self.messages.append(f"interrupted: {self.stats.done + self.stats.skipped:,} tasks are in {o.output}. "
                                 f"Resume with:\n  {self.resume_command()}")
        if o.report:
            from carpool.jobs.report import write_report

            write_report(o.report, self.stats, self.limiter, self._sem)
        return self.stats

    async def _run_audit(self) -> None:
        """Re-ask the sampled semantic hits, bypassing both caches; the output file is not changed."""
        from carpool.cache.audit import SemanticAudit

        audit: SemanticAudit = self._audit

        async def ask(item) -> None:
            try:
                res = (await self.executor.execute(item.request)).result
            except Stopped:
                return
            audit.record(item, res.body if res.ok else None,
                         None if res.ok else (res.error_message or f"status {res.status_code}"))

        await asyncio.gather(*(ask(item) for item in audit.sample))
        self.stats.semantic_audit = audit.report()
        self.messages.append(f"semantic audit: re-asked {audit.asked} of {audit.seen} semantic hits: "
                             f"{audit.disagreed} disagreed, {audit.failed} failed")

    async def _close(self) -> None:
        try:
            await self.backend.close()
        finally:
            if self._owned_engine is not None:
                await self._owned_engine.shutdown()
            for c in (self._store, self._sem):
                if c is not None and hasattr(c, "close"):
                    try:
                        c.close()
                    except Exception as e:  # noqa: BLE001  (closing must not hide the job's result)
                        self._cache_failed(e)

    async def _tick(self, writer: ResultWriter, progress: Progress) -> None:
        last_sample = 0.0
        while True:
            await asyncio.sleep(0.25)
            writer.tick()
            if writer.error is not None and not self._write_failed:
                self._stop_on_write_error()
            lim = self.limiter.snapshot()
            progress.update(f" conc {lim['in_flight']}/{lim['limit']:g}" if self.opts.endpoints else "")
            now = time.monotonic()
            if now - last_sample >= 1.0:
                last_sample = now
                self.stats.sample(lim)

    async def _produce(self, reader: Reader, done: DoneSet, writer: ResultWriter) -> None:
        o = self.opts
        slots = self._slots = asyncio.Semaphore(o.max_pending)
        seq = 0
        window: list[tuple[int, Task]] = []
        check = getattr(self.backend, "check", None)

        def written() -> None:
            slots.release()
            self.stats.done += 1

        self._written = written
        n = 0
        seen = SeenIds()
        for item in reader:
            if self._stop:
                break
            n += 1
            if n % 64 == 0:
                await asyncio.sleep(0)  # let responses in while a fast reader runs ahead
            cid = item.custom_id
            if not seen.add(cid):
                # The custom_id is the journal's key, so a repeat could not be resumed
                # safely; it is refused (as OpenAI's Batch API refuses it) under an id of
                # its own, so a resumed run finds that error line done too.
                dup_id = f"{cid}#line-{item.line_no}"
                if len(done) and dup_id in done:
                    self.stats.skipped += 1
                    continue
                item = BadLine(item.line_no, dup_id, "custom_id",
                               f"duplicate custom_id {cid!r}: it was used on an earlier line; "
                               "custom_ids must be unique in a file")
            elif len(done) and cid in done:
                self.stats.skipped += 1
                continue
            await slots.acquire()
            if self._stop:
                break
            s, seq = seq, seq + 1
            if isinstance(item, BadLine):
                self.stats.bad_lines += 1
                self.stats.errors[ErrorKind.INVALID_INPUT] += 1
                writer.emit(s, error_line(item.custom_id, ErrorKind.INVALID_INPUT, item.message, item.line_no,
                                          item.field), True, written)
                continue
            problem = check(item.request) if check is not None else None
            if problem is not None:
                self.stats.bad_lines += 1
                self.stats.errors[ErrorKind.INVALID_INPUT] += 1
                msg = f"line {item.line_no}: field '{problem[0]}': {problem[1]}"
                writer.emit(s, error_line(item.custom_id, ErrorKind.INVALID_INPUT, msg, item.line_no, problem[0]),
                            True, written)
                continue
            if o.prefix_order:
                window.append((s, item))
                if len(window) >= o.prefix_window:
                    self._dispatch_window(window, writer)
                    window = []
                continue
            self._dispatch(s, item, writer)
        if window:
            self._dispatch_window(window, writer)

    def _dispatch_window(self, window: list[tuple[int, Task]], writer: ResultWriter) -> None:
        # Stable sort by the start of the prompt: tasks sharing a prefix reach the server
        # together, while its prefix cache still holds the shared blocks.
        window.sort(key=lambda st: prefix_key(st[1]))
        for s, t in window:
            self._dispatch(s, t, writer)

    def _dispatch(self, seq: int, task: Task, writer: ResultWriter) -> None:
        t = asyncio.create_task(self._handle(seq, task, writer))
        self._pending.add(t)
        t.add_done_callback(self._pending.discard)

    # -- one task -------------------------------------------------------------------------
    def _cacheable(self, req: Request) -> bool:
        if _cache is not None:
            try:
                return _cache.is_cacheable(req.body, cache_sampled=self.opts.cache_sampled)
            except Exception as e:  # noqa: BLE001  (the cache room's code must not fail the job)
                self._cache_failed(e)
        return _fallback_cacheable(req.body, req.kind)

    def _key(self, req: Request) -> str:
        # The cache room's key normalises the prompt (costly); with no store and no semantic
        # cache, in-batch dedup only needs identical bodies, which a plain hash finds.
        if _cache is not None and ((self._store is not None and not isinstance(self._store, _cache.NullStore))
                                   or self._sem is not None):
            try:
                return _cache.cache_key(model=self._model_of(req), endpoint=self._endpoint_identity(), body=req.body)
            except Exception as e:  # noqa: BLE001  (the cache room's code must not fail the job)
                self._cache_failed(e)
        return _body_key(req)

    def _store_get(self, key: str) -> dict | None:
        if self._store is None:
            return None
        try:
            return self._store.get(key)
        except Exception as e:  # noqa: BLE001  (any backend error: run on uncached)
            self._cache_failed(e)
            return None

    def _store_put(self, key: str, body: dict) -> None:
        if self._store is None:
            return
        try:
            self._store.put(key, body, ttl_s=self.opts.cache_ttl)
        except Exception as e:  # noqa: BLE001  (any backend error: run on uncached)
            self._cache_failed(e)

    def _cache_failed(self, e: Exception) -> None:
        if not self._warned_cache:
            self._warned_cache = True
            self.messages.append(f"cache error (the job ran on without it): {e}")

    async def _handle(self, seq: int, task: Task, writer: ResultWriter) -> None:
        once = _OnceWriter(writer)
        try:
            await self._handle_one(seq, task, once)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - one task's failure must not hang or end the job
            # Without this line the task's slot would never be released (the job would stall
            # once max_pending tasks had failed) and the task would be lost, not recorded.
            if once.used:  # its line is written already: the failure came after (a stats update)
                self.messages.append(f"line {task.line_no}: internal error after writing its result: {e!r}")
                return
            self.stats.errors[ErrorKind.INTERNAL] += 1
            msg = f"line {task.line_no}: internal error in carpool ({type(e).__name__}: {e}); please report it"
            line = error_line(task.request.custom_id, ErrorKind.INTERNAL, msg, task.line_no)
            once.emit(seq, line, True, self._written)

    async def _handle_one(self, seq: int, task: Task, writer: _OnceWriter) -> None:
        req = task.request
        o = self.opts
        st = self.stats
        cacheable = self._cacheable(req) if (self._store is not None or o.dedup or self._sem) else False
        key = self._key(req) if cacheable else None
        fut: asyncio.Future | None = None
        if key is not None:
            hit = self._store_get(key)
            if hit is not None:
                st.cache_hits += 1
                st.saved_tokens += _usage_tokens(hit)
                writer.emit(seq, success_line(req.custom_id, 200, "cache:exact", hit), False, self._written)
                return
            if o.dedup:
                leader = self._inflight.get(key)
                if leader is not None:
                    try:
                        res = await asyncio.shield(leader)
                    except asyncio.CancelledError:
                        if not leader.cancelled():
                            raise  # we are cancelled ourselves
                        self._slots.release()  # the leader stopped unsent: so do we (resume redoes both)
                        return
                    st.dedup_fanouts += 1
                    self._emit_result(seq, task, res, 1, writer, fanout=True)
                    return
                recent = self._recent.get(key)
                if recent is not None:
                    self._recent.move_to_end(key)
                    st.dedup_fanouts += 1
                    self._emit_result(seq, task, recent, 1, writer, fanout=True)
                    return
                fut = asyncio.get_running_loop().create_future()
                self._inflight[key] = fut
        try:
            sem_text = sem_scope = sem_hit = None
            precheck = None
            if self._sem is not None and key is not None:
                sem_text = _cache.semantic_text(req.body)
                if sem_text is not None:
                    sem_scope = _cache.scope_key(model=self._model_of(req), endpoint=self._endpoint_identity(),
                                                 body=req.body)

                    async def precheck() -> CallResult | None:
                        # Looked up once this task holds a slot, so near-duplicates that finished
                        # while it waited are found.
                        nonlocal sem_hit
                        sem_hit = (await asyncio.to_thread(self._sem.lookup_many, [(sem_scope, sem_text)]))[0]
                        if sem_hit is None:
                            return None
                        return CallResult(ok=True, status_code=200, body=sem_hit.response,
                                          request_id=f"cache:semantic:{sem_hit.similarity:.3f}")
            async def after(res: CallResult) -> None:
                # Stored while the slot is still held: a near-duplicate waiting for this slot
                # finds it.  Errors of the store never fail the task.
                try:
                    await asyncio.to_thread(self._sem.add, sem_scope, sem_text, res.body)
                except Exception as e:  # noqa: BLE001
                    self._cache_failed(e)

            try:
                outcome = await self.executor.execute(req, precheck, after if sem_text is not None else None)
            except Stopped:
                self._slots.release()
                return  # not written: it is done on resume
            res = outcome.result
            if outcome.attempts == 0:  # answered by the semantic cache
                st.semantic_hits += 1
                st.saved_tokens += _usage_tokens(res.body)
                if len(st.semantic_similarities) < 1000:
                    st.semantic_similarities.append((req.custom_id, sem_hit.similarity))
                if self._audit is not None:
                    from carpool.cache.audit import AuditItem

                    self._audit.offer(AuditItem(req.custom_id, req, res.body, sem_hit.similarity, sem_hit.entry_id))
                self._finish_leader(key, fut, res)
                fut = None
                # The line says the answer is borrowed, how near the stored text was, and which entry.
                mark = {"similarity": round(sem_hit.similarity, 4), "matched_id": sem_hit.entry_id}
                writer.emit(seq, success_line(req.custom_id, 200, res.request_id, res.body, semantic=mark), False,
                            self._written)
                return
            st.sent += 1
            res = outcome.result
            self._account(res)
            if res.ok and key is not None:
                self._store_put(key, res.body)
            self._finish_leader(key, fut, res)
            fut = None
            self._emit_result(seq, task, res, outcome.attempts, writer)
        finally:
            if fut is not None and not fut.done():  # cancelled: followers must not wait forever
                fut.cancel()
                self._inflight.pop(key, None)

    def _finish_leader(self, key: str | None, fut: asyncio.Future | None, res: CallResult) -> None:
        if fut is None or key is None:
            return
        self._inflight.pop(key, None)
        if not fut.done():
            fut.set_result(res)
        if res.ok:
            self._recent[key] = res
            if len(self._recent) > 2048:
                self._recent.popitem(last=False)

    def _account(self, res: CallResult) -> None:
        st = self.stats
        if res.ok:
            st.prompt_tokens += res.prompt_tokens
            st.completion_tokens += res.completion_tokens
            st.cached_prompt_tokens += res.cached_tokens
            st.ttft.add(res.ttft_s)
            st.tpot.add(res.tpot_s)
            st.e2e.add(res.e2e_s)

    def _emit_result(self, seq: int, task: Task, res: CallResult, attempts: int, writer: _OnceWriter,
                     fanout: bool = False) -> None:
        req = task.request
        if res.ok:
            self.stats.ok += 1
            if fanout:
                self.stats.saved_tokens += res.prompt_tokens + res.completion_tokens
            rid = "dedup:" + res.request_id if fanout else res.request_id
            writer.emit(seq, success_line(req.custom_id, res.status_code or 200, rid, res.body), False, self._written)
            return
        kind = res.error_kind or ErrorKind.SERVER_ERROR
        self.stats.errors[kind] += 1
        msg = f"line {task.line_no}: {res.error_message}" if res.error_message else f"line {task.line_no}: {kind}"
        # An OpenAI-style refusal names the field at fault in error.param: keep it.
        err = res.body.get("error") if isinstance(res.body, dict) else None
        param = err.get("param") if isinstance(err, dict) else None
        field = param if isinstance(param, str) and param else None
        writer.emit(seq, error_line(req.custom_id, kind, msg, task.line_no, field, res.status_code or None,
                                    res.body, attempts), True, self._written)


class _OnceWriter:
    """One task's view of the writer: its first line goes through, any later one is dropped,
    so the catch-all in ``Runner._handle`` can never write a task twice (or free its slot twice)."""

    __slots__ = ("used", "writer")

    def __init__(self, writer: ResultWriter):
        self.writer = writer
        self.used = False

    def emit(self, seq: int, line: bytes, is_error: bool = False, done=None) -> None:
        if not self.used:
            self.used = True
            self.writer.emit(seq, line, is_error, done)


def _usage_tokens(body: dict) -> int:
    u = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(u, dict):
        return 0
    return int(u.get("total_tokens") or (u.get("prompt_tokens") or 0) + (u.get("completion_tokens") or 0))


def run_with_signals(runner: Runner) -> JobStats:
    """Run the job on a fresh event loop; Ctrl-C (SIGINT) and SIGTERM stop it gracefully."""

    async def main() -> JobStats:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
                loop.add_signal_handler(sig, runner.request_stop)
        return await runner.run()

    return asyncio.run(main())
