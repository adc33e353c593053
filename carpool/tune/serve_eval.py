"""``carpool serve`` as a tuner evaluator: a subprocess restarted per setting, loaded over HTTP.

The in-process ``EngineEvaluator`` measures the engine alone; this one measures what a
user deploys (HTTP parsing, SSE framing, admission control, a separate process), so the
rate it finds is the one the server really sustains.  Each setting becomes the server's
own flags (vLLM's names); the load is the ``EndpointEvaluator``'s streamed /completions.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.request
from collections.abc import Callable
from dataclasses import replace

from carpool.tune.http_eval import EndpointEvaluator
from carpool.tune.measure import Measurement
from carpool.tune.workload import SimRequest


def serve_flags(setting) -> list[str]:
    """The ``carpool serve`` flags for a tuner ``Setting``."""
    return ["--max-num-seqs", str(setting.max_num_seqs),
            "--max-num-batched-tokens", str(setting.max_num_batched_tokens),
            "--scheduling-policy", setting.scheduling_policy,
            "--enable-prefix-caching" if setting.enable_prefix_caching else "--no-enable-prefix-caching"]


def served_model_name(base_url: str, timeout_s: float = 30.0) -> str:
    with urllib.request.urlopen(base_url + "/v1/models", timeout=timeout_s) as resp:
        return json.load(resp)["data"][0]["id"]


class ServeEvaluator:
    """One ``carpool serve --model MODEL <setting flags> ARGS --port 0`` at a time.

    ``extra_args`` go to every server (e.g. ``--kv-cache-memory-gb 2``); the admission
    queue is left as configured, so a rate the server answers with 429s fails the SLO, as
    it would for a client.  ``warmup`` requests run before a new server is measured: the
    first forwards of each shape are slow and are not what the setting costs.
    """

    def __init__(self, model: str, requests: list[SimRequest], extra_args: list[str] | None = None,
                 base_rate: float = 1.0, duration_s: float | None = None, min_requests: int = 50,
                 warmup: int = 4, log: Callable[[str], None] = lambda s: None, start_timeout_s: float = 600.0):
        self.model = model
        self.requests = requests
        self.extra_args = list(extra_args or [])
        self.base_rate = base_rate
        self.duration_s = duration_s
        self.min_requests = min_requests
        self.warmup = warmup
        self.log = log
        self.start_timeout_s = start_timeout_s
        self._stack: contextlib.ExitStack | None = None
        self._setting = None
        self._endpoint: EndpointEvaluator | None = None
        self.base_url: str | None = None

    def _endpoint_for(self, setting) -> EndpointEvaluator:
        if self._setting == setting and self._endpoint is not None:
            return self._endpoint
        self.close()
        from carpool.server.launcher import start_server_process

        args = ["--model", self.model, *serve_flags(setting), *self.extra_args, "--host", "127.0.0.1", "--port", "0"]
        stack = contextlib.ExitStack()
        try:
            handle = stack.enter_context(start_server_process(args, timeout_s=self.start_timeout_s))
            name = served_model_name(handle.base_url)
        except BaseException:
            stack.close()
            raise
        self._stack, self._setting, self.base_url = stack, setting, handle.base_url
        self._endpoint = EndpointEvaluator(handle.base_url + "/v1", name, self.requests, self.base_rate,
                                           duration_s=self.duration_s, min_requests=self.min_requests)
        self.log(f"carpool serve restarted with {setting.label()} at {handle.base_url}")
        if self.warmup:
            warm = [replace(r, request_id=f"warm-{r.request_id}", arrival=0.0) for r in self.requests[: self.warmup]]
            asyncio.run(self._endpoint.run_requests(warm))
        return self._endpoint

    def measure(self, setting, rate: float, concurrency: int | None = None) -> Measurement:
        return self._endpoint_for(setting).measure(setting, rate, concurrency)

    def close(self) -> None:
        if self._stack is not None:
            self._stack.close()
        self._stack = self._endpoint = self._setting = self.base_url = None
