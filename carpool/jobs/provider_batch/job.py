"""``BatchJob``: one ``carpool run`` through a provider's batch API.

Rounds, until no batch is left running: read the tasks, leave out those the output holds
(the journal's done set), those a running batch holds and those left for the online
path; cut the rest into provider batches at the limits and submit each (``state`` is
written before and after each create); then poll the running batches, backing off while
nothing changes, and write the results of each ended batch into the output.  A request
that came back unanswered (expired, canceled, a transient error) is submitted again in
the next round, at most ``max_attempts`` times in all, then written as an error line.

Each task gets exactly one line: results are written only for tasks neither done before
nor written this run, and a batch's entry becomes ``collected`` only after its lines are
fsync'd.  A kill between the two re-reads that batch's results on resume and writes only
what is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from carpool.errors import BatchApiError, MaybeCreated, OutputError, StartRefused, Untranslatable
from carpool.jobs.input.readers import Reader, TaskSource
from carpool.jobs.input.tasks import BadLine, Task
from carpool.jobs.options import BatchApiOptions, RunOptions
from carpool.jobs.parts import job_defaults, make_journal
from carpool.jobs.provider_batch.ids import RepeatNames, anthropic_id
from carpool.jobs.provider_batch.limits import Chunk
from carpool.jobs.provider_batch.provider import Provider, RequestResult, Status
from carpool.jobs.provider_batch.state import COLLECTED, RUNNING, BatchState, Entry
from carpool.jobs.summary.stats import JobStats
from carpool.journal.done import DoneSet, SeenIds, id_hash
from carpool.journal.journal import Journal
from carpool.journal.writer import ResultWriter, error_line, line_tail, success_line, with_tail

REPORT_EVERY_S = 30.0


@dataclass
class _Held:
    """What a batch holds of one task: enough to write its line without the input file."""

    custom_id: str
    line_no: int
    metadata: dict | None


class BatchJob:
    def __init__(self, opts: RunOptions, batch: BatchApiOptions, provider: Provider,
                 say: Callable[[str], None] | None = None, source: TaskSource | None = None):
        self.opts, self.batch, self.provider = opts, batch, provider
        self.say_to = say
        self.source = source
        self.stats = JobStats()
        self.stats.backend = f"batch {provider.name} {batch.url}"
        self.messages: list[str] = []
        self.journal: Journal = make_journal(opts)
        self.state = BatchState(self.journal.output)
        self.done = DoneSet()
        self.written: set[int] = set()  # hashes of the ids written this run
        self.requeued = True  # a round must read the tasks (the first one always does)
        self._stop = asyncio.Event()
        self._said: dict[str, tuple[str, float]] = {}  # local id -> (status line, when) last said
        self._down_since: float | None = None  # when polls began to go unanswered

    def say(self, msg: str) -> None:
        if self.say_to is not None and not self.opts.quiet:
            self.say_to(msg)

    def request_stop(self) -> None:
        """Ctrl-C / SIGTERM: stop polling; submitted batches are picked up by the same command."""
        self.stats.interrupted = True
        self._stop.set()

    # -- the run ------------------------------------------------------------------------------
    async def run(self) -> JobStats:
        o = self.opts
        self.done, notes = self.journal.open(o.input or None, fresh=o.fresh, argv=o.argv)
        self.messages += notes
        self.stats.failed_before = self.journal.failed_before
        if o.fresh:
            self.state.reset()
        self.state.load()
        self.state.provider = self.provider.name
        writer = self.journal.open_writer(ordered=False)
        self.stats.started = time.monotonic()
        try:
            await self._rounds(writer)
        except BatchApiError as e:
            if e.status in (401, 403) and not self.state.entries:  # nothing submitted: a refused start
                raise StartRefused(f"{e}; check the key (--api-key, or the provider's variable: "
                                   "OPENAI_API_KEY, AZURE_OPENAI_API_KEY, ANTHROPIC_API_KEY)") from None
            self.stats.stopped_by_outage = True
            self.stats.outage_stop = str(e)
            self.messages.append(f"stopped: {e}. Submitted batches are kept in {self.state.dir}; the same "
                                 "command picks them up.")
        finally:
            writer.close()
            await self.provider.close()
            self.stats.finished = time.monotonic()
            finished = not (self.stats.interrupted or self.stats.stopped_by_outage)
            self.journal.write_state(o.input or None, finished=finished, argv=o.argv)
        if writer.error is not None:
            raise OutputError(writer.error.errno, f"cannot write {writer.error_path}: {writer.error}")
        if not (self.stats.interrupted or self.stats.stopped_by_outage or self.state.online):
            self.state.remove()
        elif self.stats.interrupted:
            self.messages.append(f"interrupted: the submitted batches run on at the provider; the same command "
                                 f"collects them ({self.state.dir})")
        return self.stats

    async def _rounds(self, writer: ResultWriter) -> None:
        await self._recover_submitting()
        while not self._stop.is_set():
            if self.requeued:
                self.requeued = False
                await self._submit_new(writer)
            if not self.state.active():
                return
            await self._wait_and_collect(writer)

    async def _recover_submitting(self) -> None:
        """Entries a killed run left ``submitting``: the create may have happened; ask."""
        for e in [e for e in self.state.entries if e.batch_id is None]:
            found = await self.provider.find(e.local_id, e.n, e.prepared_at, self.state.known_batch_ids())
            if found is None:
                self.say(f"batch {e.local_id}: was never created; its {e.n:,} tasks are submitted again")
                self.state.forget(e)
                continue
            e.batch_id, e.status, e.adopted = found, RUNNING, True
            self.state.save()
            self.say(f"batch {e.local_id}: found {found}, created before the last run stopped")

    # -- submitting -----------------------------------------------------------------------------
    def _held_hashes(self) -> set[int]:
        held: set[int] = set()
        for e in self.state.active():
            held.update(id_hash(row[1]) for row in self.state.read_ids(e.local_id))
        return held

    def _is_done(self, custom_id: str) -> bool:
        return custom_id in self.done or id_hash(custom_id) in self.written

    async def _submit_new(self, writer: ResultWriter) -> None:
        held = self._held_hashes()
        chunks: dict[str, Chunk] = {}
        seen = SeenIds()
        source = self.source if self.source is not None else \
            Reader(self.opts.input, self.opts.fmt, self.opts.template, job_defaults(self.opts))
        repeats = RepeatNames(copy.copy(source))
        counted = self.stats.total is None
        total = 0
        for item in source:
            total += 1
            if not seen.add(item.custom_id):
                item = BadLine(item.line_no, repeats.name(item.custom_id, item.line_no), "custom_id",
                               f"duplicate custom_id {item.custom_id!r}: it was used on an earlier line; "
                               "custom_ids must be unique in a file")
            if self._is_done(item.custom_id):
                if counted and item.custom_id in self.done:
                    self.stats.skipped += 1
                continue
            if id_hash(item.custom_id) in held or item.custom_id in self.state.online:
                continue
            if isinstance(item, BadLine):
                self._write_error(writer, item.custom_id, "invalid_input", item.message, item.line_no, item.metadata,
                                  field=item.field)
                continue
            await self._add(writer, chunks, item)
            if self._stop.is_set():
                return
        if counted:
            self.stats.total = total
        for chunk in chunks.values():
            if chunk.lines:
                await self._submit(chunk)

    async def _add(self, writer: ResultWriter, chunks: dict[str, Chunk], task: Task) -> None:
        group = self.provider.group(task)
        chunk = chunks.get(group) or Chunk(group, self.provider.limits)
        chunks[group] = chunk
        pid = anthropic_id(task.custom_id, chunk.taken) if self.provider.ids_must_fit else task.custom_id
        try:
            line = self.provider.request_line(pid, task)
        except Untranslatable as e:
            chunk.taken.discard(pid)
            self._write_error(writer, task.custom_id, "invalid_input", f"line {task.line_no}: field "
                              f"'{e.field}': {e}", task.line_no, task.metadata, field=e.field)
            return
        if not Chunk(group, self.provider.limits).fits(line):
            self._write_error(writer, task.custom_id, "invalid_input", f"line {task.line_no}: the request "
                              f"({len(line):,} bytes) is larger than one {self.provider.name} batch may be",
                              task.line_no, task.metadata)
            return
        if not chunk.fits(line):
            await self._submit(chunk)
            chunk = chunks[group] = Chunk(group, self.provider.limits)
            pid = anthropic_id(task.custom_id, chunk.taken) if self.provider.ids_must_fit else task.custom_id
            line = self.provider.request_line(pid, task)
        chunk.add(line, [pid, task.custom_id, task.line_no, task.metadata])

    async def _submit(self, chunk: Chunk) -> None:
        """Submit one chunk; the state is written before the create and after it."""
        entry = Entry("cpb_" + os.urandom(10).hex(), chunk.group, len(chunk.lines))
        self.state.write_ids(entry.local_id, chunk.held)
        self.state.entries.append(entry)
        self.state.save()

        def uploaded(file_id: str) -> None:
            entry.file_id = file_id
            self.state.save()

        for _ in range(3):
            try:
                entry.batch_id = await self.provider.submit(entry.local_id, chunk.lines, uploaded)
                break
            except MaybeCreated as e:
                self.say(f"batch {entry.local_id}: {e}; looking it up before creating it again")
                entry.batch_id = await self.provider.find(entry.local_id, entry.n, entry.prepared_at,
                                                          self.state.known_batch_ids())
                if entry.batch_id is not None:
                    break
            except BatchApiError:  # refused for certain: no batch was made
                self.state.forget(entry)
                raise
        if entry.batch_id is None:
            raise BatchApiError(f"batch {entry.local_id}: the provider did not create it after 3 tries")
        entry.status = RUNNING
        self.state.save()
        self.stats.sent += entry.n
        chunk.lines.clear()
        self.say(f"batch {entry.local_id}: submitted {entry.n:,} requests as {entry.batch_id}")

    # -- polling and results ----------------------------------------------------------------------
    async def _wait_and_collect(self, writer: ResultWriter) -> None:
        """Poll the running batches until at least one ended (then collect it), or a stop.  The
        wait grows 1.5x while no batch changes its status, and starts over when one does."""
        delay = self.batch.poll_s
        while not self._stop.is_set():
            active = [e for e in self.state.active() if e.batch_id]
            statuses = await self._poll(active)
            if statuses is None:  # the provider does not answer: wait as if nothing changed
                statuses = []
                active = []
            changed = ended = False
            for e, st in zip(active, statuses, strict=True):
                if st.state != e.state:
                    e.state, changed = st.state, True
                self._report(e, st)
                if st.ended:
                    await self._collect(writer, e, st)
                    ended = True
            if changed:
                self.state.save()
            if ended:
                return
            delay = self.batch.poll_s if changed else min(delay * 1.5, self.batch.max_poll_s)
            with contextlib.suppress(asyncio.TimeoutError):  # the wait ends early on a stop
                await asyncio.wait_for(self._stop.wait(), delay)

    async def _poll(self, active: list[Entry]) -> list[Status] | None:
        """The batches' statuses; None while the provider is unreachable (the batches run on there),
        until it has been so for ``--outage-timeout``, then the ``BatchApiError`` stops the job."""
        try:
            statuses = await asyncio.gather(*(self.provider.status(str(e.batch_id)) for e in active))
        except BatchApiError as e:
            if 400 <= e.status < 500 and e.status != 429:
                raise
            now = time.monotonic()
            if self._down_since is None:
                self._down_since = now
                self.say(f"{e}; polling on (gives up after --outage-timeout {self.opts.outage_timeout:g} s)")
            if now - self._down_since >= self.opts.outage_timeout:
                raise
            return None
        self._down_since = None
        return list(statuses)

    def _report(self, e: Entry, st: Status) -> None:
        """A batch's status line: when its status changes, else when its counts moved and the
        last line about it is ``REPORT_EVERY_S`` old (a long batch shows it moves, without a
        line every poll)."""
        text = st.describe()
        last_text, last_t = self._said.get(e.local_id, ("", 0.0))
        now = time.monotonic()
        if text == last_text or (st.state == last_text.split(" ", 1)[0] and now - last_t < REPORT_EVERY_S):
            return
        self._said[e.local_id] = (text, now)
        written = self.stats.done + self.stats.skipped
        total = f" of {self.stats.total:,}" if self.stats.total is not None else ""
        self.say(f"batch {e.local_id} ({e.batch_id}, {e.n:,} requests): {text}; {written:,}{total} tasks written")

    async def _collect(self, writer: ResultWriter, e: Entry, st: Status) -> None:
        held = {row[0]: _Held(row[1], int(row[2]), row[3]) for row in self.state.read_ids(e.local_id)}
        outcomes: Iterable[RequestResult] = []
        if st.state != "failed":
            outcomes = await self.provider.results(st, self.state.dir)
        if e.adopted:  # found after a lost create: checked whole before any line is written
            outcomes = list(outcomes)
            strangers = [o.pid for o in outcomes if o.pid not in held]
            if strangers:
                self.say(f"batch {e.local_id}: {e.batch_id} holds other ids ({strangers[0]!r}); it is not this "
                         "job's, its tasks are submitted again")
                outcomes, held = [], {}
                self.requeued = True
        answered: set[str] = set()
        for o in outcomes:
            h = held.get(o.pid)
            if h is None or o.pid in answered:
                continue
            answered.add(o.pid)
            self._write_outcome(writer, h, o)
        for pid, h in held.items():
            if pid not in answered:
                failed = st.state == "failed"
                why = f"the batch failed: {st.detail}" if failed else "the batch ended without its result"
                self._write_outcome(writer, h, RequestResult(pid, "error" if failed else "retry", 0, None, "",
                                                       "batch_failed" if failed else "batch_missing", why))
        self._sync(writer)
        e.status = COLLECTED
        self.state.save()
        for path in self.state.dir.glob(f"{st.batch_id}.*"):  # the downloaded results
            path.unlink(missing_ok=True)

    def _sync(self, writer: ResultWriter) -> None:
        for f in (writer.output, writer.errors):
            if f is not None and writer.error is None:
                try:
                    f.flush(fsync=True)
                except OSError as err:
                    writer.error, writer.error_path = err, str(f.path)
        if writer.error is not None:
            raise OutputError(writer.error.errno, f"cannot write {writer.error_path}: {writer.error.strerror}")

    def _write_outcome(self, writer: ResultWriter, h: _Held, o: RequestResult) -> None:
        if self._is_done(h.custom_id):
            return
        if o.kind == "ok":
            self._account(o.body)
            self._emit(writer, success_line(h.custom_id, o.status_code, o.request_id, o.body), h, False)
            return
        tries = self.state.attempts.get(h.custom_id, 0) + 1
        if o.kind == "retry":
            self.state.attempts[h.custom_id] = tries
            if self.batch.online_fallback:
                self.state.online.add(h.custom_id)
                return
            if tries < self.batch.max_attempts:
                self.requeued = True
                return
        self._write_error(writer, h.custom_id, o.code or "batch_error", f"line {h.line_no}: {o.message}", h.line_no,
                          h.metadata, status=o.status_code or None, body=o.body, attempts=tries)

    def _write_error(self, writer: ResultWriter, custom_id: str, code: str, message: str, line_no: int,
                     metadata: dict | None, *, field: str | None = None, status: int | None = None,
                     body: dict | None = None, attempts: int | None = None) -> None:
        self.stats.errors[code] += 1
        if code == "invalid_input":
            self.stats.bad_lines += 1
        line = error_line(custom_id, code, message, line_no, field, status, body, attempts)
        self._emit(writer, line, _Held(custom_id, line_no, metadata), True)

    def _emit(self, writer: ResultWriter, line: bytes, h: _Held, is_error: bool) -> None:
        self.written.add(id_hash(h.custom_id))
        self.stats.done += 1
        self.stats.ok += not is_error
        writer.emit(0, with_tail(line, line_tail(h.metadata)), is_error)

    def _account(self, body: dict | None) -> None:
        usage = (body or {}).get("usage") or {}
        self.stats.prompt_tokens += int(usage.get("prompt_tokens") or 0)
        self.stats.completion_tokens += int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        self.stats.cached_prompt_tokens += int(details.get("cached_tokens") or 0)

