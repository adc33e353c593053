"""Several endpoints: least outstanding requests per unit of weight, fallback tiers, failing
endpoints cooled down, dead ones skipped.

Each endpoint has a ``weight`` (its share of the traffic) and a ``priority`` (its tier,
``carpool.client.endpoints.EndpointSpec``): a request goes to the lowest tier that has an
endpoint up and not cooling down, so a fallback tier gets traffic only while every endpoint
of the tiers before it is down.  Within the tier the endpoint with the fewest requests in
flight per unit of weight is picked, and ties (an idle job: all at zero) go round in
proportion to the weights (smooth weighted round-robin), so 3:1 weights send about three
requests to one at any load.  An endpoint with its own RPM/TPM is passed over while its
budget has no room and another endpoint of the tier has.

An endpoint whose requests fail at the connection level or with 5xx is taken out of
rotation for a cool-down that doubles with each consecutive failure (capped), and comes
back after it; one success resets it.  When every endpoint is cooling down the one that
comes back first is used anyway (the retry policy decides whether to wait).

With an ``Affinity`` (the default of a job with several endpoints) a request whose
prompt starts like an earlier one's goes where that one went, while that endpoint is not
overloaded (``carpool.client.affinity``): its prefix cache holds the shared start.

Each endpoint also has a circuit breaker (``carpool.client.breaker``): an endpoint that
does not answer at all is not picked while its breaker is open, and when every breaker is
open the ``gate`` holds the job's requests back (a pause, not failures).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from carpool.client.affinity import Affinity
from carpool.client.breaker import BreakerPolicy, CircuitBreaker, OutageGate
from carpool.client.budget import TokenBuckets
from carpool.client.endpoints import EndpointSpec


@dataclass
class Endpoint:
    url: str  # base URL, e.g. http://127.0.0.1:8000/v1
    outstanding: int = 0
    consecutive_failures: int = 0
    cooldown_until: float = 0.0
    sent: int = 0
    failures: int = 0
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    spec: EndpointSpec | None = None  # None: a plain URL (Bearer auth, the task's model)
    budget: TokenBuckets | None = None  # the endpoint's own RPM/TPM, if it has one
    credit: float = 0.0  # smooth weighted round-robin among equally loaded endpoints

    def __post_init__(self) -> None:
        if self.spec is None:
            self.spec = EndpointSpec(self.url)
        if self.budget is None and (self.spec.rpm or self.spec.tpm):
            self.budget = TokenBuckets(self.spec.rpm, self.spec.tpm)

    @property
    def weight(self) -> float:
        return self.spec.weight if self.spec is not None else 1.0

    @property
    def priority(self) -> int:
        return self.spec.priority if self.spec is not None else 0

    def budget_wait(self, tokens: int) -> float:
        return self.budget.wait_s(1, tokens) if self.budget is not None else 0.0

    def available(self, now: float) -> bool:
        return now >= self.cooldown_until


class Balancer:
    def __init__(self, urls: Sequence[str | EndpointSpec], cooldown_s: float = 1.0, max_cooldown_s: float = 30.0,
                 failures_to_cool: int = 1, breaker: BreakerPolicy | None = None,
                 affinity: Affinity | None = None):
        """``affinity``: keep a request's prefix group on the endpoint that had it (None: by load only)."""
        if not urls:
            raise ValueError("at least one endpoint URL is needed")
        specs = [u if isinstance(u, EndpointSpec) else EndpointSpec(u) for u in urls]
        self.endpoints = [Endpoint(s.url, breaker=CircuitBreaker(breaker), spec=s) for s in specs]
        self.cooldown_s, self.max_cooldown_s = cooldown_s, max_cooldown_s
        self.failures_to_cool = failures_to_cool
        self.gate = OutageGate([e.breaker for e in self.endpoints])
        self.affinity = affinity

    def pick(self, tokens: int = 0, keys: Sequence[int] = ()) -> Endpoint:
        """The endpoint for the next request (``tokens``: its estimate, for per-endpoint TPM;
        ``keys``: its prefix keys, ``carpool.client.affinity.prefix_keys``)."""
        if len(self.endpoints) == 1:
            ep = self.endpoints[0]
        else:
            now = time.monotonic()
            # An endpoint whose breaker is open gets nothing while another is up.
            up = [e for e in self.endpoints if e.breaker.closed] or self.endpoints
            ready = [e for e in up if e.available(now)]
            if ready:
                tier = min(e.priority for e in ready)  # fallbacks only while the tiers before are out
                ready = [e for e in ready if e.priority == tier]
                ready = [e for e in ready if e.budget_wait(tokens) <= 0] or ready
                ep = self.affinity.choose(keys, ready, self._least_loaded) if keys and self.affinity is not None \
                    else self._least_loaded(ready)
            else:
                ep = min(up, key=lambda e: (e.cooldown_until, e.priority))
        ep.outstanding += 1
        ep.sent += 1
        return ep

    @staticmethod
    def _least_loaded(ready: list[Endpoint]) -> Endpoint:
        least = min(e.outstanding / e.weight for e in ready)
        ties = [e for e in ready if e.outstanding / e.weight <= least + 1e-9]
        if len(ties) == 1:
            return ties[0]
        total = sum(e.weight for e in ties)
        for e in ties:
            e.credit += e.weight
        ep = max(ties, key=lambda e: e.credit)  # the first of equals: plain round-robin at equal weights
        ep.credit -= total
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
        return [{"url": e.url, "name": e.spec.name if e.spec else e.url, "priority": e.priority,
                 "weight": e.weight, "outstanding": e.outstanding, "sent": e.sent, "failures": e.failures,
                 "cooling_down": not e.available(now), "breaker": str(e.breaker.state)} for e in self.endpoints]
