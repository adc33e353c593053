"""The Files and Batches API's state on one server: the store and the executor, once they open.

The batch directory may not open (read-only, full, a bad path): the server then serves the
online API as ever and the Files and Batches routes answer 503 naming the directory and the
reason.  Each such request tries the directory again (at most every ``REOPEN_S``), so the
API comes up, and the unfinished batches resume, as soon as the directory is fixed -- no
restart needed.
"""

from __future__ import annotations

import logging
import sqlite3
import time

from carpool.errors import OpenAIError
from carpool.paths import cache_dir
from carpool.server.batch_budget import WorkBudget, engine_share
from carpool.server.batch_disk import BatchDisk
from carpool.server.batch_executor import BatchExecutor, BatchLimits
from carpool.server.batch_metrics import BatchCollector
from carpool.server.batch_store import BatchStore
from carpool.server.config import ServerConfig
from carpool.server.state import ServerState

log = logging.getLogger("carpool.server.batches")

REOPEN_S = 5.0


def batch_dir(config: ServerConfig) -> str:
    return config.batch_dir or str(cache_dir() / "batches")


class BatchService:
    def __init__(self, state: ServerState, config: ServerConfig, disk: BatchDisk | None = None) -> None:
        self.state = state
        self.config = config
        self.disk = disk or BatchDisk()
        self.limits = BatchLimits(config.max_batch_file_bytes, config.max_batch_requests, config.batch_max_inflight)
        self.executor: BatchExecutor | None = None
        self.error: str | None = None  # why the directory did not open, while it does not
        self._tried = -REOPEN_S

    def open(self) -> BatchExecutor | None:
        """Open the store and resume its unfinished batches (on the server's loop); None, with
        ``error`` saying why, when the directory cannot be used."""
        if self.executor is not None:
            return self.executor
        self._tried = time.monotonic()
        where = batch_dir(self.config)
        try:
            store = BatchStore(where)
        except (OSError, sqlite3.Error) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            self.error = (f"the Files and Batches API is unavailable: the batch directory {where!r} cannot be "
                          f"used ({reason}); fix it (--batch-dir) and it opens at the next request")
            log.warning("%s", self.error)
            return None
        seats, tokens = engine_share(self.state.engine.stats(), self.config.engine.block_size,
                                     self.config.batch_max_seqs)
        self.executor = BatchExecutor(self.state, store, self.limits, WorkBudget(seats, tokens, self.state.admission),
                                      self.disk)
        self.error = None
        self.state.metrics.registry.register(BatchCollector(self.executor))
        self.executor.resume()
        return self.executor

    def require(self) -> BatchExecutor:
        """The executor, for a request: a 503 while the directory cannot be used."""
        if self.executor is None and time.monotonic() - self._tried >= REOPEN_S:
            self.open()
        if self.executor is None:
            raise OpenAIError(503, self.error or "starting", type="server_error", code="batch_store_unavailable")
        return self.executor

    async def close(self) -> None:
        if self.executor is not None:
            await self.executor.stop()
            self.executor.store.close()
