"""How long one engine step takes: a roofline model, a profiled (fitted) model and a linear
one set by hand (for tests that need a server, not a machine).

A step is one forward pass over a batch that mixes prefill chunks and decode tokens.
Its shape is what the scheduler decided: prefill tokens, decode tokens, the KV tokens
attention reads, the (query, key) pairs attention computes, and the number of
sequences that produce logits.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

import numpy as np

from carpool.tune.hardware import Accelerator
from carpool.tune.models import ModelSpec


@dataclass
class StepShape:
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    kv_tokens_read: int = 0  # sum over scheduled sequences of the context they attend to
    attn_pairs: int = 0  # sum of (query, key) pairs: a chunk of c at offset o gives c*o + c*(c+1)/2
    num_seqs: int = 0  # sequences scheduled (each samples at most one token)
    # As the engine's old pure-torch attention path computed it: single-token queries padded to
    # the longest context among them, prefill chunks to the longest chunk and longest context.
    # Kept for the padded (static / dynamic) batching modes; the profiled model no longer uses it.
    kv_tokens_padded: int = 0
    attn_pairs_padded: int = 0
    # Rows that produce logits (decodes plus the prefill chunks that finish a prompt).
    # None: every scheduled sequence samples.
    num_logits: int | None = None
    # K/V vectors the paged-attention kernel streams: per block of up to KERNEL_ROWS query rows
    # of one sequence it reads the longest context in the block once.  None: kv_tokens_read.
    kv_loads: int | None = None

    @classmethod
    def of(cls, chunks: list[tuple[int, int]], num_decode: int | None = None,
           num_logits: int | None = None) -> StepShape:
        """The shape of a step computing ``n`` tokens after ``old`` cached ones, per (old, n).

        ``num_decode``: how many count as decode tokens (default: the single-token chunks).
        ``num_logits``: how many rows sample a token (default: every chunk)."""
        # One pass: the simulators shape every step they time.
        tokens = kv = pairs = loads = 0
        num_dec = dec_ctx = num_pf = pf_ctx = pf_chunk = 0
        for old, n in chunks:
            tokens += n
            kv += old + n
            if n == 1:  # a single-token query attends to its whole context once
                pairs += old + 1
                loads += old + 1
                num_dec += 1
                dec_ctx = max(dec_ctx, old + 1)
            else:
                pairs += attn_pairs(old, n)
                loads += kernel_kv_loads(old, n)
                num_pf += 1
                pf_ctx = max(pf_ctx, old + n)
                pf_chunk = max(pf_chunk, n)
        s = cls(num_seqs=len(chunks), kv_tokens_read=kv, attn_pairs=pairs, kv_loads=loads,
                kv_tokens_padded=num_dec * dec_ctx + num_pf * pf_ctx,
                attn_pairs_padded=num_dec * dec_ctx + num_pf * pf_chunk * pf_ctx)
        s.num_decode_tokens = num_dec if num_decode is None else num_decode
        s.num_prefill_tokens = tokens - s.num_decode_tokens
        s.num_logits = len(chunks) if num_logits is None else num_logits
        return s

    @property
    def logits_rows(self) -> int:
        return self.num_seqs if self.num_logits is None else self.num_logits

    @property
    def kv_loaded(self) -> int:
        return self.kv_tokens_read if self.kv_loads is None else self.kv_loads

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


class CostModel(Protocol):
    def step_time(self, shape: StepShape) -> float: ...

    def kv_capacity_tokens(self) -> int | None: ...

    def describe(self) -> dict: ...


@dataclass
class RooflineCost:
    """A step is its linear layers, then its attention, each as long as the larger of its
    bytes / bandwidth and its FLOPs / peak, plus all-reduces and host overhead.

    The two run as separate kernels one after the other, so their times add: a decode step
    of a large batch whose GEMMs are compute-bound still streams the KV cache afterwards.
    Peak and bandwidth are the datasheet's times what the part was measured to reach
    (``Accelerator.matmul_reach``/``bandwidth_reach``) times the efficiencies here.
    Tensor parallel over ``num_gpus`` splits weights, KV heads and FLOPs evenly and adds
    two ring all-reduces of the activations per layer (after attention and after the MLP).
    A mixture of experts reads only the experts its step's tokens were routed to.
    """

    accel: Accelerator
    model: ModelSpec
    num_gpus: int = 1
    # Fractions of what the part reaches in a microbenchmark that a serving step's kernels
    # reach: smaller GEMM shapes, attention over paged blocks.  On a part that reaches the
    # typical fraction of its datasheet these are 0.6 of its FLOPs and 0.8 of its bandwidth.
    mem_efficiency: float = 0.88
    compute_efficiency: float = 0.81
    overhead_ms: float | None = None  # None: the accelerator's step_overhead_ms
    # Each layer's dozen kernels start and drain around the weights they stream (a ramp and a
    # tail even inside a CUDA graph): a fixed cost per layer per step that a bandwidth roofline
    # misses, and what keeps a small model on a fast part from reaching its bandwidth bound.
    # Set, with seq_overhead_us, from the published measurements in benchmarks/published
    # (the ones marked calibration: vLLM's CI latency runs on H200, an A100 concurrency sweep,
    # and AMD's 70B throughput row); see docs/tune.md.
    layer_overhead_us: float = 55.0
    # Host work per running sequence per step (scheduling it, preparing its inputs, handling
    # its token) that the GPU waits for; it is what holds a batch of thousands of sequences
    # well under the GPU's roofline, and costs a batch of tens a few percent.
    seq_overhead_us: float = 21.0
    bytes_per_param: float | None = None  # None: the model's (2 for bf16, 1 for an fp8 checkpoint)
    kv_bytes_per_elem: float = 2.0
    gpu_memory_utilization: float = 0.9  # as vLLM: fraction of memory for weights + KV
    activation_reserve_gb: float = 1.0  # per GPU, for activations and CUDA graphs

    def __post_init__(self) -> None:
        if self.num_gpus < 1:
            raise ValueError("num_gpus must be >= 1")
        if self.model.num_heads % self.num_gpus:
            raise ValueError(
                f"{self.model.name} has {self.model.num_heads} attention heads, not divisible "
                f"by --gpus {self.num_gpus}: choose a tensor-parallel size that divides it"
            )

    # Per-GPU shares: KV heads are replicated when there are fewer than GPUs.
    def _kv_bytes_per_token_per_gpu(self) -> float:
        heads = max(self.model.num_kv_heads / self.num_gpus, 1.0)
        return self.model.kv_bytes_per_token(self.kv_bytes_per_elem) * heads / self.model.num_kv_heads

    @property
    def _param_bytes(self) -> float:
        return self.model.bytes_per_param if self.bytes_per_param is None else self.bytes_per_param

    def weight_bytes_per_gpu(self, num_tokens: int | None = None) -> float:
        """Weights one GPU reads for a step of ``num_tokens`` (None: all the experts)."""
        return self.model.weight_bytes(self._param_bytes, num_tokens) / self.num_gpus

    def resident_bytes_per_gpu(self) -> float:
        """Weights one GPU holds: all of them, the embedding table (gathered, not read) too."""
        return self.model.num_params * self._param_bytes / self.num_gpus

    def parts(self, s: StepShape) -> dict:
        """Seconds of the step by what bounds them: the linear layers' and the attention's
        memory and compute times (each phase takes the larger of its two), all-reduce, host."""
        m, n, a = self.model, self.num_gpus, self.accel
        bandwidth = a.bytes_per_s * a.bandwidth_reach * self.mem_efficiency
        reach = a.matmul_reach * self.compute_efficiency
        linear_flops = (s.num_tokens * m.flops_per_token() + s.num_seqs * m.lm_head_flops()) / n
        # Attention multiplies activations by the cache in 16 bits whatever the weights' width.
        attn_flops = s.attn_pairs * m.attn_flops_per_pair() / n
        t_comm = 0.0
        if n > 1 and s.num_tokens:
            msg = s.num_tokens * m.hidden_size * 2.0  # bf16 activations
            ring = 2.0 * (n - 1) / n * msg / a.allreduce_bytes_per_s
            t_comm = 2 * m.num_layers * (ring + a.link_latency_us * 1e-6)
        overhead = (a.step_overhead_ms if self.overhead_ms is None else self.overhead_ms) / 1e3
        overhead += (m.num_layers * self.layer_overhead_us + s.num_seqs * self.seq_overhead_us) * 1e-6
        return {
            "linear_memory_s": self.weight_bytes_per_gpu(s.num_tokens) / bandwidth,
            "linear_compute_s": linear_flops / (a.matmul_flops_per_s(self._param_bytes, m.weight_only) * reach),
            "attention_memory_s": s.kv_tokens_read * self._kv_bytes_per_token_per_gpu() / bandwidth,
            "attention_compute_s": attn_flops / (a.flops_per_s * reach),
            "comm_s": t_comm, "overhead_s": overhead,
        }

    @staticmethod
    def _phase(p: dict, name: str) -> tuple[float, str]:
        """A phase's time (the larger of its memory and compute times) and which of the two it is."""
        memory, compute = p[f"{name}_memory_s"], p[f"{name}_compute_s"]
        return (memory, "memory") if memory >= compute else (compute, "compute")

    def step_time(self, shape: StepShape) -> float:
        p = self.parts(shape)
        return self._phase(p, "linear")[0] + self._phase(p, "attention")[0] + p["comm_s"] + p["overhead_s"]

    def bound(self, shape: StepShape) -> str:
        """What bounds the longer of the step's two phases."""
        p = self.parts(shape)
        return max(self._phase(p, "linear"), self._phase(p, "attention"), key=lambda t: t[0])[1]

    def kv_capacity_tokens(self) -> int | None:
        per_gpu = self.accel.memory_gb * 1e9 * self.gpu_memory_utilization
        free = per_gpu - self.resident_bytes_per_gpu() - self.activation_reserve_gb * 1e9
        if free <= 0:
            return 0
        return int(free / self._kv_bytes_per_token_per_gpu())

    def describe(self) -> dict:
        return {
            "kind": "roofline", "accelerator": self.accel.name, "model": self.model.name,
            "num_gpus": self.num_gpus, "mem_efficiency": self.mem_efficiency,
            "compute_efficiency": self.compute_efficiency,
            "matmul_reach": round(self.accel.matmul_reach, 3), "bandwidth_reach": round(self.accel.bandwidth_reach, 3),
            "weights_gb_per_gpu": round(self.resident_bytes_per_gpu() / 1e9, 2),
            "kv_capacity_tokens": self.kv_capacity_tokens(),
        }


@dataclass
class ScaledCost:
    """Another cost model with every step ``factor`` times as long: the machine running
    slower (> 1) or faster (< 1) than the model says.  Near saturation a few percent of
    speed moves the tail latency by tens of percent; this is how to see by how much."""

    base: CostModel
    factor: float

    def step_time(self, shape: StepShape) -> float:
        return self.base.step_time(shape) * self.factor

    def kv_capacity_tokens(self) -> int | None:
        return self.base.kv_capacity_tokens()

    def describe(self) -> dict:
        return {**self.base.describe(), "speed_factor": self.factor}


@dataclass
class LinearCost:
    """step time = ``step_s`` + ``decode_s`` per decode token + ``prefill_s`` per prefill token.

    Set by hand rather than fitted: the simulated server the limiter's tests run against
    (``carpool.testing.batch_sim``) needs a step whose cost grows with the batch with
    diminishing returns per request, and nothing more.  No KV limit."""

    step_s: float
    decode_s: float
    prefill_s: float

    def step_time(self, shape: StepShape) -> float:
        return self.step_s + self.decode_s * shape.num_decode_tokens + self.prefill_s * shape.num_prefill_tokens

    def kv_capacity_tokens(self) -> int | None:
        return None

    def describe(self) -> dict:
        return {"kind": "linear", "step_s": self.step_s, "decode_s": self.decode_s, "prefill_s": self.prefill_s}


FEATURES = ("base", "prefill", "decode", "kv", "pairs", "seqs", "logits")


def _features(s: StepShape) -> list[float]:
    # As carpool's engine runs a step with its C++ extension (the default): the matmuls scale
    # with the tokens, the paged-attention kernel reads each row block's context once (kv)
    # and computes every (query, key) pair with no padding (pairs, in thousands so the
    # coefficients have similar magnitudes), per-sequence work builds the block tables and
    # metadata (seqs), and the lm_head plus sampling run only on the rows that sample (logits).
    return [1.0, s.num_prefill_tokens, s.num_decode_tokens, s.kv_loaded, s.attn_pairs / 1e3,
            s.num_seqs, s.logits_rows]


@dataclass
class ProfiledCost:
    """step time = base + a*prefill tokens + b*decode tokens + c*KV vectors the attention
    kernel loads + d*(query, key) pairs/1e3 + e*sequences + f*logits rows, counted as carpool's
    engine computes them with its paged-attention kernel (no padding; ``StepShape.of``).

    Fitted by non-negative least squares on (shape, measured duration) samples from
    carpool's engine, so it predicts that engine on this machine and no other.
    """

    coef: dict[str, float] = field(default_factory=dict)
    kv_tokens: int | None = None
    name: str = "profiled"
    fit_info: dict = field(default_factory=dict)

    def step_time(self, shape: StepShape) -> float:
        x = _features(shape)
        return max(sum(self.coef.get(k, 0.0) * v for k, v in zip(FEATURES, x, strict=False)), 1e-6)

    def kv_capacity_tokens(self) -> int | None:
        return self.kv_tokens

    def describe(self) -> dict:
        return {"kind": "profiled", "name": self.name, "coef": self.coef, "kv_capacity_tokens": self.kv_tokens,
                **self.fit_info}

    @classmethod
    def fit(cls, samples: Sequence[tuple[StepShape, float]], kv_tokens: int | None = None,
            name: str = "profiled", features: Sequence[str] = FEATURES, robust: bool = True) -> ProfiledCost:
        """Fit on samples; ``features`` picks which terms may be non-zero.

        ``robust``: on a shared machine a few steps are stretched many times over by other
        processes.  The coefficients come from a Huber-weighted fit (the spikes do not bend
        the shape), then one scale factor restores the mean step time, which is what
        throughput depends on.
        """
        if len(samples) < len(features):
            raise ValueError(f"need at least {len(features)} step samples to fit, got {len(samples)}")
        feats = [_features(s) for s, _ in samples]
        # A term that is constant over the samples cannot be told apart from base (and one
        # that is zero throughout has nothing to fit): leave it out rather than split base.
        features = [f for f in features if f == "base"
                    or len({row[FEATURES.index(f)] for row in feats}) > 1]
        cols = [FEATURES.index(f) for f in features]
        x = np.array([[row[c] for c in cols] for row in feats], dtype=float)
        y = np.array([d for _, d in samples], dtype=float)
        w = np.ones_like(y)
        level = 1.0
        beta = nnls(x, y)
        if robust:
            for _ in range(10):  # iteratively reweighted least squares, Huber weights
                r = y - x @ beta
                scale = 1.4826 * np.median(np.abs(r - np.median(r))) or 1e-12
                w = np.minimum(1.0, 1.345 * scale / np.maximum(np.abs(r), 1e-18))
                sw = np.sqrt(w)
                beta = nnls(x * sw[:, None], y * sw)
            level = float(y.sum() / max((x @ beta).sum(), 1e-18))
            beta = beta * level
        pred = x @ beta
        rel = np.abs(pred - y) / np.maximum(y, 1e-9)
        info = {
            "num_samples": len(samples),
            "median_abs_rel_error": float(np.median(rel)),
            "r2": float(1 - np.sum((pred - y) ** 2) / max(np.sum((y - y.mean()) ** 2), 1e-18)),
            "downweighted_samples": int((w < 1).sum()),
            "level": level,  # mean measured / mean robust-fit step time
        }
        return cls({f: float(b) for f, b in zip(features, beta, strict=False)}, kv_tokens, name, info)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=2)

    @classmethod
    def load(cls, path: str) -> ProfiledCost:
        with open(path) as f:
            d = json.load(f)
        return cls(**d)


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with beta >= 0, by an active set: drop the most negative term, refit.

    Step-time terms are costs, so a negative fitted cost is noise; dropping it is the
    usual Lawson-Hanson outcome for a handful of columns.
    """
    active = list(range(x.shape[1]))
    beta = np.zeros(x.shape[1])
    # Scale columns so the conditioning does not depend on units.
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] / scale[active], y, rcond=None)
        sol = sol / scale[active]
        if (sol >= 0).all():
            beta[:] = 0
            beta[active] = sol
            return beta
        active.pop(int(np.argmin(sol)))
    return beta


KERNEL_ROWS = 16  # query rows of one sequence that carpool's paged-attention kernel handles together


def kernel_kv_loads(offset: int, n: int) -> int:
    """K/V vectors the kernel reads for a chunk of ``n`` rows after ``offset`` cached tokens:
    each block of up to KERNEL_ROWS rows reads up to its last row's context.  Summed in closed
    form (the simulators ask it for every chunk of every step): every block but the last is
    full, block b reading KERNEL_ROWS * (b + 1) rows, and the last reads all ``n``."""
    nb = ceil_div(n, KERNEL_ROWS)
    if nb == 0:
        return 0
    return nb * offset + KERNEL_ROWS * nb * (nb - 1) // 2 + n


def attn_pairs(offset: int, n: int) -> int:
    """(query, key) pairs of a chunk of ``n`` tokens appended after ``offset`` cached tokens."""
    return n * offset + n * (n + 1) // 2


def saturation_throughput(cost: CostModel, batch: int, context: int) -> float:
    """Decode tokens/s of a batch of ``batch`` sequences at ``context`` tokens each (a quick bound)."""
    s = StepShape(0, batch, batch * context, batch * context, batch, num_logits=batch)
    return batch / cost.step_time(s) if batch else 0.0


def ceil_div(a: int, b: int) -> int:
    return -(-a // b) if b else 0


__all__ = [
    "CostModel",
    "LinearCost",
    "ProfiledCost",
    "RooflineCost",
    "ScaledCost",
    "StepShape",
    "attn_pairs",
    "ceil_div",
    "kernel_kv_loads",
    "nnls",
    "saturation_throughput",
]
