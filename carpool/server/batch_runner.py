"""Running batches: validating -> in_progress -> finalizing -> completed, and how a restart resumes.

Each batch runs as one task on the server's loop.  Its answers are appended to two journal
files in its work directory (``output.jsonl`` for 200s, ``errors.jsonl`` for the rest), in
the OpenAI batch output line shape, with carpool's crash-safe journal rules
(``carpool.journal``): a request is answered exactly when its line is complete in one
of them.  Every line is handed to the OS as it is written (a kill -9 of the server loses
none) and fsync'd at most every second (a power cut loses at most that, to be redone).

A restart finds the batches whose stored status is not final and runs each on from where
its files say: a half-written last line is cut, the custom_ids of the complete lines are
skipped, the rest are sent.  No request is answered twice in the output, and none lost.
Finalizing publishes the journals as the batch's output and error files (hard links under
fixed ids, so running it again after a crash finds them published) and then records the
final status.

Online requests come first: at most ``max_inflight`` batch requests are in the engine at
once (all batches together), a new one is held back while an online request waits for its
first token, and batch requests carry a low engine priority (``batch_requests``).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from carpool.journal.done import DoneSet
from carpool.journal.recovery import recover_file
from carpool.journal.writer import Appender, error_line, success_line
from carpool.server.batch_input import ENDPOINTS, BatchLine, check_input, iter_requests
from carpool.server.batch_requests import NotAnswered, answer
from carpool.server.batch_store import BatchStore
from carpool.server.state import ServerState

log = logging.getLogger("carpool.server.batches")

FINAL = ("failed", "completed", "expired", "cancelled")
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
_ONLINE_POLL_S = 0.005  # how often a held-back batch request looks at the waiting room again
_RETRY_S = 1.0  # pause before a pass over the requests the engine aborted


@dataclass
class BatchLimits:
    """OpenAI's per-batch limits by default: 200 MB input files, 50,000 requests."""

    max_file_bytes: int = 200 * 1000 * 1000
    max_requests: int = 50_000
    max_inflight: int = 8  # batch requests in the engine at once, all batches together


@dataclass
class _Journal:
    """A running batch's two journal files and the answers counted in them."""

    output: Appender
    errors: Appender
    done: DoneSet
    completed: int
    failed: int
    answered: set[str] = field(default_factory=set)  # ids answered since the journal was opened

    def has(self, custom_id: str) -> bool:
        return custom_id in self.answered or custom_id in self.done

    def close(self) -> None:
        for f in (self.output, self.errors):
            f.flush(fsync=True)
            f.close()


def _paths(work: Path) -> tuple[Path, Path, Path]:
    return work / "input.jsonl", work / "output.jsonl", work / "errors.jsonl"


def _open_journal(work: Path) -> _Journal:
    _, out_p, err_p = _paths(work)
    ok, _ = recover_file(out_p)
    bad, _ = recover_file(err_p)
    done = DoneSet(np.array(ok + bad, dtype=np.uint64))
    # flush_lines=1: every line reaches the OS as it is written, so a killed server loses none
    return _Journal(Appender(out_p, flush_lines=1), Appender(err_p, flush_lines=1), done, len(ok), len(bad))


def _fixed_file_id(batch_id: str, which: str) -> str:
    return "file-" + hashlib.blake2b(f"{batch_id}/{which}".encode(), digest_size=12).hexdigest()


class BatchRunner:
    def __init__(self, state: ServerState, store: BatchStore, limits: BatchLimits) -> None:
        self.state = state
        self.store = store
        self.limits = limits
        self._docs: dict[str, dict] = {}  # the batches running now, as their live objects
        self._journals: dict[str, _Journal] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._stops: dict[str, asyncio.Event] = {}
        self._slots = asyncio.Semaphore(max(1, limits.max_inflight))
        self.inflight = 0
        # requests answered by this process, by how (``request_counts``' words): /metrics reads them
        self.answered = {"completed": 0, "failed": 0}

    # -- lifecycle

    def resume(self) -> None:
        """Run on every batch a previous server left unfinished, and remove the work directories
        a crash left behind (of a batch already final, or one whose creation it cut short)."""
        unfinished = self.store.unfinished_batches(UNFINISHED)
        keep = {doc["id"] for doc in unfinished}
        for work in self.store.work_dir.iterdir():
            if work.name not in keep:
                shutil.rmtree(work, ignore_errors=True)
        for doc in unfinished:
            log.info("resuming batch %s (%s)", doc["id"], doc["status"])
            self.launch(doc)

    def launch(self, doc: dict) -> None:
        bid = doc["id"]
        self._docs[bid] = doc
        self._stops[bid] = asyncio.Event()
        task = asyncio.create_task(self._run(doc), name=f"batch {bid}")
        self._tasks[bid] = task
        task.add_done_callback(functools.partial(self._forget, bid))

    def _forget(self, bid: str, task: asyncio.Task) -> None:
        self._tasks.pop(bid, None)
        self._docs.pop(bid, None)
        self._stops.pop(bid, None)
        self._journals.pop(bid, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("batch %s stopped on an error", bid, exc_info=task.exception())

    async def stop(self) -> None:
        """Server shutdown: stop every batch where it is (it resumes at the next start)."""
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- what the API asks

    def view(self, doc: dict) -> dict:
        """The batch object as the API returns it: live counts while it runs."""
        live = self._docs.get(doc["id"], doc)
        out = {k: v for k, v in live.items() if not k.startswith("_")}
        journal = self._journals.get(doc["id"])
        if journal is not None:
            out["request_counts"] = {**out["request_counts"], "completed": journal.completed,
                                     "failed": journal.failed}
        return out

    def pending(self) -> int:
        """Requests of the running batches not answered yet (a validating batch counts none)."""
        left = 0
        for doc in list(self._docs.values()):
            counts = self.view(doc)["request_counts"]
            left += max(0, counts["total"] - counts["completed"] - counts["failed"])
        return left

    def get(self, batch_id: str) -> dict | None:
        doc = self._docs.get(batch_id) or self.store.get_batch(batch_id)
        return self.view(doc) if doc is not None else None

    def cancel(self, batch_id: str) -> dict | None:
        """Start cancelling; the answers so far are published when it stops. None: no such batch;
        a batch already final comes back as it is (the caller refuses it)."""
        doc = self._docs.get(batch_id)
        if doc is None:
            return self.get(batch_id)
        if doc["status"] in ("validating", "in_progress"):
            self._set(doc, "cancelling", "cancelling_at")
            self._stops[batch_id].set()
        return self.view(doc)

    # -- one batch

    def _set(self, doc: dict, status: str, stamp: str | None = None) -> None:
        doc["status"] = status
        if stamp is not None:
            doc[stamp] = int(time.time())
        self.store.save_batch(doc)

    async def _run(self, doc: dict) -> None:
        if doc["status"] == "validating":
            await self._validate(doc)
        if doc["status"] == "in_progress":
            await self._execute(doc)
        if doc["status"] in ("finalizing", "cancelling"):
            await self._finalize(doc)

    async def _validate(self, doc: dict) -> None:
        work = self.store.batch_work_dir(doc["id"])
        check = await asyncio.to_thread(check_input, _paths(work)[0], doc["endpoint"], self.limits.max_requests)
        if doc["status"] != "validating":  # cancelled meanwhile
            return
        names = self.state.embedding_names if ENDPOINTS[doc["endpoint"]] == "embedding" else self.state.model_names
        if not check.errors and check.model not in names:
            check.add("model_not_found", f"The model {check.model!r} is not served here; served: "
                      f"{', '.join(names) or 'none'}.", None, "body.model")
        doc["request_counts"] = {"total": check.total, "completed": 0, "failed": 0}
        doc["model"] = check.model
        if check.errors:
            doc["errors"] = {"object": "list", "data": check.errors}
            self._set(doc, "failed", "failed_at")
            shutil.rmtree(work, ignore_errors=True)
            return
        self._set(doc, "in_progress", "in_progress_at")

    async def _execute(self, doc: dict) -> None:
        bid = doc["id"]
        work = self.store.batch_work_dir(bid)
        journal = await asyncio.to_thread(_open_journal, work)
        self._journals[bid] = journal
        stop = self._stops[bid]
        try:
            while True:
                unanswered = await self._pass(doc, journal, stop)
                if stop.is_set() or not unanswered or self._expired(doc):
                    break
                await asyncio.sleep(_RETRY_S)  # the engine aborted some: send them again
            if self._expired(doc) and not stop.is_set():
                expired = await asyncio.to_thread(self._write_expired, doc, journal)
                self.answered["failed"] += expired  # after the await: other batches count meanwhile
                doc["_ending"] = "expired"
        finally:
            await asyncio.to_thread(journal.close)
        if doc["status"] == "in_progress":
            self._set(doc, "finalizing", "finalizing_at")

    def _expired(self, doc: dict) -> bool:
        return time.time() >= doc["expires_at"]

    async def _pass(self, doc: dict, journal: _Journal, stop: asyncio.Event) -> int:
        """Send every request not answered yet; returns how many the engine aborted."""
        kind = ENDPOINTS[doc["endpoint"]]
        running: set[asyncio.Task] = set()
        aborted = [0]
        try:
            for n, line in enumerate(iter_requests(_paths(self.store.batch_work_dir(doc["id"]))[0])):
                if n % 512 == 511:
                    await asyncio.sleep(0)  # skipping answered lines after a restart: let the loop serve
                if journal.has(line.custom_id):
                    continue
                await self._slot(stop)
                if stop.is_set() or self._expired(doc):
                    self._slots.release()
                    break
                task = asyncio.create_task(self._one(kind, line, journal, aborted))
                running.add(task)
                task.add_done_callback(running.discard)
            await _until_done_or(running, stop)
        finally:
            for t in running:
                t.cancel()  # cancelled or shutting down: the engine requests are aborted
            await asyncio.gather(*running, return_exceptions=True)
        return aborted[0]

    async def _slot(self, stop: asyncio.Event) -> None:
        """A place for one more batch request: under the cap, and no online request waiting."""
        await self._slots.acquire()
        while self.state.admission.waiting_seqs > 0 and not stop.is_set():
            await asyncio.sleep(_ONLINE_POLL_S)

    async def _one(self, kind: str, line: BatchLine, journal: _Journal, aborted: list[int]) -> None:
        self.inflight += 1
        try:
            status, body = await answer(self.state, kind, line.body)
        except NotAnswered:
            aborted[0] += 1
            return
        finally:
            self.inflight -= 1
            self._slots.release()
        rid = "req_" + os.urandom(12).hex()
        if status == 200:
            journal.output.write(success_line(line.custom_id, status, rid, body))
            journal.completed += 1
            self.answered["completed"] += 1
        else:
            journal.errors.write(success_line(line.custom_id, status, rid, body))
            journal.failed += 1
            self.answered["failed"] += 1
        journal.answered.add(line.custom_id)

    def _write_expired(self, doc: dict, journal: _Journal) -> int:
        """Past the completion window: every request not answered gets OpenAI's expiry error line;
        how many did (it runs off the loop, so the loop adds them to ``answered``)."""
        expired = 0
        for line in iter_requests(_paths(self.store.batch_work_dir(doc["id"]))[0]):
            if not journal.has(line.custom_id):
                journal.errors.write(error_line(line.custom_id, "batch_expired", "This request could not be "
                                                "executed before the completion window expired."))
                journal.failed += 1
                expired += 1
        return expired

    async def _finalize(self, doc: dict) -> None:
        bid = doc["id"]
        work = self.store.batch_work_dir(bid)
        _, out_p, err_p = _paths(work)
        counts = await asyncio.to_thread(_count_answers, out_p, err_p)
        doc["request_counts"] = {**doc["request_counts"], **counts}
        doc["usage"] = await asyncio.to_thread(_usage, out_p)
        for path, key in ((out_p, "output_file_id"), (err_p, "error_file_id")):
            fid = _fixed_file_id(bid, key)
            if self.store.get_file(fid) is None and path.exists() and path.stat().st_size > 0:
                staged = self.store.upload_path()
                await asyncio.to_thread(_link_or_copy, path, staged)
                name = f"batch_{bid}_{'output' if key == 'output_file_id' else 'error'}.jsonl"
                self.store.add_file(staged, name, "batch_output", file_id=fid)  # on the loop: SQLite lives there
            if self.store.get_file(fid) is not None:
                doc[key] = fid
        if doc["status"] == "cancelling":
            self._set(doc, "cancelled", "cancelled_at")
        else:
            ending = doc.pop("_ending", "completed")
            self._set(doc, ending, "expired_at" if ending == "expired" else "completed_at")
        shutil.rmtree(work, ignore_errors=True)


async def _until_done_or(tasks: set[asyncio.Task], stop: asyncio.Event) -> None:
    """Wait for ``tasks`` to finish, or for ``stop`` (a cancel) if it comes first."""
    stopped = asyncio.create_task(stop.wait())
    try:
        while tasks and not stop.is_set():
            await asyncio.wait([*tasks, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()


def _link_or_copy(source: Path, staging: Path) -> None:
    """A journal about to be published, hard-linked (else copied) to a staging name and on disk;
    the journal itself stays until the batch's final status is stored."""
    try:
        os.link(source, staging)
    except OSError:
        shutil.copyfile(source, staging)
    with open(staging, "rb") as f:
        os.fsync(f.fileno())


def _count_answers(out_p: Path, err_p: Path) -> dict:
    ok, _ = recover_file(out_p)
    bad, _ = recover_file(err_p)
    return {"completed": len(ok), "failed": len(bad)}


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
