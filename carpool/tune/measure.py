"""One measured (or simulated) load run reduced to the numbers an SLO is written in.

Both the simulator and the real engine produce per-request records
``{"submit", "first_token", "finish", "prompt_len", "output_len"}`` (seconds), and both go
through ``Measurement.from_records``, so a simulated P99 and a measured P99 are computed
the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from carpool.tune.simulator import SimResult, metric_from, percentiles


@dataclass
class Measurement:
    rate: float
    concurrency: int | None
    num_requests: int
    num_finished: int
    duration_s: float
    throughput_rps: float
    output_tok_s: float
    e2e_s: dict
    ttft_s: dict
    tpot_s: dict
    mean_in_flight: float  # Little's law: throughput x mean E2E
    records: list[dict]

    def metric(self, name: str) -> float:
        if name in ("throughput_rps", "output_tok_s"):
            return getattr(self, name)
        return metric_from(name, {"e2e": self.e2e_s, "ttft": self.ttft_s, "tpot": self.tpot_s})

    def summary(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "records"}

    @classmethod
    def from_records(cls, records: list[dict], rate: float, concurrency: int | None = None) -> Measurement:
        ok = [r for r in records if r.get("finish") is not None and not r.get("error")]
        if ok:
            start = min(r["submit"] for r in records)
            dur = max(max(r["finish"] for r in ok) - start, 1e-9)
        else:
            dur = math.nan
        e2e = [r["finish"] - r["submit"] for r in ok]
        ttft = [r["first_token"] - r["submit"] for r in ok if r.get("first_token") is not None]
        tpot = [(r["finish"] - r["first_token"]) / (r["output_len"] - 1) for r in ok
                if r["output_len"] > 1 and r.get("first_token") is not None]
        thr = len(ok) / dur if ok else 0.0
        e2e_p = percentiles(e2e)
        return cls(rate, concurrency, len(records), len(ok), dur, thr,
                   sum(r["output_len"] for r in ok) / dur if ok else 0.0, e2e_p, percentiles(ttft),
                   percentiles(tpot), thr * e2e_p["mean"] if ok else 0.0, records)

    @classmethod
    def from_sim(cls, res: SimResult, rate: float, concurrency: int | None = None) -> Measurement:
        return cls.from_records(res.requests, rate, concurrency)


@dataclass(frozen=True)
class SLO:
    """``p99_e2e_ms <= 2000``: a metric name and its upper bound."""

    metric: str
    limit: float

    @classmethod
    def parse(cls, text: str) -> SLO:
        name, sep, value = text.partition("=")
        name = name.strip().rstrip("<").strip()
        if not sep:
            raise ValueError(f"--slo {text!r}: write METRIC=LIMIT, e.g. p99_e2e_ms=2000")
        try:
            limit = float(value)
        except ValueError:
            raise ValueError(f"--slo {text!r}: {value!r} is not a number") from None
        if limit <= 0:
            raise ValueError(f"--slo {text!r}: the limit must be > 0")
        metric_from(name, {"e2e": percentiles([1.0]), "ttft": percentiles([1.0]), "tpot": percentiles([1.0])})
        return cls(name, limit)

    def margin(self, m: Measurement) -> float:
        """Relative headroom: > 0 meets the SLO, < 0 misses it (nan counts as a miss)."""
        v = m.metric(self.metric)
        return -1.0 if math.isnan(v) else (self.limit - v) / self.limit

    def __str__(self) -> str:
        return f"{self.metric}<={self.limit:g}"


def margin(slos: list[SLO], m: Measurement) -> float:
    """The tightest SLO's headroom; unfinished requests are a miss."""
    if m.num_finished < m.num_requests:
        return -1.0
    return min(s.margin(m) for s in slos)
