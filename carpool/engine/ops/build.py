"""Builds, caches and loads carpool's C++ kernels (the ``.cpp`` files beside this module).

``Kernels`` is owned by a model runner: ``start()`` builds (or loads the cached build) in a
background thread so a fresh machine serves with the torch path during its first minute,
``wait()`` blocks until the build is there, and the methods (``attention``, ``rope_``,
``add_rms_norm``, ``silu_mul``, and the int8 linear's ``quantize_rows`` / ``int8_*``) call the
compiled ops at the instruction set level ``isa`` (AVX-512, AVX2 or scalar: the widest the CPU
runs unless lowered, e.g. by a test).

The cache key covers everything the ``.so`` depends on: the sources, the compiler flags and
version, torch's version, Python's extension ABI, and this CPU's instruction set flags, so a
home directory shared by machines of different CPUs (Ray nodes) never loads another CPU's
build.  The kernels are compiled without ``-march``: each ISA's copy is compiled under its own
``#pragma GCC target`` and chosen at run time, and the build would still run on another CPU;
the CPU in the key is belt and braces.  No ``-ffast-math``: the kernels use -inf for masked
scores, which fast-math makes undefined.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from carpool.engine import cpu
from carpool.paths import cache_dir as carpool_cache_dir

from . import bindings
from .bindings import op
from .compile_process import compile_child, machine_lock

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
SOURCES = ("attention.cpp", "attention_bf16.cpp", "layers.cpp", "decode_gemm.cpp")
HEADERS = ("simd.h", "per_isa.h", "attention_bf16.h", "attention_kernels.h", "attention_brgemm_kernels.h",
           "layer_kernels.h", "quant_kernels.h")
# Included first by the generated binding source (bindings.source): best_isa is defined inline there.
BINDING_HEADERS = ("simd.h", "attention_bf16.h")
BINDING_SOURCE = "bindings.cpp"
# -ffp-contract=off: a * b - c * d stays two rounded products (as torch computes it), not an FMA.
CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-std=c++17")
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
ISA_NAMES = {0: "scalar", 1: "avx2", 2: "avx512"}
_NAME = "carpool_ops"
# One build at a time in a process: every runner (and every ISA a test asks for) owns a Kernels,
# and on a fresh cache each started its own compile of the same sources -- five at once in the
# engine tests, ~15 compilers on 2 cores, past the tests' 10-minute timeout.  Waiting here, the
# later ones find the first one's .so.  Across processes the same holds through an flock on
# ``build.lock`` in the cache (``compile_process.machine_lock``): the kernel releases it when its holder dies, so a
# crashed builder never leaves the others waiting.
_BUILD_LOCK = threading.Lock()


def compiler_version() -> str:
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return f"{cxx}: unavailable"
    return f"{cxx}: {out.splitlines()[0] if out else ''}"


@functools.lru_cache(maxsize=1)
def build_key() -> str:
    h = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        h.update(name.encode() + b"\0" + (HERE / name).read_bytes() + b"\0")
    h.update(bindings.source(BINDING_HEADERS).encode() + b"\0")
    parts = [*CFLAGS, torch.__version__, sysconfig.get_config_var("EXT_SUFFIX") or sys.version, compiler_version(),
             cpu.flag_text()]
    h.update("|".join(parts).encode())
    return h.hexdigest()[:16]


def _import_so(path: Path) -> Any:  # the compiled extension: no type stub
    spec = importlib.util.spec_from_file_location(_NAME, path)
    assert spec is not None and spec.loader is not None  # a .so path always has the extension loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Kernels:
    """One build of the kernels, loaded on demand.  Not a singleton: each runner owns one (they
    share the cached ``.so`` on disk and, once imported, the process's copy of it)."""

    def __init__(self, isa: int | None = None, cache_dir: Path | None = None):
        self.cache_dir = cache_dir or carpool_cache_dir() / "kernels"
        self.requested_isa = isa
        self.isa = 0
        self.module: Any = None  # the compiled extension (no type stub), once loaded
        self.error: str | None = None
        # Whether int8_gemm / bf16_gemm run here (AVX-512 VNNI / BF16 and the kernels at the AVX-512
        # level): set once at load, read before every linear the plan routes to them.
        self.has_int8_gemm = False
        self.has_bf16_gemm = False
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------- build

    @property
    def ready(self) -> bool:
        return self.module is not None

    @property
    def failed(self) -> bool:
        return self.error is not None

    def build_dir(self) -> Path:
        """Where this machine's build of these sources lives (the cache key is in its name)."""
        return self.cache_dir / f"ops-{build_key()}"

    def cached(self) -> bool:
        """Whether the build is already in the cache (loading it takes no compiler)."""
        final = self.build_dir()
        return final.exists() and any(final.glob(f"{_NAME}*.so"))

    def _build(self, final: Path) -> Path:
        """Compile in a private directory (``compile_child``), then move the .so into the shared
        cache atomically."""
        final.mkdir(parents=True, exist_ok=True)
        minutes = max(1, round(3 * 2 / (os.cpu_count() or 1)))
        meanwhile = "; until then the torch path runs" if self._thread is not None else ""
        log.warning("building carpool's C++ kernels for this CPU (once per machine and torch version): about "
                    "%d min on %d cores%s", minutes, os.cpu_count() or 1, meanwhile)
        with tempfile.TemporaryDirectory(prefix="build-", dir=final) as tmp:
            generated = Path(tmp) / BINDING_SOURCE
            generated.write_text(bindings.source(BINDING_HEADERS))
            compile_child(Path(tmp), {"name": _NAME, "sources": [*(str(HERE / s) for s in SOURCES), str(generated)],
                                      "extra_cflags": list(CFLAGS), "extra_include_paths": [str(HERE)]})
            so = next(Path(tmp).glob(f"{_NAME}*.so"))
            os.replace(so, final / so.name)
        return final / so.name

    def _load_or_build(self, final: Path) -> Any:
        """Import the cached .so, building it first if absent: one build per machine at a time."""
        with _BUILD_LOCK:
            built = sorted(final.glob(f"{_NAME}*.so")) if final.exists() else []
            if built:
                return _import_so(built[0])
            with machine_lock(self.cache_dir):
                built = sorted(final.glob(f"{_NAME}*.so")) if final.exists() else []
                return _import_so(built[0] if built else self._build(final))

    def wait(self) -> bool:
        """Build or load now (blocking); True when the kernels are usable."""
        if self.module is not None or self.error is not None:
            return self.module is not None
        with self._lock:
            if self.module is None and self.error is None:
                try:
                    module = self._load_or_build(self.build_dir())
                    best = int(module.best_isa())
                    isa = best if self.requested_isa is None else int(self.requested_isa)
                    if isa > best:
                        raise RuntimeError(f"instruction set {ISA_NAMES.get(isa, isa)} requested, this CPU runs "
                                           f"up to {ISA_NAMES[best]}")
                    self.isa = isa
                    self.has_int8_gemm = isa == 2 and bool(module.cpu_has_vnni_gemm())
                    self.has_bf16_gemm = isa == 2 and bool(module.cpu_has_avx512_bf16())
                    self.module = module
                except Exception as e:  # noqa: BLE001 -- no compiler, headers, ...: the caller uses the torch path
                    self.error = f"{type(e).__name__}: {e}"
                    log.warning("carpool kernels unavailable (%s); using the torch path", self.error)
        return self.module is not None

    def start(self) -> None:
        """Build (or load the cached build) in the background; ``ready`` turns True when done.

        A fresh machine compiles for about a minute; until then the torch path runs.  A build
        already in the cache is loaded now, before the first step: switching from the torch path
        to the kernels in the middle of a request changes its numerics (bf16), so a job started
        right after the engine would otherwise answer differently from a warm server.
        """
        if self.module is None and self.error is None and self.cached():
            self.wait()
            return
        if self.module is None and self.error is None and self._thread is None:
            self._thread = threading.Thread(target=self.wait, name="carpool-build-kernels", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------- ops
    # Each op once: its Python signature here, its C++ declaration in the decorator (bindings.py
    # makes the call and the binding from both).  Callers pass an ISA op's arguments by position.

    @op("at::Tensor attention(at::Tensor qkv, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping, "
        "at::Tensor block_tables, at::Tensor seq_of_row, at::Tensor ctx_len, int64_t num_kernel_rows, "
        "at::Tensor chunks, int64_t num_heads, double scale, int64_t isa)")
    def attention(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  block_tables: torch.Tensor, seq_of_row: torch.Tensor, ctx_len: torch.Tensor, num_kernel_rows: int,
                  chunks: torch.Tensor, num_heads: int, scale: float) -> torch.Tensor:
        """Paged attention of a flat batch: writes the new K/V of ``qkv`` into the caches, returns
        attention [T, heads * head_dim].  Rows [0, num_kernel_rows) run the SIMD kernel; ``chunks``
        [P, 5] int64 (row start, rows, sequence, cached keys, route 0 flash / 1 brgemm) the others."""
        ...

    @op("void rope_(at::Tensor qkv, at::Tensor positions, at::Tensor cos, at::Tensor sin, int64_t heads, "
        "int64_t head_dim, int64_t isa)")
    def rope_(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
              head_dim: int) -> None:
        """Rotate-half RoPE in place on the q and k heads of qkv."""
        ...

    @op("at::Tensor add_rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor w, double eps, "
        "int64_t isa)")
    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """``x += residual`` (in place, when given), then returns rms_norm(x) * weight."""
        ...

    @op("void set_row_grains(int64_t light_values, int64_t silu_values)")
    def set_row_grains(self, light_values: int, silu_values: int) -> None:
        """The values a row-wise pass (residual add + RMSNorm, RoPE, quantize...; SiLU * up) holds at
        most to run on one thread.  Process-wide: the kernels' own setting, not this object's."""
        ...

    @op("std::tuple<int64_t, int64_t> row_grains()")
    def row_grains(self) -> tuple[int, int]:
        """The limits set_row_grains set: (light ops, SiLU * up)."""
        ...

    @op("at::Tensor silu_mul(at::Tensor gu, int64_t isa)")
    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[gate | up] -> silu(gate) * up."""
        ...

    @op("at::Tensor top_k_rows(at::Tensor x, int64_t k, int64_t isa)")
    def top_k_rows(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """x [rows, n] -> int64 [rows, k]: each row's k largest columns, largest first (ties: lower
        column first; NaN and -inf never rank)."""
        ...

    # The linears' packed GEMMs (decode_gemm.cpp; weights packed by engine/decode_gemm.py), for the
    # row counts the engine plan routes to them (engine/plan.py).

    @op("at::Tensor int8_gemm(at::Tensor x, at::Tensor packed, int64_t n, bool split_rows = false)")
    def int8_gemm(self, x: torch.Tensor, packed: torch.Tensor, n: int, split_rows: bool = False) -> torch.Tensor:
        """int8 x [M, K] times a ``decode_gemm.pack_vnni`` weight of n output columns -> int32 [M, n]:
        the same sums as ``torch._int_mm(x, w.t())``.  ``split_rows``: each 32-column block's rows are
        cut in as many pieces as make the work divide evenly between the threads (the plan's
        "carpool_split" route); the same values either way."""
        ...

    @op("at::Tensor int8_gemm_dequant(at::Tensor x, at::Tensor packed, int64_t n, at::Tensor row_scale, "
        "at::Tensor col_scale, c10::optional<at::Tensor> bias, at::ScalarType dtype, bool split_rows = false)")
    def int8_gemm_dequant(self, x: torch.Tensor, packed: torch.Tensor, n: int, row_scale: torch.Tensor,
                          col_scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                          split_rows: bool = False) -> torch.Tensor:
        """``int8_gemm`` scaled back to ``dtype`` as it stores: the values of ``int8_dequantize(int8_gemm(x,
        packed, n), row_scale, col_scale, bias, dtype)`` in one pass."""
        ...

    @op("at::Tensor bf16_gemm(at::Tensor x, at::Tensor packed, int64_t n, bool split_rows = false)")
    def bf16_gemm(self, x: torch.Tensor, packed: torch.Tensor, n: int, split_rows: bool = False) -> torch.Tensor:
        """bf16 x [M, K] times a ``decode_gemm.pack_bf16`` weight of n output columns -> bf16 [M, n]
        (fp32 sums, as F.linear's up to the rounding of a sum's last step); ``split_rows`` as in
        ``int8_gemm``."""
        ...

    # The int8 x int8 linear's ends (quant_kernels.h).

    @op("std::tuple<at::Tensor, at::Tensor> quantize_rows(at::Tensor x, int64_t isa)")
    def quantize_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, n] -> (int8 [T, n], fp32 row scales [T]), as ``quant.quantize_rows``."""
        ...

    @op("at::Tensor int8_dequantize(at::Tensor acc, at::Tensor rs, at::Tensor cs, c10::optional<at::Tensor> bias, "
        "at::ScalarType dtype, int64_t isa)")
    def int8_dequantize(self, acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                        bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """int32 [T, n] -> (acc * row scale * column scale, rounded to dtype) + bias, in dtype."""
        ...

    @op("std::tuple<at::Tensor, at::Tensor> add_rms_norm_quant(at::Tensor x, c10::optional<at::Tensor> residual, "
        "at::Tensor w, double eps, int64_t isa)")
    def add_rms_norm_quant(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``x += residual`` (in place, when given), then ``add_rms_norm``'s rms_norm(x) * weight quantized
        per row: (int8 h, fp32 row scales)."""
        ...

    @op("std::tuple<at::Tensor, at::Tensor> silu_mul_quant(at::Tensor gu, int64_t isa)")
    def silu_mul_quant(self, gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``silu_mul``'s silu(gate) * up quantized per row: (int8, fp32 row scales)."""
        ...

    # What the CPU runs, and the attention paths' switches (tests compare the paths).

    @op("int64_t best_isa()")
    def best_isa(self) -> int:
        """The widest instruction set this CPU runs: 0 scalar, 1 AVX2, 2 AVX-512."""
        ...

    @op("bool cpu_has_avx512_bf16()")
    def cpu_has_avx512_bf16(self) -> bool:
        """Whether this CPU runs AVX-512 BF16 (bf16_gemm, the bf16 attention kernels)."""
        ...

    @op("bool cpu_has_avx512_vnni()")
    def cpu_has_avx512_vnni(self) -> bool:
        """Whether this CPU runs AVX-512 VNNI (and BF16): the int8 cache's decode kernel."""
        ...

    @op("bool cpu_has_vnni_gemm()")
    def cpu_has_vnni_gemm(self) -> bool:
        """Whether this CPU runs int8_gemm (AVX-512 VNNI)."""
        ...

    @op("bool brgemm_attention_runs(at::ScalarType dtype)")
    def brgemm_attention_runs(self, dtype: torch.dtype) -> bool:
        """Whether the brgemm attention route runs here for a model of ``dtype`` (ATen's micro-kernel
        for it is built into this torch and runs on this CPU)."""
        ...

    @op("bool attention_bf16_enabled()")
    def attention_bf16_enabled(self) -> bool:
        """Whether bf16 prefill blocks run on AVX-512 BF16 dot products (default: where the CPU has them)."""
        ...

    @op("void set_attention_bf16_enabled(bool on)")
    def set_attention_bf16_enabled(self, on: bool) -> None:
        """Turn the AVX-512 BF16 attention path on (where the CPU has it) or off (the fp32 path)."""
        ...

    @op("bool attention_int8_enabled()")
    def attention_int8_enabled(self) -> bool:
        """Whether decode rows of an int8 KV cache are read as int8 (default: where the CPU has VNNI)."""
        ...

    @op("void set_attention_int8_enabled(bool on)")
    def set_attention_int8_enabled(self, on: bool) -> None:
        """Off: decode rows of an int8 KV cache are staged into bf16 like every other item."""
        ...
