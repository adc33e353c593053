"""Prometheus metrics with vLLM's names and meanings, one registry per app.

Engine gauges and cumulative counters are read from ``engine.stats()`` at scrape time (a
custom collector), so they are never stale and cost nothing per token.  Latency
histograms are observed by the server as tokens leave, the way vLLM's front end does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_DELAY_BUCKETS = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0)

# the server's own latency and size histograms, labelled model_name: key -> (name, help, buckets)
_HISTOGRAMS: dict[str, tuple[str, str, tuple]] = {
    "ttft": ("vllm:time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS),
    "itl": ("vllm:inter_token_latency_seconds", "Time between output tokens", _ITL_BUCKETS),
    "e2e": ("vllm:e2e_request_latency_seconds", "End-to-end request latency", _E2E_BUCKETS),
    "queue_time": ("vllm:request_queue_time_seconds", "Time a request spent waiting before it was scheduled",
                   _LATENCY_BUCKETS),
    "iteration_tokens": ("vllm:iteration_tokens_total", "Tokens processed per engine step", _TOKEN_BUCKETS),
    "prompt_len": ("vllm:request_prompt_tokens", "Prompt tokens per request", _TOKEN_BUCKETS),
    "generation_len": ("vllm:request_generation_tokens", "Generated tokens per request", _TOKEN_BUCKETS),
}

# stats() key -> (metric name without the _total suffix, help, kind)
_ENGINE_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("num_requests_running", "vllm:num_requests_running", "Requests in model execution batches", "gauge"),
    ("num_requests_waiting", "vllm:num_requests_waiting", "Requests waiting to be processed", "gauge"),
    ("kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent", "gauge"),
    ("prefix_cache_queries", "vllm:prefix_cache_queries", "Prefix cache queries, in tokens", "counter"),
    ("prefix_cache_hits", "vllm:prefix_cache_hits", "Prefix cache hits, in tokens", "counter"),
    ("num_preemptions", "vllm:num_preemptions", "Cumulative number of preemptions", "counter"),
    ("prompt_tokens", "vllm:prompt_tokens", "Number of prefill tokens processed", "counter"),
    ("generation_tokens", "vllm:generation_tokens", "Number of generation tokens processed", "counter"),
    # The batch limit, so a client can start at it instead of ramping up (carpool.client.start_limit).
    ("max_num_seqs", "carpool:max_num_seqs", "Sequences the engine runs in one batch at most", "gauge"),
    ("max_num_batched_tokens", "carpool:max_num_batched_tokens", "Tokens the engine runs in one step at most",
     "gauge"),
    ("num_interrupted_steps", "carpool:interrupted_steps",
     "Steps of batch work stopped for an arriving online request (and redone)", "counter"),
)


class _EngineCollector:
    def __init__(self, stats: Callable[[], dict], model_name: str) -> None:
        self._stats = stats
        self._model = model_name

    def describe(self) -> Iterable[Metric]:
        return []  # names are fixed; skipping describe keeps registration from calling stats()

    def collect(self) -> Iterable[Metric]:
        try:
            stats = self._stats()
        except Exception:  # noqa: BLE001 - a scrape must never take the server down
            stats = {}
        for key, name, doc, kind in _ENGINE_METRICS:
            family_type = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            family = family_type(name, doc, labels=["model_name"])
            family.add_metric([self._model], float(stats.get(key, 0) or 0))
            yield family


class ServerMetrics:
    def __init__(self, model_name: str, engine_stats: Callable[[], dict] | None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.model_name = model_name
        if engine_stats is not None:
            self.registry.register(_EngineCollector(engine_stats, model_name))

        def histogram(key: str):
            name, doc, buckets = _HISTOGRAMS[key]
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry).labels(model_name)

        self.ttft = histogram("ttft")
        self.itl = histogram("itl")
        self.e2e = histogram("e2e")
        self.queue_time = histogram("queue_time")
        self.iteration_tokens = histogram("iteration_tokens")
        self.prompt_len = histogram("prompt_len")
        self.generation_len = histogram("generation_len")
        reg = self.registry
        self._success = Counter(
            "vllm:request_success", "Finished requests by finish reason",
            ["model_name", "finished_reason"], registry=reg,
        )
        self.embedding_batch_size = Histogram(
            "carpool:embedding_batch_size", "Inputs per embedding model call", buckets=_BATCH_BUCKETS, registry=reg
        )
        self.embedding_queue_delay = Histogram(
            "carpool:embedding_queue_delay_seconds", "Time an embedding input waited for its batch",
            buckets=_DELAY_BUCKETS, registry=reg,
        )
        self._rejected = Counter(
            "carpool:requests_rejected", "Requests refused by admission control, by reason", ["reason"],
            registry=reg,
        )

    def request_finished(self, finish_reason: str, prompt_tokens: int, generation_tokens: int) -> None:
        self._success.labels(self.model_name, finish_reason).inc()
        self.prompt_len.observe(prompt_tokens)
        self.generation_len.observe(generation_tokens)

    def rejected(self, reason: str) -> None:
        self._rejected.labels(reason).inc()

    def on_engine_step(self, step: dict) -> None:
        """An ``engine.add_step_listener`` callback (may run on the engine's thread)."""
        tokens = int(step.get("num_prefill_tokens", 0)) + int(step.get("num_decode_tokens", 0))
        if tokens:
            self.iteration_tokens.observe(tokens)

    def on_embedding_batch(self, event: dict) -> None:
        """A ``DynamicBatcher.add_batch_listener`` callback."""
        self.embedding_batch_size.observe(event["batch_size"])
        for delay in event.get("queue_delays_s", ()):
            self.embedding_queue_delay.observe(delay)

    def render(self) -> bytes:
        return generate_latest(self.registry)
