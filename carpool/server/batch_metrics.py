"""The Batch API's Prometheus metrics, read at scrape time from the executor and its store.

    carpool:batches{status}                  batches the store holds, by OpenAI status (gauge)
    carpool:batch_requests_total{status}     batch requests this process answered: completed
                                             (a 200 in the output file) or failed (an error line)
    carpool:batch_requests_running           batch requests in the engine now (gauge)
    carpool:batch_requests_pending           requests of running batches not answered yet (gauge)

Nothing is counted per token or per request on the serving path beyond two integer bumps
in the executor; a scrape asks the store one grouped count.  Scrapes run on the server's
loop, the only thread that touches the store.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from carpool.server.batch_executor import BatchExecutor
from carpool.server.batch_object import FINAL, UNFINISHED

STATUSES = UNFINISHED + FINAL


class BatchCollector:
    def __init__(self, executor: BatchExecutor) -> None:
        self._executor = executor

    def describe(self) -> Iterable[Metric]:
        return []  # names are fixed; skipping describe keeps registration from reading the store

    def collect(self) -> Iterable[Metric]:
        executor = self._executor
        try:
            by_status = executor.store.count_batches()
        except Exception:  # noqa: BLE001 - a scrape must never take the server down (a closed store)
            by_status = {}
        batches = GaugeMetricFamily("carpool:batches", "Batches held by the Batch API, by status",
                                    labels=["status"])
        for status in STATUSES:
            batches.add_metric([status], float(by_status.get(status, 0)))
        yield batches
        answered = CounterMetricFamily("carpool:batch_requests", "Batch requests answered, by outcome",
                                       labels=["status"])
        for status, n in executor.answered.items():
            answered.add_metric([status], float(n))
        yield answered
        yield GaugeMetricFamily("carpool:batch_requests_running", "Batch requests in the engine now",
                                value=float(executor.inflight))
        yield GaugeMetricFamily("carpool:batch_requests_pending",
                                "Requests of running batches not answered yet", value=float(executor.pending()))
