"""Synthetic and file workloads for the simulator and the tuner.

A workload is a list of ``SimRequest``s: arrival time, prompt and output lengths, an
optional shared prefix (for prefix caching) and a priority.  Arrivals of a Poisson
process are drawn once at unit rate and scaled by 1/rate, so the same seed at two rates
gives the same requests in the same order (common random numbers: the tuner's p99 vs
rate curve is then smooth instead of re-drawn at every probe).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import numpy as np


@dataclass
class SimRequest:
    request_id: str
    arrival: float
    prompt_len: int
    output_len: int
    priority: int = 0
    prefix_group: str | None = None  # requests in one group share their first prefix_len tokens
    prefix_len: int = 0

    def block_keys(self, block_size: int, num_tokens: int | None = None) -> list[tuple]:
        """Keys of the full blocks of the first ``num_tokens`` tokens (default: the prompt),
        equal across requests exactly when the tokens are.

        A block wholly inside the shared prefix has the same content and the same parent
        chain in every request of the group, so (group, index) names it as a chained
        hash would; any later block (generated tokens included) is unique to the request.
        """
        keys = []
        for i in range((num_tokens or self.prompt_len) // block_size):
            if self.prefix_group is not None and (i + 1) * block_size <= self.prefix_len:
                keys.append(("p", self.prefix_group, i))
            else:
                keys.append(("r", self.request_id, i))
        return keys


class LengthDist:
    """Parse and sample a length spec.

    ``200`` or ``fixed:200``; ``uniform:50,500``; ``normal:200,50``; ``lognormal:200,0.8``
    (median, sigma) or ``lognormal:100,1,20,2000`` (kept within 20..2000); ``choice:32,512``
    (equal odds); ``mix:32x0.8,1024x0.2`` (weights).
    """

    def __init__(self, spec: str | int):
        self.spec = str(spec).strip()
        kind, _, rest = self.spec.partition(":")
        if not rest:
            kind, rest = "fixed", kind
        self.kind = kind.lower()
        try:
            if self.kind == "mix":
                pairs = [p.split("x") for p in rest.split(",")]
                self.values = [int(v) for v, _ in pairs]
                w = np.array([float(x) for _, x in pairs])
                self.weights = w / w.sum()
            else:
                self.values = [float(v) for v in rest.split(",")]
        except ValueError:
            raise ValueError(f"bad length spec {self.spec!r}: {self.__doc__}") from None
        need = {"fixed": (1,), "uniform": (2,), "normal": (2,), "lognormal": (2, 4)}
        if (self.kind in need and len(self.values) not in need[self.kind]) or self.kind not in {*need, "choice", "mix"}:
            raise ValueError(f"bad length spec {self.spec!r}: {' '.join(self.__doc__.split())}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        v = self.values
        if self.kind == "fixed":
            x = np.full(n, v[0])
        elif self.kind == "uniform":
            x = rng.integers(int(v[0]), int(v[1]) + 1, n)
        elif self.kind == "normal":
            x = rng.normal(v[0], v[1], n)
        elif self.kind == "lognormal":
            x = v[0] * np.exp(rng.normal(0, v[1], n))
            if len(v) == 4:
                x = np.clip(x, v[2], v[3])
        elif self.kind == "choice":
            x = rng.choice(np.array(v), n)
        else:
            x = rng.choice(np.array(self.values), n, p=self.weights)
        return np.maximum(np.round(x), 1).astype(int)

    def mean(self) -> float:
        return float(self.sample(np.random.default_rng(0), 4000).mean())


def synthetic(num_requests: int, rate: float, prompt_len: str | int = "uniform:64,512",
              output_len: str | int = "uniform:16,256", seed: int = 0, prefix_len: int = 0,
              prefix_groups: int = 1, priorities: int = 1, burstiness: float = 1.0) -> list[SimRequest]:
    """Poisson (or gamma, burstiness != 1) arrivals at ``rate`` req/s; rate inf: all at t=0.

    ``prefix_len`` > 0 gives every prompt a shared prefix of that many tokens, from one of
    ``prefix_groups`` different prefixes (a system prompt per task, say).
    """
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(1.0 / burstiness, burstiness, num_requests)  # mean 1
    p = LengthDist(prompt_len).sample(rng, num_requests)
    o = LengthDist(output_len).sample(rng, num_requests)
    groups = rng.integers(0, max(prefix_groups, 1), num_requests)
    prio = rng.integers(0, max(priorities, 1), num_requests)
    arrivals = np.zeros(num_requests) if math.isinf(rate) else np.cumsum(gaps) / rate
    out = []
    for i in range(num_requests):
        plen = int(p[i]) + prefix_len
        out.append(SimRequest(f"r{i}", float(arrivals[i]), plen, int(o[i]), int(prio[i]),
                              f"g{groups[i]}" if prefix_len else None, prefix_len))
    return out


def at_rate(requests: list[SimRequest], rate: float, base_rate: float = 1.0) -> list[SimRequest]:
    """The same requests with arrival times rescaled from ``base_rate`` to ``rate``."""
    f = 0.0 if math.isinf(rate) else base_rate / rate
    return [replace(r, arrival=r.arrival * f) for r in requests]


def jsonl_values(lines: Iterable[str], where: str,
                 error: type[ValueError] = ValueError) -> Iterator[tuple[int, object]]:
    """(line number, parsed value) for every non-blank line; a line that is not JSON raises
    ``error`` naming ``where`` and the line."""
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as e:
            raise error(f"{where}:{n}: not JSON ({e.msg}); each line must be one JSON value") from None


def from_jsonl(path: str, rate: float, seed: int = 0, chars_per_token: float = 4.0) -> list[SimRequest]:
    """Requests from a task file: ``prompt_tokens``/``output_tokens`` fields if present, else
    lengths estimated from ``messages``/``prompt`` text and ``max_tokens`` (default 16)."""
    rng = np.random.default_rng(seed)
    out: list[SimRequest] = []
    t = 0.0
    with open(path) as f:
        for n, d in jsonl_values(f, path):
            if not isinstance(d, dict):
                raise ValueError(f"{path}:{n}: each line must be one JSON object")
            body = d.get("body", d)  # OpenAI Batch lines wrap the request in "body"
            if "prompt_tokens" in d:
                plen = int(d["prompt_tokens"])
            else:
                text = body.get("prompt") or "".join(str(m.get("content", "")) for m in body.get("messages", []))
                if not text:
                    raise ValueError(f"{path}:{n}: no prompt_tokens, prompt or messages field")
                plen = max(1, round(len(text) / chars_per_token))
            olen = int(d.get("output_tokens", body.get("max_tokens", 16)))
            # A system message shared by many tasks is a shared prefix (prefix caching).
            msgs = body.get("messages") or []
            group, plen_prefix = None, 0
            if msgs and msgs[0].get("role") == "system" and "prompt_tokens" not in d:
                sys_text = str(msgs[0].get("content", ""))
                group, plen_prefix = f"sys{hash(sys_text)}", min(round(len(sys_text) / chars_per_token), plen)
            if not math.isinf(rate):
                t += rng.exponential(1.0 / rate)
            out.append(SimRequest(str(d.get("custom_id", f"line{n}")), t, plen, olen, 0, group, plen_prefix))
    if not out:
        raise ValueError(f"{path}: no requests")
    return out
