"""The engine's routes, chosen from timings taken on the machine it runs on.

Which code runs a linear, a prefill chunk's attention or a handful of rows depends on the CPU:
carpool's AVX-512 GEMM (ops/decode_gemm.cpp) beats oneDNN on a 2-core Zen 5, while on a Xeon
with AMX oneDNN's tiles are several times faster than any AVX-512 loop.  So no route is a
constant: ``plan_measure.measure`` times the candidates on the model's real shapes at the first
start on a machine, ``choose`` (pure: timings in, plan out, no clock) keeps the fastest, and
``plan_cache`` stores the result beside the kernel build.

The routes a plan holds:
- ``gemm`` / ``int8_gemm``: per linear (qkv, o, gate_up, down, head) a table of row buckets
  ``[(max_rows, route), ...]``, route "carpool" (the packed GEMM, each thread a share of the
  32-column blocks), "carpool_split" (the same GEMM with each block's rows also cut in pieces so
  the work divides evenly between the threads: timed only where the block count does not divide
  by the thread count), "onednn" (torch's prepacked GEMM, or torch._int_mm for int8) or, int8 only,
  "onednn_qlinear" (oneDNN's prepacked int8 linear); rows past the last bucket take the last
  bucket's route;
- ``weight_only_max_rows``: int8 batches of at most this many rows run weight-only
  (``_weight_int8pack_mm``), larger ones quantize the activations;
- ``prefill``: per bucket of a prefill chunk's attention work (rows x keys seen) its route:
  "kernel" (the SIMD kernel), "flash" (torch's flash attention) or "brgemm" (two GEMMs a tile of
  keys on ATen's brgemm micro-kernel: AMX where the CPU has it); work past the last bucket takes
  the last bucket's route;
- ``decode``: per bucket of a decode row's keys, "kernel" or "brgemm";
- ``row_grain`` / ``silu_grain``: a row-wise pass (residual add + RMSNorm, RoPE, quantizing rows;
  SiLU * up) over at most this many values runs on one thread, a larger one on all of them;
- ``batch_tokens``: the step's token budget for throughput (offline jobs: ``carpool run``,
  ``LLM``), from the time of whole steps of one and of several prefill chunks (0: not measured);
- ``max_seqs``: how many sequences a step runs at most for throughput (offline jobs), from the
  time of whole decode steps of each of ``SEQ_CHOICES`` rows (0: not measured).

``DEFAULT`` is the fallback when nothing is measured (``CARPOOL_ENGINE_PLAN=default``): the
routes a 2-core Zen 5 preferred.  ``CARPOOL_ENGINE_PLAN`` (or ``extra["plan"]``) also forces
routes for debugging, e.g. ``gemm=onednn,prefill=flash`` (``parse_overrides``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

LINEARS = ("qkv", "o", "gate_up", "down", "head")
# On an exact tie the first wins.  "onednn_qlinear" is int8's alone (oneDNN's prepacked int8 linear;
# for int8 "onednn" is torch._int_mm on the plain weight); a bf16 linear's "onednn" is prepacked already.
GEMM_ROUTES = ("carpool", "carpool_split", "onednn", "onednn_qlinear")
PACKED_ROUTES = ("carpool", "carpool_split")  # the routes that run ops/decode_gemm.cpp
PREFILL_ROUTES = ("kernel", "flash", "brgemm")
DECODE_ROUTES = ("kernel", "brgemm")
# Upper ends of the row buckets timed; the engine's token budget is added as the last one.  4 and 8
# apart because a few decode rows are where cutting a block's rows stops paying (on a 2-core Zen 4,
# 19 blocks over two threads: cut 30% slower at 2-4 rows, 1-5% faster from 8 rows on).
ROW_BUCKETS = (4, 8, 16, 64, 256, 1024, 2048)
WEIGHT_ONLY_ROWS = (1, 2, 4, 8)
UNBOUNDED = 1 << 30  # rows past every timed bucket
MODES = ("measure", "remeasure", "default")
# The fallback's row-wise passes: up to 128K values (SiLU * up: 32K) on one thread (a 2-core Zen 5).
DEFAULT_ROW_GRAIN = 1 << 17
DEFAULT_SILU_GRAIN = 1 << 15
# The step's token budget when nothing chose one: vLLM's for its server, and the engine's constant
# before the plan measured it.  Offline budgets are chosen among BATCH_TOKENS (never below it).
DEFAULT_BATCH_TOKENS = 2048
BATCH_TOKENS = (2048, 4096, 8192, 16384)
# The sequences a step runs at most when nothing chose it: the engine's constant before the plan
# measured it, and a server's (a longer decode step is every user's time between two tokens).
# Offline it is chosen among SEQ_CHOICES (vLLM's CPU build runs 256 for its offline ``LLM``).
DEFAULT_MAX_SEQS = 64
SEQ_CHOICES = (64, 128, 256)

RouteTable = tuple[tuple[int, str], ...]


@dataclass(frozen=True)
class Plan:
    gemm: dict[str, RouteTable]
    int8_gemm: dict[str, RouteTable]
    weight_only_max_rows: int
    prefill: RouteTable
    decode: RouteTable = ((UNBOUNDED, "kernel"),)
    row_grain: int = DEFAULT_ROW_GRAIN
    silu_grain: int = DEFAULT_SILU_GRAIN
    batch_tokens: int = 0
    max_seqs: int = 0
    source: str = "default"  # default | measured | cached, and "+forced" when overridden
    timings: dict[str, Any] = field(default_factory=dict, compare=False)
    fingerprint: dict[str, Any] = field(default_factory=dict, compare=False)

    def gemm_routes(self, name: str, int8: bool = False) -> RouteTable:
        table = self.int8_gemm if int8 else self.gemm
        return table.get(name, ((UNBOUNDED, "onednn"),))

    def to_json(self) -> dict[str, Any]:
        return {"gemm": {k: [list(e) for e in v] for k, v in self.gemm.items()},
                "int8_gemm": {k: [list(e) for e in v] for k, v in self.int8_gemm.items()},
                "weight_only_max_rows": self.weight_only_max_rows, "prefill": [list(e) for e in self.prefill],
                "decode": [list(e) for e in self.decode],
                "row_grain": self.row_grain, "silu_grain": self.silu_grain, "batch_tokens": self.batch_tokens,
                "max_seqs": self.max_seqs, "source": self.source, "timings": self.timings,
                "fingerprint": self.fingerprint}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Plan:
        """The plan in ``d``; KeyError / TypeError / ValueError when it is not one."""
        def routes(name: str, entries: Any, allowed: tuple[str, ...]) -> RouteTable:
            rows = tuple((int(b), str(r)) for b, r in entries)
            if not rows or any(r not in allowed for _, r in rows):
                raise ValueError(f"plan: bad route table for {name!r}: {entries!r}")
            return rows

        def table(t: dict[str, Any]) -> dict[str, RouteTable]:
            return {str(name): routes(name, entries, GEMM_ROUTES) for name, entries in t.items()}

        return cls(gemm=table(d["gemm"]), int8_gemm=table(d["int8_gemm"]),
                   weight_only_max_rows=int(d["weight_only_max_rows"]),
                   prefill=routes("prefill", d["prefill"], PREFILL_ROUTES),
                   decode=routes("decode", d["decode"], DECODE_ROUTES),
                   row_grain=int(d.get("row_grain", DEFAULT_ROW_GRAIN)),
                   silu_grain=int(d.get("silu_grain", DEFAULT_SILU_GRAIN)),
                   batch_tokens=int(d.get("batch_tokens", 0)), max_seqs=int(d.get("max_seqs", 0)),
                   source=str(d.get("source", "cached")),
                   timings=dict(d.get("timings") or {}), fingerprint=dict(d.get("fingerprint") or {}))


def route_for(table: RouteTable, rows: int) -> str:
    """The route of the first bucket holding ``rows``; past the last, the last bucket's."""
    for bound, route in table:
        if rows <= bound:
            return route
    return table[-1][1]


def _uniform(route_rows: RouteTable) -> dict[str, RouteTable]:
    return dict.fromkeys(LINEARS, route_rows)


# The fallback (what the engine ran before it measured; each figure from one machine): carpool's GEMM
# up to 2048 rows, oneDNN above (a 2-core Zen 5), its blocks never cut between threads; weight-only
# int8 up to 4 rows (a 2-core Zen 4); flash attention only on AMX CPUs, for chunks of 12288 work
# (rows x keys seen) or more: on a 2-core Sapphire Rapids 64 new tokens after 144 cached cost the
# same both ways, 128 after 144 took 0.30 ms in flash vs 0.41 in the kernel, while on a Zen 4
# without AMX whole workloads ran faster with the kernel alone.
DEFAULT_CARPOOL_MAX_ROWS = 2048
_DEFAULT_GEMM: RouteTable = ((DEFAULT_CARPOOL_MAX_ROWS, "carpool"), (UNBOUNDED, "onednn"))
DEFAULT_WEIGHT_ONLY_MAX_ROWS = 4
DEFAULT_FLASH_MIN_WORK = 12288


def default_plan(has_amx: bool = False) -> Plan:
    prefill = ((DEFAULT_FLASH_MIN_WORK - 1, "kernel"), (UNBOUNDED, "flash")) if has_amx else ((UNBOUNDED, "kernel"),)
    return Plan(gemm=_uniform(_DEFAULT_GEMM), int8_gemm=_uniform(_DEFAULT_GEMM),
                weight_only_max_rows=DEFAULT_WEIGHT_ONLY_MAX_ROWS, prefill=prefill)


# ----------------------------------------------------------------------------- choosing


# A route other than the first of its kind's order must be this much faster to be chosen: timings
# on a busy machine wobble by a few percent, and a plan that flips between two routes that cost the
# same would differ from start to start for nothing.  (Where one route is really faster, as oneDNN
# on AMX tiles is by several times, the margin changes nothing.)
MARGIN = 0.03


def _fastest(times: dict[str, float], order: tuple[str, ...]) -> str:
    """The route of the smallest time, the first of ``order`` ahead by ``MARGIN``; routes not timed
    never win (none timed: the last of ``order``, the one that runs everywhere)."""
    timed = {r: t for r, t in times.items() if r in order and t is not None and t == t}
    if not timed:
        return order[-1]
    best = min(timed, key=lambda r: (timed[r], order.index(r)))
    first = order[0]
    if best != first and first in timed and timed[best] > timed[first] * (1 - MARGIN):
        return first
    return best


def _merge(entries: list[tuple[int, str]]) -> RouteTable:
    """Adjacent buckets of one route become one; the last is extended past every bucket."""
    out: list[tuple[int, str]] = []
    for bound, route in entries:
        if out and out[-1][1] == route:
            out[-1] = (bound, route)
        else:
            out.append((bound, route))
    out[-1] = (UNBOUNDED, out[-1][1])
    return tuple(out)


def choose_gemm(per_linear: dict[str, dict[str, dict[str, float]]]) -> dict[str, RouteTable]:
    """{linear: {rows: {route: seconds}}} -> {linear: route table} (rows as str or int keys)."""
    plan = {}
    for name, by_rows in per_linear.items():
        entries = [(int(rows), _fastest(times, GEMM_ROUTES)) for rows, times in by_rows.items()]
        if entries:
            plan[name] = _merge(sorted(entries))
    return plan


def choose_weight_only(by_rows: dict[str, dict[str, float]]) -> int:
    """The most rows up to which weight-only int8 was faster at every timed count (0: never)."""
    best = 0
    for rows, times in sorted(((int(r), t) for r, t in by_rows.items())):
        if _fastest(times, ("weight_only", "int8")) != "weight_only":
            break
        best = rows
    return best


def prefill_work(rows: int, cached: int) -> int:
    """A prefill chunk's attention work: its rows x the keys an average row sees."""
    return rows * (cached + (rows + 1) // 2)


def choose_prefill(points: list[dict[str, float]]) -> RouteTable:
    """Points {rows, cached, kernel, flash[, brgemm]} -> per bucket of work (``prefill_work``) the
    fastest route, each point's work the upper end of its bucket."""
    timed = sorted((prefill_work(int(p["rows"]), int(p["cached"])), i) for i, p in enumerate(points))
    return _merge([(work, _fastest(points[i], PREFILL_ROUTES)) for work, i in timed])


def choose_decode(points: list[dict[str, float]]) -> RouteTable:
    """Points {rows, keys, kernel, brgemm} (decode rows of ``keys`` keys each) -> per bucket of keys
    the fastest route."""
    return _merge(sorted((int(p["keys"]), _fastest(p, DECODE_ROUTES)) for p in points))


GRAIN_ROUTES = ("one", "split")  # one thread first: it wakes nobody and leaves the other core alone


def choose_grain(points: list[dict[str, float]]) -> int:
    """Points {rows, width, one, split} (one pass over rows x width values on one thread / on all)
    -> the values up to which a pass stays on one thread: the largest timed pass where one thread
    still won (0: splitting won everywhere).  Passes larger than any timed one split."""
    single = 0
    for p in points:
        if _fastest({"one": p["one"], "split": p["split"]}, GRAIN_ROUTES) == "one":
            single = max(single, int(p["rows"] * p["width"]))
    return single


def choose_batch_tokens(budget: dict[str, Any]) -> int:
    """The step's token budget for throughput, from whole steps of one and of ``many`` prefill
    chunks of ``chunk`` rows each ({chunk, one, many, seconds_one, seconds_many, max_tokens}).

    A step costs about ``fixed + per_row * rows``: the fixed part (every op's call and thread
    wake-up, the layers' weights read once, the step's Python) is paid once a step, so a budget of
    B tokens pays ``fixed / B`` per token on top of ``per_row``.  Both come from the two timed
    steps (chunks of the same length, so each row's attention costs the same in both).  The
    budget is the smallest of ``BATCH_TOKENS`` (up to ``max_tokens``, what memory allows) whose
    cost per token is within ``MARGIN`` of the largest one's: a larger step buys less than the
    timing noise and only holds more memory.  0 when the timings say nothing (the engine keeps
    ``DEFAULT_BATCH_TOKENS``)."""
    try:
        chunk, one, many = int(budget["chunk"]), int(budget["one"]), int(budget["many"])
        t1, tn = float(budget["seconds_one"]), float(budget["seconds_many"])
        cap = int(budget.get("max_tokens") or BATCH_TOKENS[-1])
    except (KeyError, TypeError, ValueError):
        return 0
    if many <= one or not (0 < t1 <= tn):
        return 0
    per_row = (tn - t1) / ((many - one) * chunk)
    fixed = max(0.0, t1 - per_row * one * chunk)
    sizes = [b for b in BATCH_TOKENS if b <= cap] or [BATCH_TOKENS[0]]
    best = fixed / sizes[-1] + per_row
    return next(b for b in sizes if fixed / b + per_row <= best * (1 + MARGIN))


def choose_max_seqs(seqs: dict[str, Any]) -> int:
    """How many sequences a step runs at most for throughput, from whole decode steps of each of
    ``SEQ_CHOICES`` rows ({"seconds": {rows: s}}): the fewest whose time per token is within
    ``MARGIN`` of the best one's.  A step's weights, calls and Python are paid once a step and
    shared by its rows; more rows than pay for that only hold more KV cache.  A decode row's
    attention reads its own keys at any batch size, so the timed rows attend to a few keys
    only and what is compared is the shared part.  0 when the timings say nothing (the engine
    keeps ``DEFAULT_MAX_SEQS``)."""
    try:
        per_token = {int(n): float(t) / int(n) for n, t in (seqs.get("seconds") or {}).items()}
    except (TypeError, ValueError, AttributeError):
        return 0
    per_token = {n: t for n, t in per_token.items() if n > 0 and t > 0}
    if not per_token:
        return 0
    best = min(per_token.values())
    return min(n for n, t in per_token.items() if t <= best * (1 + MARGIN))


def choose(timings: dict[str, Any], fallback: Plan | None = None) -> Plan:
    """The plan the timings call for (pure).  ``timings`` (as ``plan_measure.measure`` returns
    and the plan file keeps): ``gemm`` / ``int8_gemm``: {linear: {rows: {route: s}}},
    ``weight_only``: {rows: {"weight_only": s, "int8": s}}, ``prefill``: [{rows, cached, kernel,
    flash[, brgemm]}], ``decode``: [{rows, keys, kernel, brgemm}], ``grain``, ``budget``
    (``choose_batch_tokens``), ``seqs`` (``choose_max_seqs``).  A part that was not timed keeps
    ``fallback``'s (default: ``default_plan()``) routes."""
    base = fallback or default_plan()
    gemm = {**base.gemm, **choose_gemm(timings.get("gemm") or {})}
    int8 = {**base.int8_gemm, **choose_gemm(timings.get("int8_gemm") or {})}
    wo = timings.get("weight_only")
    prefill = timings.get("prefill")
    decode = timings.get("decode")
    grain = timings.get("grain") or {}
    return Plan(gemm=gemm, int8_gemm=int8,
                weight_only_max_rows=choose_weight_only(wo) if wo else base.weight_only_max_rows,
                prefill=choose_prefill(prefill) if prefill else base.prefill,
                decode=choose_decode(decode) if decode else base.decode,
                row_grain=_grain(grain.get("light"), base.row_grain),
                silu_grain=_grain(grain.get("silu"), base.silu_grain),
                batch_tokens=choose_batch_tokens(timings["budget"]) if timings.get("budget") else base.batch_tokens,
                max_seqs=choose_max_seqs(timings["seqs"]) if timings.get("seqs") else base.max_seqs,
                source="measured", timings=timings)


def _grain(points: list[dict[str, float]] | None, fallback: int) -> int:
    return choose_grain(points) if points else fallback


# ----------------------------------------------------------------------------- forcing


_NUMBER_KEYS = ("weight_only_max_rows", "row_grain", "silu_grain", "batch_tokens", "max_seqs")


def parse_overrides(text: str) -> dict[str, str]:
    """``"gemm=onednn,prefill=flash"`` -> a dict; ValueError naming the bad item and the choices.

    Keys: gemm (carpool|carpool_split|onednn, every bf16 linear), int8_gemm (the same), prefill
    (kernel|flash|brgemm: every prefill chunk's attention), decode (kernel|brgemm: every decode
    row's), and whole numbers weight_only_max_rows,
    row_grain and silu_grain (values a row-wise pass holds at most to run on one thread) and
    batch_tokens (the offline step budget; an engine given max_num_batched_tokens keeps it) and
    max_seqs (the offline sequences of a step; an engine given max_num_seqs keeps it).  The
    words "measure" (the default: the cached plan, else measured now), "remeasure" (measured now
    whatever is cached) and "default" (no measuring, the fallback plan) stand alone."""
    choices = {"gemm": GEMM_ROUTES, "int8_gemm": GEMM_ROUTES, "prefill": PREFILL_ROUTES, "decode": DECODE_ROUTES}
    out: dict[str, str] = {}
    for item in (s.strip() for s in text.split(",")):
        if not item or item in MODES:
            if item:
                out["mode"] = item
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in (*choices, *_NUMBER_KEYS):
            raise ValueError(f"engine plan override {item!r}: use KEY=VALUE with KEY one of "
                             f"{', '.join((*choices, *_NUMBER_KEYS))}, or one of {', '.join(MODES)}")
        if key in _NUMBER_KEYS:
            if not value.isdigit():
                raise ValueError(f"engine plan override {item!r}: {key} takes a whole number")
        elif value not in choices[key]:
            raise ValueError(f"engine plan override {item!r}: {key} must be one of {', '.join(choices[key])}")
        out[key] = value
    return out


def apply_overrides(plan: Plan, overrides: dict[str, str]) -> Plan:
    """``plan`` with the forced routes of ``overrides`` (``parse_overrides``) in place."""
    changes: dict[str, Any] = {}
    for key in ("gemm", "int8_gemm"):
        if key in overrides:
            changes[key] = _uniform(((UNBOUNDED, overrides[key]),))
    for key in ("prefill", "decode"):
        if key in overrides:
            changes[key] = ((UNBOUNDED, overrides[key]),)
    for key in _NUMBER_KEYS:
        if key in overrides:
            changes[key] = int(overrides[key])
    if not changes:
        return plan
    return replace(plan, source=plan.source + "+forced", **changes)
