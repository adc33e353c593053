"""Running batches: validating -> in_progress -> finalizing -> completed, and how a restart resumes.

Each batch runs as one task on the server's loop.  Its answers go to its journal
(``batch_journal``): a request is answered exactly when its line is complete in one of the
two journal files.  Every line is handed to the OS as it is written (a kill -9 of the server
loses none) and fsync'd at most every second (a power cut loses at most that, to be redone).

A restart finds the batches whose stored status is not final and runs each on from where
its files say: a half-written last line is cut, the custom_ids of the complete lines are
skipped, the rest are sent.  No request is answered twice in the output, and none lost.
Finalizing publishes the journals as the batch's output and error files (hard links under
fixed ids, so running it again after a crash finds them published) and then records the
final status.

A batch never stops without saying so.  When the disk refuses a write (full, read-only,
failing) the batch keeps its status and counts, says why in ``errors`` and tries the step
again, every second at first and at most every ``MAX_RETRY_S``; once the disk takes writes
again it goes on from its journal by itself, and ``errors`` is cleared.  Past its window
with the disk still refusing, it ends ``failed``.  Anything else that goes wrong with a
batch ends it ``failed``, with the reason in ``errors``, instead of leaving it to look alive.

Online requests come first: batch requests take their sequences and KV tokens out of the
batch share of the engine (``batch_budget``), at most ``max_inflight`` of them are being
prepared or run at once (all batches together), and they carry a low engine priority
(``batch_requests``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import sqlite3
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from carpool.errors import NotAnswered
from carpool.journal.writer import error_line, success_line
from carpool.openai.surrogates import surrogate_error
from carpool.server.batch_budget import WorkBudget
from carpool.server.batch_disk import BatchDisk
from carpool.server.batch_input import ENDPOINTS, BatchLine, check_input, iter_requests, shown
from carpool.server.batch_journal import BatchJournal, count_answers, journal_paths, open_journal
from carpool.server.batch_object import UNFINISHED, Batch, BatchError, RequestCounts
from carpool.server.batch_requests import answer
from carpool.server.batch_store import BatchStore
from carpool.server.state import ServerState

log = logging.getLogger("carpool.server.batches")

_RETRY_S = 1.0  # pause before a pass over the requests the engine aborted, and a first retry
MAX_RETRY_S = 30.0  # longest pause between two tries of a step the disk refused
_SKIPPED_PER_YIELD = 512  # answered lines skipped (after a restart) between two looks at the loop
STALLED = "storage_unavailable"


@dataclass
class BatchLimits:
    """OpenAI's per-batch limits by default: 200 MB input files, 50,000 requests."""

    max_file_bytes: int = 200 * 1000 * 1000
    max_requests: int = 50_000
    max_inflight: int = 8  # batch requests prepared or running at once, all batches together


def _fixed_file_id(batch_id: str, which: str) -> str:
    return "file-" + hashlib.blake2b(f"{batch_id}/{which}".encode(), digest_size=12).hexdigest()


def visible(batch: Batch, owner: str | None) -> bool:
    """Whether ``owner`` may see ``batch`` (None: the server itself, which sees every batch)."""
    return owner is None or batch.owner in ("", owner)


class BatchExecutor:
    def __init__(self, state: ServerState, store: BatchStore, limits: BatchLimits, budget: WorkBudget,
                 disk: BatchDisk | None = None) -> None:
        self.state = state
        self.store = store
        self.limits = limits
        self.budget = budget
        self.disk = disk or BatchDisk()
        self._batches: dict[str, Batch] = {}  # the batches running now, as their live objects
        self._journals: dict[str, BatchJournal] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._stops: dict[str, asyncio.Event] = {}
        self._lines = asyncio.Semaphore(max(1, limits.max_inflight))
        self.inflight = 0
        # requests answered by this process, by how (``request_counts``' words): /metrics reads them
        self.answered = {"completed": 0, "failed": 0}

    # -- lifecycle

    def resume(self) -> None:
        """Run on every batch a previous server left unfinished, and remove the work directories
        a crash left behind (of a batch already final, or one whose creation it cut short)."""
        unfinished = self.store.unfinished_batches(UNFINISHED)
        keep = {b.id for b in unfinished}
        for work in self.store.work_dir.iterdir():
            if work.name not in keep:
                shutil.rmtree(work, ignore_errors=True)
        for batch in unfinished:
            log.info("resuming batch %s (%s)", batch.id, batch.status)
            self.launch(batch)

    def launch(self, batch: Batch) -> None:
        self._batches[batch.id] = batch
        self._stops[batch.id] = asyncio.Event()
        task = asyncio.create_task(self._run(batch), name=f"batch {batch.id}")
        self._tasks[batch.id] = task
        task.add_done_callback(functools.partial(self._forget, batch.id))

    def _forget(self, bid: str, task: asyncio.Task) -> None:
        self._tasks.pop(bid, None)
        self._batches.pop(bid, None)
        self._stops.pop(bid, None)
        self._journals.pop(bid, None)

    async def stop(self) -> None:
        """Server shutdown: stop every batch where it is (it resumes at the next start)."""
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- what the API asks

    def view(self, batch: Batch) -> dict:
        """The batch object as the API returns it: live counts while it runs."""
        live = self._batches.get(batch.id, batch)
        journal = self._journals.get(batch.id)
        return live.to_api(journal.counts if journal is not None else None)

    def pending(self) -> int:
        """Requests of the running batches not answered yet (a validating batch counts none)."""
        left = 0
        for bid, batch in list(self._batches.items()):
            journal = self._journals.get(bid)
            c = journal.counts if journal is not None else batch.request_counts
            left += max(0, c.total - c.completed - c.failed)
        return left

    def get(self, batch_id: str, owner: str | None) -> Batch | None:
        """The batch ``owner`` may see (None: any), live while it runs."""
        live = self._batches.get(batch_id)
        if live is not None:
            return live if visible(live, owner) else None
        return self.store.get_batch(batch_id, owner)

    def cancel(self, batch_id: str, owner: str | None) -> Batch | None:
        """Start cancelling; the answers so far are published when it stops. None: no such batch;
        a batch already final comes back as it is (the caller refuses it)."""
        batch = self.get(batch_id, owner)
        if batch is None or batch_id not in self._batches:
            return batch
        if batch.status in ("validating", "in_progress"):
            batch.enter("cancelling")
            self._save_quietly(batch)
            self._stops[batch_id].set()
        return batch

    # -- one batch

    def _save_quietly(self, batch: Batch) -> None:
        """Store the batch if the store takes it now; if not, the next step that stores it does."""
        try:
            self.store.save_batch(batch)
        except sqlite3.Error as e:
            log.warning("batch %s: its status is not stored yet (%s)", batch.id, e)

    def _enter(self, batch: Batch, status: str) -> None:
        batch.enter(status)
        self.store.save_batch(batch)

    async def _run(self, batch: Batch) -> None:
        wait = _RETRY_S
        while not batch.final:
            try:
                await self._step(batch)
                wait = _RETRY_S
            except (OSError, sqlite3.Error) as e:  # the disk: full, read-only, failing
                if time.time() >= batch.expires_at:
                    self._give_up(batch, "batch_expired", f"the window ran out while the server could not "
                                  f"write this batch's files ({_reason(e)})")
                    return
                self._stall(batch, e, wait)
                await self._pause(batch, wait)
                wait = min(2 * wait, MAX_RETRY_S)
            except Exception as e:  # a batch that cannot go on says so
                log.exception("batch %s failed", batch.id)
                self._give_up(batch, "server_error", f"the server failed on this batch ({e!r}); see its log")
                return

    async def _step(self, batch: Batch) -> None:
        if batch.status == "validating":
            await self._validate(batch)
        elif batch.status == "in_progress":
            await self._execute(batch)
        elif batch.status in ("finalizing", "cancelling"):
            await self._finalize(batch)

    def _stall(self, batch: Batch, e: BaseException, wait: float) -> None:
        message = (f"The server cannot write this batch's files ({_reason(e)}); it goes on by itself once "
                   f"writes succeed again (next try in {wait:.0f} s).")
        log.warning("batch %s: %s", batch.id, message)
        batch.errors = [BatchError(STALLED, message)]
        self._save_quietly(batch)

    def _unstall(self, batch: Batch) -> None:
        if batch.errors and batch.errors[0].code == STALLED:
            batch.errors = None
            self._save_quietly(batch)

    async def _pause(self, batch: Batch, wait: float) -> None:
        """``wait`` seconds, or less when the batch is cancelled meanwhile."""
        stop = self._stops[batch.id]
        if stop.is_set():
            await asyncio.sleep(wait)
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), wait)

    def _give_up(self, batch: Batch, code: str, message: str) -> None:
        batch.errors = [BatchError(code, message)]
        batch.enter("failed")
        self._save_quietly(batch)

    async def _validate(self, batch: Batch) -> None:
        work = self.store.batch_work_dir(batch.id)
        check = await asyncio.to_thread(check_input, journal_paths(work)[0], batch.endpoint,
                                        self.limits.max_requests)
        if batch.status != "validating":  # cancelled meanwhile
            return
        names = self.state.embedding_names if ENDPOINTS[batch.endpoint] == "embedding" else self.state.model_names
        if not check.errors and check.model not in names:
            check.add("model_not_found", f"The model {shown(check.model)} is not served here; served: "
                      f"{', '.join(names) or 'none'}.", None, "body.model")
        batch.request_counts = RequestCounts(check.total)
        batch.model = check.model
        if check.errors:
            batch.errors = check.errors
            self._enter(batch, "failed")
            shutil.rmtree(work, ignore_errors=True)
            return
        self._enter(batch, "in_progress")

    async def _execute(self, batch: Batch) -> None:
        work = self.store.batch_work_dir(batch.id)
        journal = await asyncio.to_thread(open_journal, work, self.disk, batch.request_counts.total)
        self._journals[batch.id] = journal
        stop = self._stops[batch.id]
        try:
            while True:
                unanswered = await self._pass(batch, journal, stop)
                if stop.is_set() or not unanswered or self._expired(batch):
                    break
                await asyncio.sleep(_RETRY_S)  # the engine aborted some: send them again
            if self._expired(batch) and not stop.is_set():
                expired = await asyncio.to_thread(self._write_expired, batch, journal)
                self.answered["failed"] += expired  # after the await: other batches count meanwhile
                batch.ending = "expired"
        finally:
            self._journals.pop(batch.id, None)
            batch.request_counts = replace(journal.counts)  # what a stalled batch shows meanwhile
            closing = await asyncio.to_thread(_close, journal)
        if closing is not None:
            raise closing
        self._unstall(batch)
        if batch.status == "in_progress":
            self._enter(batch, "finalizing")

    def _expired(self, batch: Batch) -> bool:
        return time.time() >= batch.expires_at

    def _unanswered(self, batch: Batch, journal: BatchJournal) -> Iterator[BatchLine | None]:
        """The requests not answered yet, and None now and then while skipping answered ones
        (after a restart), so the caller can let the loop serve."""
        skipped = 0
        for line in iter_requests(journal_paths(self.store.batch_work_dir(batch.id))[0]):
            if journal.has(line.custom_id):
                skipped += 1
                if skipped % _SKIPPED_PER_YIELD == 0:
                    yield None
                continue
            yield line

    async def _pass(self, batch: Batch, journal: BatchJournal, stop: asyncio.Event) -> int:
        """Send every request not answered yet; returns how many the engine aborted.  Raises the
        disk's ``OSError`` when a line cannot be written (the requests in flight are aborted)."""
        kind = ENDPOINTS[batch.endpoint]
        lines = self._unanswered(batch, journal)
        aborted = [0]

        async def worker() -> None:
            for line in lines:  # shared by the workers: each takes the next line
                if line is None:
                    await asyncio.sleep(0)
                elif stop.is_set() or self._expired(batch):
                    return
                else:
                    await self._one(batch, kind, line, journal, aborted)

        workers = {asyncio.create_task(worker()) for _ in range(max(1, self.limits.max_inflight))}
        await _until_done_or(workers, stop)
        return aborted[0]

    async def _one(self, batch: Batch, kind: str, line: BatchLine, journal: BatchJournal,
                   aborted: list[int]) -> None:
        async with self._lines:
            await self.budget.online_first()
            try:
                if line.problem is not None:  # not Unicode text: the tokenizer and the journal cannot take it
                    status, body = 400, surrogate_error(line.problem.removeprefix("body.")).body()
                else:
                    status, body = await answer(self.state, kind, line.body, self._hold)
            except NotAnswered:
                aborted[0] += 1
                return
        rid = "req_" + os.urandom(12).hex()
        journal.write(line.custom_id, success_line(line.custom_id, status, rid, body), ok=status == 200)
        self.answered["completed" if status == 200 else "failed"] += 1
        if batch.errors:
            self._unstall(batch)

    @contextlib.asynccontextmanager
    async def _hold(self, seats: int, kv_tokens: int) -> AsyncIterator[None]:
        """The batch share one request takes while it is in the engine (counted in ``inflight``)."""
        async with self.budget.hold(seats, kv_tokens):
            self.inflight += 1
            try:
                yield
            finally:
                self.inflight -= 1

    def _write_expired(self, batch: Batch, journal: BatchJournal) -> int:
        """Past the completion window: every request not answered gets OpenAI's expiry error line;
        how many did (it runs off the loop, so the loop adds them to ``answered``)."""
        expired = 0
        for line in iter_requests(journal_paths(self.store.batch_work_dir(batch.id))[0]):
            if not journal.has(line.custom_id):
                journal.write(line.custom_id, error_line(line.custom_id, "batch_expired", "This request could not "
                                                         "be executed before the completion window expired."), ok=False)
                expired += 1
        return expired

    async def _finalize(self, batch: Batch) -> None:
        work = self.store.batch_work_dir(batch.id)
        _, out_p, err_p = journal_paths(work)
        counts = await asyncio.to_thread(count_answers, work)
        batch.request_counts = RequestCounts(batch.request_counts.total, *counts)
        batch.usage = await asyncio.to_thread(_usage, out_p)
        for path, which in ((out_p, "output"), (err_p, "error")):
            fid = _fixed_file_id(batch.id, f"{which}_file_id")
            if self.store.get_file(fid) is None and path.exists() and path.stat().st_size > 0:
                await self._publish(batch, path, which, fid)
            if self.store.get_file(fid) is not None:
                setattr(batch, f"{which}_file_id", fid)
        self._unstall(batch)
        self._enter(batch, "cancelled" if batch.status == "cancelling" else batch.ending)
        shutil.rmtree(work, ignore_errors=True)

    async def _publish(self, batch: Batch, path: Path, which: str, fid: str) -> None:
        staged = self.store.upload_path()
        try:
            await asyncio.to_thread(self.disk.copy, path, staged)
            # on the loop: SQLite lives there
            self.store.add_file(staged, f"batch_{batch.id}_{which}.jsonl", "batch_output", batch.owner, fid)
        finally:
            staged.unlink(missing_ok=True)  # moved under its id, or a try the disk refused


def _reason(e: BaseException) -> str:
    return e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__


def _close(journal: BatchJournal) -> OSError | None:
    """Close the journal; the disk's error if it refused the last lines (they are redone)."""
    try:
        journal.close()
    except OSError as e:
        return e
    return None


async def _until_done_or(tasks: set[asyncio.Task], stop: asyncio.Event) -> None:
    """Wait for ``tasks`` to finish, or for ``stop`` (a cancel) if it comes first; the first
    error of one of them is raised.  The tasks still running are cancelled either way."""
    stopped = asyncio.create_task(stop.wait())
    try:
        pending = set(tasks)
        while pending and not stop.is_set():
            done, pending = await asyncio.wait(pending | {stopped}, return_when=asyncio.FIRST_COMPLETED)
            pending.discard(stopped)
            for t in done:
                if t is not stopped and not t.cancelled() and t.exception() is not None:
                    raise t.exception()
    finally:
        stopped.cancel()
        for t in tasks:
            t.cancel()  # cancelled, failed or shutting down: the engine requests are aborted
        await asyncio.gather(*tasks, return_exceptions=True)


def _usage(out_p: Path) -> dict | None:
    """Token usage of the successful answers, in the shape of OpenAI's batch ``usage``."""
    if not out_p.exists():
        return None
    prompt = completion = cached = 0
    with open(out_p, "rb") as f:
        for raw in f:
            try:
                body = json.loads(raw)["response"]["body"]
                u = body.get("usage") or {}
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
            prompt += int(u.get("prompt_tokens") or 0)
            completion += int(u.get("completion_tokens") or 0)
            cached += int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}
