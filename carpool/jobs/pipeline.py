"""The batch pipeline: source -> journal (skip done) -> admission -> task cache (exact,
dedup, semantic) -> executor (budget, limiter, retries) -> backend (HTTP or the in-process
engine) -> writer (the journal).

``Pipeline`` runs the ``JobParts`` it is given (``carpool.jobs.parts``) and builds none
of them, so a caller composes the job it needs: ``carpool.jobs.runner.Runner`` the
default parts of ``RunOptions``, the Ray worker its shard's reader and shared budget.

Memory stays bounded whatever the file size: the source is a generator, and a task takes
one of ``max_pending`` slots (``carpool.jobs.task_slots``) from the moment it is read until
its line is in the output file, so at most that many tasks (and, with ``--ordered``,
held-back lines) exist at once.  Concurrency towards the backend is the limiter's business,
below that bound.

One task's way (``_run_task``): the task cache (``carpool.jobs.reuse.task_cache``) answers it,
from an earlier answer or by sending it through the executor; the pipeline counts what was
sent and writes the line.  Whatever happens, each task read gets exactly one line, or none
when the job stops before sending it or before the in-process engine began it (a first
Ctrl-C takes back what the engine had only queued); it is then done on resume.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import sys
import time
from collections.abc import Callable

from carpool import redact
from carpool.cache.audit import AuditItem, SemanticAudit
from carpool.client.base import CallResult, Refused
from carpool.client.executor import Executor
from carpool.client.retry import ErrorKind, RetryPolicy
from carpool.errors import OutageTimeout, OutputError, Stopped
from carpool.jobs.input.prefix_order import PlannedSource, WindowOrder
from carpool.jobs.input.readers import TaskSource
from carpool.jobs.input.tasks import BadLine, Task, prefix_key, repeat_id, repeat_reason
from carpool.jobs.options import RunOptions
from carpool.jobs.output.structured import check_answer
from carpool.jobs.parts import JobParts
from carpool.jobs.reuse.dedup import Dedup
from carpool.jobs.reuse.task_cache import Answer, TaskCache
from carpool.jobs.summary.progress import Progress
from carpool.jobs.summary.stats import JobStats
from carpool.jobs.task_slots import TaskSlot, TaskSlots
from carpool.journal.done import DoneSet, SeenIds
from carpool.journal.writer import ResultWriter, error_line, line_tail, success_line, with_tail


class _TaskWriter:
    """One task's view of the writer: its first line goes through, any later one is dropped,
    so the catch-all in ``Pipeline._handle`` can never write a task twice.  It owns the
    task's slot and frees it once the line is written, or skipped.

    A task can also end with no line (``drop``): stopped before it was sent, or cancelled.
    An error met once the job cancels its tasks is the cancellation's doing, not the task's
    outcome (code under a cancelled task may turn the cancellation into another exception),
    so it is dropped too: written, it would mark a task that never ran as done, and a resume
    would never send it."""

    __slots__ = ("cancelled", "done", "seq", "slot", "tail", "used", "writer")

    def __init__(self, writer: ResultWriter, seq: int, slot: TaskSlot, done: Callable[[], None],
                 cancelled: Callable[[], bool], tail: bytes = b""):
        """``slot``: the task's slot; ``done``: called once its line is written; ``cancelled``:
        whether the job cancels its tasks; ``tail``: the task's own fields every line of it
        ends with (``writer.line_tail``)."""
        self.writer, self.seq, self.slot, self.done, self.tail = writer, seq, slot, done, tail
        self.cancelled = cancelled
        self.used = False

    def emit(self, line: bytes, is_error: bool = False) -> None:
        if is_error and self.cancelled():
            self.drop()
        elif not self.used:
            self.used = True
            self.writer.emit(self.seq, with_tail(line, self.tail), is_error, self._written)

    def _written(self) -> None:
        self.slot.free()
        self.done()

    def drop(self) -> None:
        """The task ends unwritten: it is not done, so a resume runs it."""
        if not self.used:
            self.used = True
            self.writer.skip(self.seq, self.slot.free)


def _every_id(source: TaskSource) -> SeenIds:
    """The custom_ids of every item of ``source`` (a pass of its own over it)."""
    ids = SeenIds()
    for item in source:
        ids.add(item.custom_id)
    return ids


class Pipeline:
    def __init__(self, parts: JobParts, opts: RunOptions, notify: Callable[[str], None] | None = None):
        """``opts``: the flow settings (order, prefix windows, ``max_pending``, attempts,
        dedup) and the journal's state (input path, ``fresh``, ``argv``); ``notify``: told
        at once what the user should see while the job runs (a stop in progress)."""
        self.parts = parts
        self.opts = opts
        self.notify = notify
        self.stats = JobStats()
        self.messages = parts.messages  # what the user should read after the run (warnings, resume)
        self.executor = Executor(parts.backend, parts.limiter, parts.budget,
                                 RetryPolicy(max_attempts=opts.max_attempts, outage_timeout_s=opts.outage_timeout),
                                 latency_signal=opts.latency_signal)
        self._paused_told = False
        self.answers = TaskCache(parts.caches, Dedup() if opts.dedup else None, self.stats)
        self._slots = TaskSlots(opts.max_pending)
        self._pending: set[asyncio.Task] = set()
        self._stop = False
        self._cancelled = False  # the job cancels its tasks: their errors are not outcomes
        self._write_failed = False
        self._seen = SeenIds()
        self._all_ids: SeenIds | None = None  # every id of the input, read at the first repeat
        self._made_up = SeenIds()  # the ids made up for repeats
        self._seq = 0
        self._input = opts.input or None  # the state file's input ("": records in memory)

    # -- control --------------------------------------------------------------------------
    def request_stop(self, grace_s: float | None = None) -> None:
        """First Ctrl-C: stop reading, let in-flight requests finish.  Second: stop now.

        ``grace_s`` (SIGTERM): requests in flight get that long, then stop unwritten (they
        run on resume), so the job ends in seconds even when a stream sends only keep-alives
        until the total timeout; answers that came meanwhile are written."""
        self.stats.interrupted = True
        if not self._stop:
            self._stop = True
            self._slots.close()
            given_back = self.executor.stop()  # the engine's queued requests: they run on resume
            if grace_s is not None:
                asyncio.get_running_loop().call_later(grace_s, self._cancel_all)
            if self.notify is not None:
                limit = f"at most {grace_s:g} s" if grace_s is not None else "Ctrl-C again to stop at once"
                running = max(0, self.parts.limiter.in_flight - given_back)
                self.notify(f"\ncarpool run: stopping; finishing {running} requests in flight ({limit})")
            return
        self._cancel_all()

    def _stop_on_write_error(self) -> None:
        """The output cannot be written (disk full, I/O error): stop at once.  Nothing more can
        be journaled, so requests in flight are abandoned; they run again on resume."""
        self._write_failed = True
        self.stats.interrupted = True
        self._stop = True
        self._slots.close()
        self.executor.stop()
        self._cancel_all()

    def _stop_for_outage(self) -> None:
        """Every endpoint stayed down past --outage-timeout: stop sending and reading (exit
        code 4).  Tasks waiting for the endpoint are not written, so a rerun resumes them;
        requests still in flight finish or fail as they would."""
        if self.stats.stopped_by_outage:
            return
        self.stats.stopped_by_outage = True
        gate = self.executor.gate
        self.stats.outage_stop = gate.status() if gate is not None else ""
        self._stop = True
        self._slots.close()  # the reader may wait for a slot
        self.executor.stop()
        if self.notify is not None:
            self.notify(f"\ncarpool run: stopping: {self.stats.outage_stop}, longer than --outage-timeout "
                        f"{self.opts.outage_timeout:g} s; the unfinished tasks run on resume")

    def _watch_outage(self) -> str:
        """Called every tick: the pause shown in the progress line ("" when not paused); says
        once when a pause begins and ends; stops the job when it is too long."""
        gate = self.executor.gate
        if gate is None:
            return ""
        status = gate.status()
        if status and not self._paused_told and self.notify is not None:
            self.notify(f"\ncarpool run: {status}; sending resumes when it answers again "
                        f"(gives up after --outage-timeout {self.opts.outage_timeout:g} s)")
        elif not status and self._paused_told and self.notify is not None:
            last = gate.history[-1] if gate.history else None
            self.notify("\ncarpool run: the endpoint answers again"
                        + (f" after {last.seconds():.0f} s" if last is not None else "") + "; resuming")
        self._paused_told = bool(status)
        if status and gate.expired(self.opts.outage_timeout):
            self._stop_for_outage()
        return status

    def _cancelling(self) -> bool:
        return self._cancelled

    def _cancel_all(self) -> None:
        self._cancelled = True
        for t in list(self._pending):
            t.cancel()
        self._slots.close()  # the reader may wait for a slot no cancelled task will free

    def resume_command(self) -> str:
        return redact.resume_command(self.opts.argv if self.opts.argv is not None else sys.argv[1:])

    # -- the run --------------------------------------------------------------------------
    async def run(self) -> JobStats:
        o, parts = self.opts, self.parts
        try:
            done, notes = parts.journal.open(self._input, fresh=o.fresh, argv=o.argv)
            self.messages.extend(notes)
            self.stats.failed_before = parts.journal.failed_before
            writer = parts.journal.open_writer(o.ordered)
        except BaseException:
            await self._close()
            raise
        # Once the journal let the job start (a refused resume loads no model): the model loads
        # on a thread while the progress, the line count and the first records get going.
        began = time.monotonic()
        if parts.start_engine is not None:
            parts.start_engine()
        st = self.stats
        st.backend, st.cache_backend = parts.label, parts.caches.label
        st.cache_ttl_s = parts.caches.ttl_s if parts.caches.store is not None else None
        progress = Progress(st, o.progress if not o.quiet else False)
        progress.start()
        counter = asyncio.get_running_loop().run_in_executor(None, parts.source.count)
        counter.add_done_callback(lambda f: setattr(st, "total", f.result()) if not f.exception() else None)
        ticker = asyncio.create_task(self._tick(writer, progress))
        primers: list[asyncio.Future] = [asyncio.ensure_future(p()) for p in parts.primers]
        # A job that began starting its engine counts from then: elapsed holds the whole start.
        st.started = began if parts.start_engine is not None else time.monotonic()
        try:
            await self._produce(done, writer)
            while self._pending:
                await asyncio.gather(*list(self._pending), return_exceptions=True)
            if parts.caches.audit is not None and not self._stop:
                await self._run_audit(parts.caches.audit)
        except asyncio.CancelledError:  # the caller's Ctrl-C (``asyncio.run``): unfinished, resumable
            st.interrupted = True
            raise
        finally:
            ticker.cancel()
            for p in primers:
                p.cancel()
            await self._end_pending()
            writer.close()
            st.finished = time.monotonic()
            st.retries.update(self.executor.retries)
            if self.executor.gate is not None:
                st.outages = self.executor.gate.summary()
            st.sample(parts.limiter.snapshot())
            st.concurrency = parts.limiter.summary()
            affinity = getattr(getattr(parts.backend, "balancer", None), "affinity", None)
            if affinity is not None:
                st.routing = affinity.summary()
            progress.stop()
            await self._close()  # the backend's close waits for an engine start still running
            st.engine_start_s = parts.backend.engine_start_s
            st.engine_start_overlap_s = parts.backend.engine_start_overlap_s
            st.engine_max_num_seqs = parts.backend.engine_max_num_seqs
            if writer.error is not None:
                st.interrupted = True
                st.done -= writer.dropped
            parts.journal.write_state(self._input, finished=not (st.interrupted or st.stopped_by_outage), argv=o.argv)
        if writer.error is not None:
            e = writer.error
            raise OutputError(e.errno, f"cannot write {writer.error_path}: {e.strerror or e}. The complete "
                              "lines already in it are kept; fix it (free space, another -o) and resume "
                              f"with:\n  {self.resume_command()}")
        if st.stopped_by_outage:
            self.messages.append(f"stopped by an outage ({st.outage_stop}, past --outage-timeout "
                                 f"{o.outage_timeout:g} s): {st.done + st.skipped:,} tasks are in "
                                 f"{parts.journal.output}; "
                                 f"the others were not run. Resume once the endpoint is back with:\n"
                                 f"  {self.resume_command()}")
        elif st.interrupted:
            self.messages.append(f"interrupted: {st.done + st.skipped:,} tasks are in {parts.journal.output}. "
                                 f"Resume with:\n  {self.resume_command()}")
        return st

    async def _end_pending(self) -> None:
        """Cancel the tasks still running (the job itself was cancelled, or stops at once) and
        let them unwind before the writer closes: each ends unwritten, or with the answer it
        already had, never with a line its cancellation made up."""
        pending = list(self._pending)
        if pending:
            self._cancelled = True
        for t in pending:
            t.cancel()
        if pending:
            # A second cancellation of the job itself must not skip closing the journal.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait(pending, timeout=10)

    async def _run_audit(self, audit: SemanticAudit) -> None:
        """Re-ask the sampled semantic hits, bypassing both caches; the output file is not changed."""

        async def ask(item: AuditItem) -> None:
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
            await self.parts.backend.close()
        finally:
            try:
                for close in self.parts.closers:
                    await close()
            finally:
                self.parts.caches.close()

    async def _tick(self, writer: ResultWriter, progress: Progress) -> None:
        last_sample = 0.0
        while True:
            await asyncio.sleep(0.25)
            writer.tick()
            if writer.error is not None and not self._write_failed:
                self._stop_on_write_error()
            lim = self.parts.limiter.snapshot()
            paused = self._watch_outage()
            progress.update(f" {paused}" if paused else
                            " " + self.parts.limiter.describe() if self.opts.endpoints else "")
            now = time.monotonic()
            if now - last_sample >= 1.0:
                last_sample = now
                self.stats.sample(lim)

    # -- reading and admission ------------------------------------------------------------
    async def _produce(self, done: DoneSet, writer: ResultWriter) -> None:
        src = self.parts.source
        src = getattr(src, "source", src)  # a source wrapping the planned one (CountedSource)
        planned = isinstance(src, PlannedSource)
        if isinstance(src, PlannedSource):  # the pass over the whole file, off the event loop
            await asyncio.to_thread(src.prepare)
            self.stats.prefix_order = src.info.to_dict()
        order = WindowOrder(self.opts, planned)
        window: list[_Admitted] = []
        n = 0
        for item in self.parts.source:
            if self._stop:
                break
            n += 1
            if n % 64 == 0:
                await asyncio.sleep(0)  # let responses in while a fast reader runs ahead
            if not self._seen.add(item.custom_id):
                item = await self._refuse_repeat(item)
            if len(done) and item.custom_id in done:
                self.stats.skipped += 1
                continue
            slot = await self._slots.take()
            if slot is None:  # the job stops
                break
            out = _TaskWriter(writer, self._seq, slot, self._written, self._cancelling, self._tail(item))
            self._seq += 1
            admitted = self._admit(item, out)
            if admitted is None:
                continue
            if order.wants(admitted.task):
                window.append(admitted)
                if len(window) >= order.size:
                    self._dispatch_window(window)
                    window = []
                continue
            self._dispatch(admitted)
        if window:
            self._dispatch_window(window)

    def _tail(self, item: Task | BadLine) -> bytes:
        """What the task's line carries besides its answer: the task's ``metadata`` and, when
        ``--retry-errors`` answers it again, the ``id`` of the error line it supersedes."""
        return line_tail(item.metadata, self.parts.journal.supersedes(item.custom_id))

    async def _refuse_repeat(self, item: Task | BadLine) -> BadLine:
        """A custom_id seen on an earlier line becomes an error under an id of its own.

        The custom_id is the journal's key, so a repeat could not be resumed safely; it is
        refused (as OpenAI's Batch API refuses it) under ``<id>#line-<n>`` (``tasks.repeat_id``),
        so a resumed run finds that error line done too.  That name must be one no line of
        the input uses, later lines included: a made-up id equal to a user's would write two
        lines under one id and hide the user's task from a resume.  So the first repeat reads
        every id of the input once (on a thread; 8 bytes an id), which an input without
        repeats never pays."""
        if self._all_ids is None:
            # A copy: a source that counts what it yields (a Ray shard) counts the job's pass only.
            self._all_ids = await asyncio.to_thread(_every_id, copy.copy(self.parts.source))
        name = repeat_id(item.custom_id, item.line_no, self._take_name)
        return BadLine(item.line_no, name, "custom_id", repeat_reason(item.custom_id), item.metadata)

    def _take_name(self, name: str) -> bool:
        """Reserve a made-up id: free when no line of the input and no earlier repeat uses it."""
        if self._all_ids is not None and name in self._all_ids:
            return False
        return self._made_up.add(name)

    def _admit(self, item: Task | BadLine, out: _TaskWriter) -> _Admitted | None:
        """The task to run, or None when its line is written already: a bad line, or a request
        the backend's check refuses (a prompt past the engine's context)."""
        if isinstance(item, BadLine):
            self._invalid(out, item.custom_id, item.message, item.line_no, item.field)
            return None
        checked = self.parts.check(item.request) if self.parts.check is not None else None
        if isinstance(checked, Refused):
            msg = f"line {item.line_no}: field '{checked.field}': {checked.reason}"
            self._invalid(out, item.custom_id, msg, item.line_no, checked.field)
            return None
        return _Admitted(out, item, checked)

    def _invalid(self, out: _TaskWriter, custom_id: str, msg: str, line_no: int, field: str) -> None:
        self.stats.bad_lines += 1
        self.stats.errors[ErrorKind.INVALID_INPUT] += 1
        out.emit(error_line(custom_id, ErrorKind.INVALID_INPUT, msg, line_no, field), True)

    def _written(self) -> None:
        self.stats.done += 1

    def _dispatch_window(self, window: list[_Admitted]) -> None:
        # Stable sort by the start of the prompt: tasks sharing a prefix reach the server
        # together, while its prefix cache still holds the shared blocks.
        window.sort(key=lambda a: prefix_key(a.task))
        for admitted in window:
            self._dispatch(admitted)

    def _dispatch(self, admitted: _Admitted) -> None:
        t = asyncio.create_task(self._handle(admitted.out, admitted.task, admitted.prepared))
        self._pending.add(t)
        t.add_done_callback(self._pending.discard)

    # -- one task -------------------------------------------------------------------------
    async def _handle(self, out: _TaskWriter, task: Task, prepared: object) -> None:
        try:
            await self._run_task(out, task, prepared)
        except asyncio.CancelledError:
            out.drop()  # cancelled before its line: it runs on resume
            raise
        except Exception as e:  # one task's failure must not hang or end the job
            # Without this line the task's slot would never be freed (the job would stall
            # once max_pending tasks had failed) and the task would be lost, not recorded.
            if self._cancelled:  # the cancellation's doing (see ``_TaskWriter``): not an outcome
                out.drop()
                raise asyncio.CancelledError from e
            if out.used:  # its line is written already: the failure came after (a stats update)
                self.messages.append(f"line {task.line_no}: internal error after writing its result: {e!r}")
                return
            self.stats.errors[ErrorKind.INTERNAL] += 1
            msg = f"line {task.line_no}: internal error in carpool ({type(e).__name__}: {e}); please report it"
            out.emit(error_line(task.request.custom_id, ErrorKind.INTERNAL, msg, task.line_no), True)
        finally:
            out.drop()  # a task that ended any other way without a line frees its slot (a no-op after one)

    async def _run_task(self, out: _TaskWriter, task: Task, prepared: object) -> None:
        """Answer the task (``prepared``: what the backend's admission check made of it, for
        its first attempt), count what was sent, write its line."""
        send = functools.partial(self.executor.execute, task.request, prepared=prepared)
        try:
            answer = await self.answers.answer(task.request, send)
        except OutageTimeout:
            self._stop_for_outage()
            out.drop()  # not written: it runs on resume
            return
        except Stopped:
            out.drop()  # not written: it is done on resume
            return
        if answer.reused is None:
            self.stats.sent += 1
            self._account(answer.result, task.request.kind)
        self._write_answer(out, task, answer)

    def _account(self, res: CallResult, kind: str) -> None:
        st = self.stats
        if res.ok:
            st.prompt_tokens += res.prompt_tokens
            st.completion_tokens += res.completion_tokens
            st.cached_prompt_tokens += res.cached_tokens
            st.prompt_reuse.add(res.endpoint, res.prompt_tokens, res.cached_tokens, res.cached_reported, kind)
            st.ttft.add(res.ttft_s)
            st.tpot.add(res.tpot_s)
            st.e2e.add(res.e2e_s)

    def _write_answer(self, out: _TaskWriter, task: Task, answer: Answer) -> None:
        req, res = task.request, answer.result
        if res.ok:
            if answer.reused is None:
                self.stats.ok += 1
            structured = check_answer(req.body, res.body)
            self.stats.answers.add(req.custom_id, res.body, structured)
            out.emit(success_line(req.custom_id, res.status_code or 200, res.request_id, res.body,
                                  semantic=answer.semantic, structured=structured))
            return
        kind = res.error_kind or ErrorKind.SERVER_ERROR
        self.stats.errors[kind] += 1
        msg = f"line {task.line_no}: {res.error_message}" if res.error_message else f"line {task.line_no}: {kind}"
        # An OpenAI-style refusal names the field at fault in error.param: keep it.
        err = res.body.get("error") if isinstance(res.body, dict) else None
        param = err.get("param") if isinstance(err, dict) else None
        field = param if isinstance(param, str) and param else None
        out.emit(error_line(req.custom_id, kind, msg, task.line_no, field, res.status_code or None,
                            res.body, answer.attempts), True)


class _Admitted:
    """A task past admission: its writer, the task, and what the backend's check prepared of it."""

    __slots__ = ("out", "prepared", "task")

    def __init__(self, out: _TaskWriter, task: Task, prepared: object):
        self.out, self.task, self.prepared = out, task, prepared
