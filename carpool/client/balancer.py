"""Several endpoints: least outstanding requests, failing endpoints cooled down, dead ones skipped.

An endpoint whose requests fail at the connection level or with 5xx is taken out of
rotation for a cool-down that doubles with each consecutive failure (capped), and comes
back after it; one success resets it.  When every endpoint is cooling down the one that
comes back first is used anyway (the retry policy decides whether to wait).

Each endpoint also has a circuit breaker (``carpool.client.breaker``): an endpoint that
does not answer at all is not picked while its breaker is open, and when every breaker is
open the ``gate`` holds the job's requests back (a pause, not failures).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from carpool.client.breaker import BreakerPolicy, CircuitBreaker, OutageGate


@dataclass
class Endpoint:
    url: str  # base URL, e.g. http://127.0.0.1:8000/v1
    outstanding: int = 0
    consecutive_failures: int = 0
    cooldown_until: float = 0.0
    sent: int = 0
    failures: int = 0
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)

    def available(self, now: float) -> bool:
        return now >= self.cooldown_until


class Balancer:
    def __init__(self, urls: list[str], cooldown_s: float = 1.0, max_cooldown_s: float = 30.0,
                 failures_to_cool: int = 1, breaker: BreakerPolicy | None = None):
        if not urls:
            raise ValueError("at least one endpoint URL is needed")
        self.endpoints = [Endpoint(u.rstrip("/"), breaker=CircuitBreaker(breaker)) for u in urls]
        self.cooldown_s, self.max_cooldown_s = cooldown_s, max_cooldown_s
        self.failures_to_cool = failures_to_cool
        self.gate = OutageGate([e.breaker for e in self.endpoints])
        self._rr = itertools.count()

    def pick(self) -> Endpoint:
        if len(self.endpoints) == 1:
            ep = self.endpoints[0]
        else:
            now = time.monotonic()
            # An endpoint whose breaker is open gets nothing while another is up.
            up = [e for e in self.endpoints if e.breaker.closed] or self.endpoints
            ready = [e for e in up if e.available(now)]
            if ready:
                least = min(e.outstanding for e in ready)
                ties = [e for e in ready if e.outstanding == least]
                ep = ties[next(self._rr) % len(ties)]  # round-robin among equals
            else:
                ep = min(up, key=lambda e: e.cooldown_until)
        ep.outstanding += 1
        ep.sent += 1
        return ep

    def done(self, ep: Endpoint, ok: bool, endpoint_fault: bool = False) -> None:
        """``endpoint_fault``: the failure says the endpoint is unwell (connect error, 5xx, timeout)."""
        ep.outstanding -= 1
        if ok:
            ep.consecutive_failures = 0
            return
        if endpoint_fault:
            ep.failures += 1
            ep.consecutive_failures += 1
            if ep.consecutive_failures >= self.failures_to_cool and len(self.endpoints) > 1:
                n = ep.consecutive_failures - self.failures_to_cool
                ep.cooldown_until = time.monotonic() + min(self.max_cooldown_s, self.cooldown_s * 2**n)

    def snapshot(self) -> list[dict]:
        now = time.monotonic()
        return [{"url": e.url, "outstanding": e.outstanding, "sent": e.sent, "failures": e.failures,
                 "cooling_down": not e.available(now), "breaker": str(e.breaker.state)} for e in self.endpoints]
