"""Times the engine's candidate routes on the model's real shapes (``measure``), and finds the
plan for an engine: the cached one when it was measured on this machine, else measured now and
cached (``obtain``).

Every timing is the best of several calls, the candidates called in turns (``race``).  Only layer
0's linears are timed: every layer has the same shapes.  The whole measurement stops after
``BUDGET_S`` seconds; what was not timed by then keeps the fallback plan's routes.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from . import cpu, decode_gemm, plan_cache
from .plan import (
    BATCH_TOKENS,
    ROW_BUCKETS,
    SEQ_CHOICES,
    WEIGHT_ONLY_ROWS,
    Plan,
    apply_overrides,
    choose,
    default_plan,
    parse_overrides,
)
from .quant import Int8Linear, quantize_rows

if TYPE_CHECKING:
    from .model import Linear, LlamaModel
    from .ops import Kernels

log = logging.getLogger("carpool.engine")
BUDGET_S = 12.0
PLAN_ENV = "CARPOOL_ENGINE_PLAN"
# Prefill chunks timed for the flash threshold: (new rows, cached tokens before them).
PREFILL_POINTS = ((16, 0), (64, 0), (64, 144), (128, 144), (256, 0), (512, 0), (512, 512), (1024, 0), (2048, 0))


class _Clock:
    def __init__(self, budget_s: float):
        self.deadline = time.perf_counter() + budget_s

    @property
    def out(self) -> bool:
        return time.perf_counter() > self.deadline


# Each race runs its routes in turns (a, b, a, b, ...) for at least MIN_ROUNDS rounds and
# MIN_RACE_S seconds (at most MAX_RACE_S): on a shared machine a call that loses its core for a
# time slice takes 10-20 ms, and in turns such a slice hits either route alike; the best call of
# each is what both cost undisturbed.
MIN_ROUNDS = 5
MIN_RACE_S = 0.03
MAX_RACE_S = 0.4


def race(fns: dict[str, Callable[[], Any]], at_least: int = 1) -> dict[str, float]:
    """The best time (seconds) of each function, called in turns after one warm-up call each
    (oneDNN builds its primitive for a new row count on the first call), in at least ``at_least``
    rounds whatever they take."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    t_start = time.perf_counter()
    rounds = 0
    while True:
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
        rounds += 1
        spent = time.perf_counter() - t_start
        if rounds >= at_least and (spent > MAX_RACE_S or (rounds >= MIN_ROUNDS and spent >= MIN_RACE_S)):
            return best


# The most rows a GEMM bucket or a prefill point is timed at.  Past it every linear is long
# compute-bound, so a larger step runs at the last bucket's rate and takes its routes; the plan of
# a larger step budget is the same as this one's (``model_shapes``).
MAX_TIMED_ROWS = ROW_BUCKETS[-1]


def _buckets(limit: int) -> list[int]:
    top = min(limit, MAX_TIMED_ROWS)
    return sorted({b for b in ROW_BUCKETS if b < top} | {top})


def splits(n: int, rows: int) -> bool:
    """Whether cutting the blocks' rows can change a GEMM of ``n`` columns x ``rows`` rows here: the
    32-column blocks do not divide evenly between the threads, and there are rows to cut."""
    return (n // decode_gemm.BLOCK) % torch.get_num_threads() != 0 and rows > 1


def _time_bf16(lin: Linear, k: Kernels, rows: int) -> dict[str, float]:
    x = torch.randn(rows, lin.weight.shape[1]).to(torch.bfloat16)
    assert lin.decode_packed is not None and lin.packed is not None
    packed, dense = lin.decode_packed, lin.packed
    fns = {"carpool": lambda: k.bf16_gemm(x, packed, lin.n),
           "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, dense, None, "none", [], "")}
    if splits(lin.n, rows):
        fns["carpool_split"] = lambda: k.bf16_gemm(x, packed, lin.n, split_rows=True)
    return race(fns)


def _time_int8(w: Int8Linear, k: Kernels, rows: int) -> dict[str, float]:
    xq = torch.randint(-127, 128, (rows, w.shape[1]), dtype=torch.int8)
    xs = torch.rand(rows) * 1e-2
    packed, n = w.packed, w.shape[0]
    assert packed is not None

    def carpool(split: bool) -> Callable[[], Any]:
        return lambda: k.int8_gemm_dequant(xq, packed, n, xs, w.scale_f32, None, w.dtype, split_rows=split)

    fns = {"carpool": carpool(False),
           "onednn": lambda: k.int8_dequantize(w.int_mm(xq), xs, w.scale_f32, None, w.dtype)}
    if splits(n, rows):
        fns["carpool_split"] = carpool(True)
    if w.pack_qlinear():  # oneDNN's prepacked int8 linear: AMX-INT8 where the CPU has it
        fns["onednn_qlinear"] = lambda: k.int8_dequantize(w.qlinear_sums(xq), xs, w.scale_f32, None, w.dtype)
    return race(fns)


def _gemm_timings(model: LlamaModel, k: Kernels, max_rows: int, clock: _Clock) -> dict[str, Any]:
    out: dict[str, Any] = {}
    lin0 = {**model.linears[0], "head": model.head_linear}
    w0: dict[str, Any] = {n: model.layers[0][n] for n in ("qkv", "o", "gate_up", "down")}
    w0["head"] = model.head
    for name, lin in lin0.items():
        # The head runs only on the rows that sample: one a sequence, as many as a step may run.
        limit = min(max_rows, SEQ_CHOICES[-1]) if name == "head" else max_rows
        for rows in _buckets(limit):
            if clock.out:
                return out
            if lin.decode_packed is not None and lin.packed is not None and k.has_bf16_gemm:
                out.setdefault("gemm", {}).setdefault(name, {})[str(rows)] = _time_bf16(lin, k, rows)
            w = w0[name]
            if isinstance(w, Int8Linear) and w.packed is not None and k.has_int8_gemm and hasattr(torch, "_int_mm"):
                out.setdefault("int8_gemm", {}).setdefault(name, {})[str(rows)] = _time_int8(w, k, rows)
    return out


def _time_weight_only(ws: list[Int8Linear], xs: list[torch.Tensor], k: Kernels) -> dict[str, float]:
    def weight_only() -> None:
        for w, x in zip(ws, xs, strict=True):
            torch.ops.aten._weight_int8pack_mm(x, w.qweight, w.scale)

    def int8() -> None:
        for w, x in zip(ws, xs, strict=True):
            xq, s = quantize_rows(x)
            w.matmul(xq, s, k)

    return race({"weight_only": weight_only, "int8": int8})


def _weight_only_timings(model: LlamaModel, k: Kernels, clock: _Clock) -> dict[str, Any]:
    """Per row count, a layer's four linears weight-only vs quantized rows + the int8 GEMM."""
    ws = [w for w in (model.layers[0][n] for n in ("qkv", "o", "gate_up", "down")) if isinstance(w, Int8Linear)]
    if len(ws) < 4 or not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return {}
    out: dict[str, Any] = {}
    for rows in WEIGHT_ONLY_ROWS:
        if clock.out:
            break
        out[str(rows)] = _time_weight_only(ws, [torch.randn(rows, w.shape[1]).to(model.dtype) for w in ws], k)
    return {"weight_only": out}


def _random_cache(model: LlamaModel, blocks: int, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V caches of ``blocks`` blocks of 16, holding random keys and values: read
    from memory as a real context is (a zeroed, never written cache maps one shared zero page)."""
    k_cache, v_cache = model.allocate_kv_cache(blocks, 16, kv_cache_dtype)[0]
    if kv_cache_dtype != "int8":  # an int8 cache's rows end in scales: left zero, as before
        k_cache.normal_()
        v_cache.normal_()
    return k_cache, v_cache


def _time_prefill(model: LlamaModel, k: Kernels, n: int, c: int, kv_cache_dtype: str,
                  brgemm: bool) -> dict[str, float]:
    """One layer's attention over a chunk of n new rows after c cached tokens: the SIMD kernel,
    flash attention and (where it runs) the brgemm route."""
    hq, hkv, d = model.num_heads, model.num_kv_heads, model.head_dim
    nb = -(-(n + c) // 16)
    k_cache, v_cache = _random_cache(model, nb, kv_cache_dtype)
    qkv = torch.randn(n, (hq + 2 * hkv) * d).to(model.dtype)
    slots = torch.arange(c, c + n)
    tables = torch.arange(nb).unsqueeze(0)
    none = torch.zeros(0, dtype=torch.long)
    rows_seq, rows_ctx = torch.zeros(n, dtype=torch.long), torch.arange(c + 1, c + n + 1)

    def kernel() -> None:
        k.attention(qkv, k_cache, v_cache, slots, tables, rows_seq, rows_ctx, n, none.view(0, 5), hq, model.scale)

    def chunk(route: int) -> Callable[[], Any]:
        one = torch.tensor([[0, n, 0, c, route]])
        return lambda: k.attention(qkv, k_cache, v_cache, slots, tables, none, none, 0, one, hq, model.scale)

    fns = {"kernel": kernel, "flash": chunk(0)}
    if brgemm:
        fns["brgemm"] = chunk(1)
    return race(fns)


def brgemm_runs(k: Kernels, dtype: torch.dtype, kv_cache_dtype: str) -> bool:
    """Whether ATen's brgemm runs attention for a model of ``dtype`` here: it multiplies the
    cache as it is stored, so an int8 cache never takes that route."""
    return kv_cache_dtype != "int8" and k.brgemm_attention_runs(dtype)


def _prefill_timings(model: LlamaModel, k: Kernels, max_rows: int, max_len: int, kv_cache_dtype: str,
                     clock: _Clock) -> dict[str, Any]:
    points = []
    brgemm = brgemm_runs(k, model.dtype, kv_cache_dtype)
    for n, c in PREFILL_POINTS:
        if n > max_rows or n + c > max_len or clock.out:
            continue
        points.append({"rows": n, "cached": c, **_time_prefill(model, k, n, c, kv_cache_dtype, brgemm)})
    return {"prefill": points} if points else {}


# Decode steps timed for the decode route: (rows, keys each row sees).
DECODE_POINTS = ((32, 64), (32, 256), (32, 1024), (32, 2048))


def _time_decode(model: LlamaModel, k: Kernels, rows: int, keys: int, kv_cache_dtype: str) -> dict[str, float]:
    """One layer's attention of ``rows`` decode rows, each of its own sequence of ``keys`` keys."""
    hq, hkv, d = model.num_heads, model.num_kv_heads, model.head_dim
    per_seq = -(-keys // 16)
    k_cache, v_cache = _random_cache(model, rows * per_seq, kv_cache_dtype)
    qkv = torch.randn(rows, (hq + 2 * hkv) * d).to(model.dtype)
    tables = torch.arange(rows * per_seq).view(rows, per_seq)
    slots = tables[:, (keys - 1) // 16] * 16 + (keys - 1) % 16
    seqs, ctx = torch.arange(rows), torch.full((rows,), keys, dtype=torch.long)
    none = torch.zeros(0, dtype=torch.long)
    chunks = torch.tensor([[i, 1, i, keys - 1, 1] for i in range(rows)], dtype=torch.long)
    return race({"kernel": lambda: k.attention(qkv, k_cache, v_cache, slots, tables, seqs, ctx, rows,
                                               none.view(0, 5), hq, model.scale),
                 "brgemm": lambda: k.attention(qkv, k_cache, v_cache, slots, tables, none, none, 0, chunks, hq,
                                               model.scale)})


def _decode_timings(model: LlamaModel, k: Kernels, max_len: int, kv_cache_dtype: str,
                    clock: _Clock) -> dict[str, Any]:
    if not brgemm_runs(k, model.dtype, kv_cache_dtype):
        return {}  # one route: nothing to choose
    points = []
    for rows, keys in DECODE_POINTS:
        if keys > max_len or clock.out:
            continue
        points.append({"rows": rows, "keys": keys, **_time_decode(model, k, rows, keys, kv_cache_dtype)})
    return {"decode": points} if points else {}


# Row counts a row-wise pass is timed at, one thread against all (the thread-grain limits).
GRAIN_ROWS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048)
_NEVER_SPLIT = 1 << 40


def _time_grain(op: Callable[[], Any], set_limit: Callable[[int], None]) -> dict[str, float]:
    def on(limit: int) -> Callable[[], None]:
        def call() -> None:
            set_limit(limit)
            op()
        return call

    return race({"one": on(_NEVER_SPLIT), "split": on(0)})


def _grain_timings(model: LlamaModel, k: Kernels, max_rows: int, clock: _Clock) -> dict[str, Any]:
    """Per row count, residual add + RMSNorm at the hidden width and SiLU * up at the MLP's, each
    run on one thread and split between all (``Kernels.set_row_grains``; the caller restores)."""
    if torch.get_num_threads() < 2:
        return {}
    hidden, inter = model.config.hidden_size, model.config.intermediate_size
    w = model.layers[0]["ln2"]
    light, silu = [], []
    for rows in (r for r in GRAIN_ROWS if r <= max(max_rows, GRAIN_ROWS[0])):
        if clock.out:
            break
        x, r = torch.randn(rows, hidden).to(model.dtype), torch.randn(rows, hidden).to(model.dtype)
        gu = torch.randn(rows, 2 * inter).to(model.dtype)
        norm = _time_grain(functools.partial(k.add_rms_norm, x, r, w, model.eps),
                           lambda v: k.set_row_grains(v, _NEVER_SPLIT))
        light.append({"rows": rows, "width": hidden, **norm})
        silu.append({"rows": rows, "width": inter, **_time_grain(functools.partial(k.silu_mul, gu),
                                                                 lambda v: k.set_row_grains(_NEVER_SPLIT, v))})
    return {"grain": {"light": light, "silu": silu}} if light else {}


PASSES = 2


def _best_of(a: Any, b: Any) -> Any:
    """Two passes' timings merged: the smaller of each time (what only one pass has, kept)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {key: _best_of(a[key], b[key]) if key in a and key in b else a.get(key, b.get(key))
                for key in {**a, **b}}
    if isinstance(a, list) and isinstance(b, list):  # prefill points, in the same order in both passes
        return [_best_of(x, y) for x, y in zip(a, b, strict=False)] + a[len(b):]
    if isinstance(a, float) and isinstance(b, float):
        return min(a, b)
    return a


@torch.inference_mode()
def measure(model: LlamaModel, k: Kernels, max_rows: int, max_len: int,
            kv_cache_dtype: str = "auto", budget_s: float = BUDGET_S) -> dict[str, Any]:
    """The timings ``plan.choose`` reads (seconds), taken now on this machine."""
    clock = _Clock(budget_s)
    t0 = time.perf_counter()
    timings: dict[str, Any] = {}
    # Two passes, seconds apart, each time the better of the two: a stretch of the other core
    # being busy elsewhere spoils a pass's timings of a few shapes, rarely both passes' of the same.
    grains = k.row_grains()
    try:
        for _ in range(PASSES):
            one = _gemm_timings(model, k, max_rows, clock)
            one.update(_weight_only_timings(model, k, clock))
            one.update(_prefill_timings(model, k, max_rows, max_len, kv_cache_dtype, clock))
            one.update(_decode_timings(model, k, max_len, kv_cache_dtype, clock))
            one.update(_grain_timings(model, k, max_rows, clock))
            timings = _best_of(timings, one) if timings else one
    finally:
        k.set_row_grains(*grains)
    timings["seconds"] = round(time.perf_counter() - t0, 3)
    timings["complete"] = not clock.out
    return timings


# The whole steps the token budget is chosen from (``plan.choose_batch_tokens``): one prompt chunk
# of BUDGET_CHUNK rows, then BUDGET_CHUNKS of them (~0.1 and ~0.3 s for SmolLM2 on a 2-core Zen 4).
BUDGET_CHUNK = 128
BUDGET_CHUNKS = 4
BUDGET_ROUNDS = 3
# A step's activations may take at most this share of the machine's memory.
BUDGET_MEMORY_SHARE = 1 / 16


def max_batch_tokens(model: LlamaModel) -> int:
    """The largest of ``plan.BATCH_TOKENS`` whose step activations fit this machine's memory
    share: per row the q|k|v, attention, gate|up, SiLU * up and a few hidden-wide rows at once."""
    c = model.config
    elem = torch.empty((), dtype=model.dtype).element_size()
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    per_row = elem * (2 * qkv + 6 * c.hidden_size + 3 * c.intermediate_size)
    ram = memory_bytes()
    if ram is None:  # not Linux: the default budget only
        return BATCH_TOKENS[0]
    fits = [b for b in BATCH_TOKENS if b * per_row <= ram * BUDGET_MEMORY_SHARE]
    return fits[-1] if fits else BATCH_TOKENS[0]


# Where a container's memory limit is written: cgroup v2, then v1.
CGROUP_MEMORY_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def memory_bytes(limits: tuple[str, ...] = CGROUP_MEMORY_LIMITS) -> int | None:
    """The memory this process may use: the machine's, or its container's limit where lower
    (a pod given 4 GiB on a 512 GiB host must size its steps for 4).  None: not Linux."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    for path in limits:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (v2) means no limit; v1 writes a huge number for none
            ram = min(ram, int(text))
    return ram


def budget_timings(step: Callable[[int], None], max_tokens: int) -> dict[str, Any]:
    """Whole steps of 1 and of BUDGET_CHUNKS fresh prompt chunks (``step(n)`` runs one), in turns."""
    t = race({"one": lambda: step(1), "many": lambda: step(BUDGET_CHUNKS)}, at_least=BUDGET_ROUNDS)
    return {"chunk": BUDGET_CHUNK, "one": 1, "many": BUDGET_CHUNKS, "seconds_one": t["one"],
            "seconds_many": t["many"], "max_tokens": max_tokens}


def seqs_timings(decode: Callable[[int], None]) -> dict[str, Any]:
    """Whole decode steps of each of ``SEQ_CHOICES`` rows (``decode(n)`` runs one), in turns."""
    return {"seconds": race({str(n): functools.partial(decode, n) for n in SEQ_CHOICES}, at_least=BUDGET_ROUNDS)}


# A plan holds for any max_num_seqs and step budget up to MAX_TIMED_ROWS: it times the head up to
# the most sequences a step may run, and the sequences a step runs are chosen from it.
def model_shapes(model: LlamaModel, max_rows: int, max_len: int, kv_cache_dtype: str) -> dict[str, Any]:
    c = model.config
    return {"hidden": c.hidden_size, "intermediate": c.intermediate_size, "heads": c.num_attention_heads,
            "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim, "vocab": c.vocab_size,
            "layers": c.num_hidden_layers, "bias": model.layers[0]["qkv_bias"] is not None,
            "dtype": str(model.dtype), "quantization": model.quantization, "kv_cache_dtype": kv_cache_dtype,
            "max_rows": min(max_rows, MAX_TIMED_ROWS), "max_len": max_len}


def obtain(model: LlamaModel, k: Kernels, max_rows: int, max_len: int, kv_cache_dtype: str = "auto",
           setting: str | None = None, remeasure: bool = False,
           step: Callable[[Plan, int], None] | None = None,
           decode: Callable[[Plan, int], None] | None = None) -> Plan:
    """The plan for this engine: ``setting`` (else $CARPOOL_ENGINE_PLAN; ``plan.parse_overrides``)
    "default" takes the fallback plan, otherwise the cached plan of this machine and model or,
    when there is none (or ``remeasure``), one measured now and cached; forced routes on top.
    ``step(plan, n)`` runs one whole step of n fresh prompt chunks of ``BUDGET_CHUNK`` rows on
    the plan's routes: what the step's token budget is chosen from (none: not chosen);
    ``decode(plan, n)`` one whole decode step of n sequences: what the sequences a step runs at
    most are chosen from (none: not chosen)."""
    overrides = parse_overrides(setting if setting is not None else os.environ.get(PLAN_ENV, ""))
    fallback = default_plan(has_amx=cpu.has("amx_bf16"))
    if overrides.get("mode") == "default":
        return apply_overrides(fallback, overrides)
    shapes = model_shapes(model, max_rows, max_len, kv_cache_dtype)
    path = plan_cache.plan_path(shapes, k.cache_dir)
    fingerprint = plan_cache.model_fingerprint(shapes)
    remeasure = remeasure or overrides.get("mode") == "remeasure"
    plan = None if remeasure else plan_cache.load(path, fingerprint)
    if plan is not None:  # chosen again from its timings: the file keeps them, the choice is this code's
        plan = Plan(**{**choose(plan.timings, fallback).__dict__, "fingerprint": fingerprint, "source": "cached"})
    else:
        log.warning("measuring the engine's routes on this CPU (%s) for this model: once per machine, "
                    "at most %.0f s and a few whole steps (`carpool engine prepare` does it ahead); the plan "
                    "is kept in %s", fingerprint["cpu"], BUDGET_S, path)
        timings = measure(model, k, max_rows, max_len, kv_cache_dtype)
        chosen = choose(timings, fallback)
        t0 = time.perf_counter()
        # On the routes just chosen: the steps the engine will run.
        if step is not None:
            timings["budget"] = budget_timings(functools.partial(step, chosen), max_batch_tokens(model))
        if decode is not None:
            timings["seqs"] = seqs_timings(functools.partial(decode, chosen))
        if step is not None or decode is not None:
            timings["seconds"] = round(timings["seconds"] + time.perf_counter() - t0, 3)
            chosen = choose(timings, fallback)
        plan = Plan(**{**chosen.__dict__, "fingerprint": fingerprint})
        try:
            plan_cache.save(path, plan)
        except OSError as e:  # a read-only cache: the plan still holds for this process
            log.warning("engine plan not saved to %s (%s)", path, e)
        log.info("engine plan measured in %.1f s", timings["seconds"])
    return apply_overrides(plan, overrides)
