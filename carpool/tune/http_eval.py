"""An OpenAI-compatible endpoint as a tuner evaluator (streamed /completions, token-id prompts).

The server's own settings cannot be changed from here, so the tuner only searches the
request rate (or the client concurrency) against it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import replace

import aiohttp

from carpool.errors import EndpointLost, StartRefused
from carpool.redact import redact_url
from carpool.tune.engine_load import prompt_token_ids, replay_arrivals
from carpool.tune.measure import Measurement
from carpool.tune.workload import SimRequest

CANNOT_CONNECT = "cannot connect to"  # a record's error when no connection was made


class EndpointEvaluator:
    def __init__(self, base_url: str, model: str, requests: list[SimRequest], base_rate: float = 1.0,
                 vocab: int = 49152, api_key: str | None = None, timeout_s: float = 600.0,
                 duration_s: float | None = None, min_requests: int = 50):
        self.url = base_url.rstrip("/") + "/completions"
        self.model = model
        self.requests = requests
        self.base_rate = base_rate
        self.duration_s = duration_s
        self.min_requests = min_requests
        self.vocab = vocab
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.calls = 0

    def check(self) -> None:
        """One short request before the search, as ``bench`` and ``diagnose`` send first: a wrong
        URL, model or key is refused in a moment (``StartRefused``, exit 2), where the search
        would have run every probe against it, each failing, and then advised a rate of 0."""
        first = replace(self.requests[0], request_id="carpool-tune-check", arrival=0.0, output_len=1)
        rec = asyncio.run(self.run_requests([first]))[0]
        if rec["error"] is not None:
            raise StartRefused(f"the first request to {redact_url(self.url)} failed: {rec['error']}; nothing was "
                               "tuned: check --endpoint, --model and the key")

    def measure(self, setting, rate: float, concurrency: int | None = None) -> Measurement:
        self.calls += 1
        from carpool.tune.tuner import probe_requests

        reqs = [replace(r, request_id=f"{r.request_id}-{self.calls}")
                for r in probe_requests(self.requests, rate, self.base_rate, self.duration_s, self.min_requests,
                                         concurrency)]
        records = asyncio.run(self.run_requests(reqs, concurrency))
        if records and all(str(r["error"] or "").startswith(CANNOT_CONNECT) for r in records):
            # Not a rate the server misses its SLO at: it is gone, and every later probe would say the same.
            raise EndpointLost(f"{redact_url(self.url)} stopped answering during the search ({records[0]['error']}); "
                               "the probes so far are discarded: start the server again and rerun")
        return Measurement.from_records(records, rate, concurrency)

    async def run_requests(self, reqs: list[SimRequest], concurrency: int | None = None) -> list[dict]:
        """Send ``reqs`` at their arrival times (at most ``concurrency`` in flight); one record each."""
        slots = asyncio.Semaphore(concurrency) if concurrency else contextlib.nullcontext()
        records: list[dict] = []
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=self.timeout, headers=self.headers) as session:
            t0 = time.monotonic() + 0.02

            async def one(r: SimRequest) -> None:
                async with slots:
                    records.append(await self._send(session, r, t0))

            await replay_arrivals(reqs, t0, one)
        return records

    async def _send(self, session: aiohttp.ClientSession, r: SimRequest, t0: float) -> dict:
        """One streamed request; its record (times in seconds from ``t0``)."""
        rec = {"id": r.request_id, "submit": time.monotonic() - t0, "first_token": None, "finish": None,
               "prompt_len": r.prompt_len, "output_len": r.output_len, "error": None}
        body = {"model": self.model, "prompt": prompt_token_ids(r, self.vocab), "max_tokens": r.output_len,
                "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            async with session.post(self.url, json=body) as resp:
                if resp.status != 200:
                    rec["error"] = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return rec
                async for raw in resp.content:
                    line = raw.decode("utf-8", "replace").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if rec["first_token"] is None and chunk.get("choices"):
                        rec["first_token"] = time.monotonic() - t0
                rec["finish"] = time.monotonic() - t0
        except aiohttp.ClientConnectorError as e:
            rec["error"] = f"{CANNOT_CONNECT} {e.host}:{e.port}: {e.os_error.strerror or e.os_error}"
        except (TimeoutError, asyncio.TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as e:
            rec["error"] = repr(e)
        return rec
