"""Paged attention as one small C++ kernel (built on first use, cached by torch).

Each query row (a decode token or a prefill-chunk token) attends to the first
``ctx_len`` keys of its sequence, read straight from the paged cache through the
block table: no gathered copies, no padding, no masks.  Rows x KV heads run in
parallel; the G query heads that share a KV head are computed together so each
key/value vector is loaded once.  When no C++ compiler is available the engine
falls back to the pure-torch path in ``model.py``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import tempfile
import threading
from pathlib import Path

import torch

from carpool.paths import cache_dir

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

// Rows are processed in blocks of up to kRows consecutive rows of one sequence (a prefill
// chunk; a decode is a block of one), per KV head: each key/value vector is converted to
// fp32 once and used by every query row x query head of the block.
constexpr int64_t kRows = 16;

template <typename T, int D>
static void attend(const T* q, const T* kc, const T* vc, const int64_t* tables, const int64_t* seq_of_row,
                   const int64_t* ctx_len, T* out, int64_t rows, int64_t hq, int64_t hkv, int64_t bs,
                   int64_t max_blocks, float scale) {
  const int64_t g = hq / hkv;
  std::vector<int64_t> starts;
  for (int64_t t = 0; t < rows; ++t)
    if (t == 0 || seq_of_row[t] != seq_of_row[t - 1] || t - starts.back() == kRows) starts.push_back(t);
  const int64_t nblk = static_cast<int64_t>(starts.size());
  starts.push_back(rows);
  at::parallel_for(0, nblk * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf, acc;
    float kf[D];
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / hkv, h = w % hkv;
      const int64_t row0 = starts[b], nr = starts[b + 1] - row0, nq = nr * g;
      const int64_t* table = tables + seq_of_row[row0] * max_blocks;
      int64_t maxlen = 0;
      for (int64_t r = 0; r < nr; ++r) maxlen = ctx_len[row0 + r] > maxlen ? ctx_len[row0 + r] : maxlen;
      scores.assign(nq * maxlen, 0.f);
      qf.resize(nq * D);
      acc.assign(nq * D, 0.f);
      for (int64_t r = 0; r < nr; ++r)
        for (int64_t j = 0; j < g; ++j)
          for (int d = 0; d < D; ++d)
            qf[(r * g + j) * D + d] = static_cast<float>(q[((row0 + r) * hq + h * g + j) * D + d]) * scale;
      for (int64_t l = 0; l < maxlen; ++l) {
        const T* kp = kc + ((table[l / bs] * bs + l % bs) * hkv + h) * D;
        for (int d = 0; d < D; ++d) kf[d] = static_cast<float>(kp[d]);
        for (int64_t r = 0; r < nr; ++r) {
          if (l >= ctx_len[row0 + r]) continue;
          for (int64_t j = 0; j < g; ++j) {
            const float* qj = &qf[(r * g + j) * D];
            float s = 0.f;
            for (int d = 0; d < D; ++d) s += qj[d] * kf[d];
            scores[(r * g + j) * maxlen + l] = s;
          }
        }
      }
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t len = ctx_len[row0 + r];
        for (int64_t j = 0; j < g; ++j) {
          float* sj = &scores[(r * g + j) * maxlen];
          float m = -INFINITY;
          for (int64_t l = 0; l < len; ++l) m = sj[l] > m ? sj[l] : m;
          float sum = 0.f;
          for (int64_t l = 0; l < len; ++l) { sj[l] = std::exp(sj[l] - m); sum += sj[l]; }
          const float inv = 1.f / sum;
          for (int64_t l = 0; l < len; ++l) sj[l] *= inv;
        }
      }
      for (int64_t l = 0; l < maxlen; ++l) {
        const T* vp = vc + ((table[l / bs] * bs + l % bs) * hkv + h) * D;
        for (int d = 0; d < D; ++d) kf[d] = static_cast<float>(vp[d]);
        for (int64_t r = 0; r < nr; ++r) {
          if (l >= ctx_len[row0 + r]) continue;
          for (int64_t j = 0; j < g; ++j) {
            const float p = scores[(r * g + j) * maxlen + l];
            float* aj = &acc[(r * g + j) * D];
            for (int d = 0; d < D; ++d) aj[d] += p * kf[d];
          }
        }
      }
      for (int64_t r = 0; r < nr; ++r)
        for (int64_t j = 0; j < g; ++j)
          for (int d = 0; d < D; ++d)
            out[((row0 + r) * hq + h * g + j) * D + d] = static_cast<T>(acc[(r * g + j) * D + d]);
    }
  });
}

template <typename T>
static void dispatch_dim(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tables,
                         const at::Tensor& seq_of_row, const at::Tensor& ctx_len, at::Tensor& out, double scale) {
  const int64_t rows = q.size(0), hq = q.size(1), d = q.size(2), bs = k.size(1), hkv = k.size(2);
  auto args = std::make_tuple(q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), tables.data_ptr<int64_t>(),
                              seq_of_row.data_ptr<int64_t>(), ctx_len.data_ptr<int64_t>(), out.data_ptr<T>());
  const float s = static_cast<float>(scale);
  const int64_t mb = tables.size(1);
  switch (d) {
    case 64: attend<T, 64>(std::get<0>(args), std::get<1>(args), std::get<2>(args), std::get<3>(args),
                           std::get<4>(args), std::get<5>(args), std::get<6>(args), rows, hq, hkv, bs, mb, s); break;
    case 128: attend<T, 128>(std::get<0>(args), std::get<1>(args), std::get<2>(args), std::get<3>(args),
                             std::get<4>(args), std::get<5>(args), std::get<6>(args), rows, hq, hkv, bs, mb, s); break;
    case 32: attend<T, 32>(std::get<0>(args), std::get<1>(args), std::get<2>(args), std::get<3>(args),
                           std::get<4>(args), std::get<5>(args), std::get<6>(args), rows, hq, hkv, bs, mb, s); break;
    case 16: attend<T, 16>(std::get<0>(args), std::get<1>(args), std::get<2>(args), std::get<3>(args),
                           std::get<4>(args), std::get<5>(args), std::get<6>(args), rows, hq, hkv, bs, mb, s); break;
    default: TORCH_CHECK(false, "paged_attention: head_dim ", d, " is not compiled in");
  }
}

// Fused row ops for the decoder layers: one parallel pass instead of ~8 small torch ops
// (each of which wakes the thread pool).  Math in fp32, one rounding at the end.
template <typename T>
static void add_rms_norm_impl(T* x, const T* r, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(n);
    for (int64_t i = begin; i < end; ++i) {
      T* xi = x + i * n;
      float ss = 0.f;
      for (int64_t k = 0; k < n; ++k) {
        float v = static_cast<float>(xi[k]);
        if (r) {
          v = static_cast<float>(static_cast<T>(v + static_cast<float>(r[i * n + k])));
          xi[k] = static_cast<T>(v);
        }
        buf[k] = v;
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
      for (int64_t k = 0; k < n; ++k) out[i * n + k] = static_cast<T>(static_cast<float>(w[k]) * (buf[k] * inv));
    }
  });
}

// x [T, H] (updated in place: x += residual when given); returns rms_norm(x) * w.
at::Tensor add_rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor w, double eps) {
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "add_rms_norm: contiguous inputs expected");
  auto out = at::empty_like(x);
  const int64_t n = x.size(-1), rows = x.numel() / n;
  at::Tensor r;
  if (residual.has_value()) r = residual->contiguous();
  if (x.scalar_type() == at::kBFloat16)
    add_rms_norm_impl<at::BFloat16>(x.data_ptr<at::BFloat16>(), r.defined() ? r.data_ptr<at::BFloat16>() : nullptr,
                                    w.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, n, eps);
  else if (x.scalar_type() == at::kFloat)
    add_rms_norm_impl<float>(x.data_ptr<float>(), r.defined() ? r.data_ptr<float>() : nullptr, w.data_ptr<float>(),
                             out.data_ptr<float>(), rows, n, eps);
  else TORCH_CHECK(false, "add_rms_norm: unsupported dtype");
  return out;
}

template <typename T>
static void silu_mul_impl(const T* gu, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* g = gu + i * 2 * n;
      const T* u = g + n;
      for (int64_t k = 0; k < n; ++k) {
        const float a = static_cast<float>(g[k]);
        out[i * n + k] = static_cast<T>(a / (1.f + std::exp(-a)) * static_cast<float>(u[k]));
      }
    }
  });
}

// gu [T, 2I] = [gate | up] -> silu(gate) * up  [T, I]
at::Tensor silu_mul(at::Tensor gu) {
  gu = gu.contiguous();
  const int64_t n = gu.size(-1) / 2, rows = gu.numel() / (2 * n);
  auto out = at::empty({rows, n}, gu.options());
  if (gu.scalar_type() == at::kBFloat16)
    silu_mul_impl<at::BFloat16>(gu.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, n);
  else if (gu.scalar_type() == at::kFloat) silu_mul_impl<float>(gu.data_ptr<float>(), out.data_ptr<float>(), rows, n);
  else TORCH_CHECK(false, "silu_mul: unsupported dtype");
  return out;
}

// q [T, Hq, D]; k/v cache [NB, BS, Hkv, D]; tables [S, max_blocks] int64; seq_of_row, ctx_len [T] int64.
at::Tensor paged_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor tables, at::Tensor seq_of_row,
                           at::Tensor ctx_len, double scale) {
  q = q.contiguous();
  auto out = at::empty_like(q);
  if (q.scalar_type() == at::kBFloat16) dispatch_dim<at::BFloat16>(q, k, v, tables, seq_of_row, ctx_len, out, scale);
  else if (q.scalar_type() == at::kFloat) dispatch_dim<float>(q, k, v, tables, seq_of_row, ctx_len, out, scale);
  else if (q.scalar_type() == at::kHalf) dispatch_dim<at::Half>(q, k, v, tables, seq_of_row, ctx_len, out, scale);
  else TORCH_CHECK(false, "paged_attention: unsupported dtype");
  return out;
}
"""

_NAME = "carpool_paged_attention"
_lock = threading.Lock()
_module = None
_failed = False
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)


_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]


def _cache_dir() -> Path:
    key = hashlib.sha256("|".join([_SOURCE, *_CFLAGS, torch.__version__]).encode()).hexdigest()[:16]
    root = cache_dir()
    return root / "kernels" / f"paged_attention-{key}"


def _import_so(path: Path) -> object:
    spec = importlib.util.spec_from_file_location(_NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(final: Path) -> object:
    """Compile in a private directory, then move the .so into the shared cache atomically.

    No shared lock file: a builder that dies cannot leave the others waiting forever
    (concurrent first builds just compile twice).
    """
    from torch.utils.cpp_extension import load_inline

    final.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="build-", dir=final) as tmp:
        load_inline(name=_NAME, cpp_sources=[_SOURCE], functions=["paged_attention", "add_rms_norm", "silu_mul"],
                    extra_cflags=_CFLAGS,
                    build_directory=tmp, verbose=False)
        so = next(Path(tmp).glob(f"{_NAME}*.so"))
        os.replace(so, final / so.name)
    return _import_so(final / so.name)


def load() -> object | None:
    """The compiled extension, or None when it cannot be built (the caller falls back)."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is None and not _failed:
            if os.environ.get("CARPOOL_PAGED_ATTENTION", "1") == "0":
                _failed = True
                return None
            try:
                final = _cache_dir()
                built = sorted(final.glob(f"{_NAME}*.so")) if final.exists() else []
                _module = _import_so(built[0]) if built else _build(final)
            except Exception as e:  # noqa: BLE001 -- no compiler, headers, ...: use the torch path
                log.warning("paged attention kernel unavailable (%s); using the torch attention path", e)
                _failed = True
    return _module


def load_in_background() -> None:
    """Start building (or loading the cached build of) the kernel without blocking.

    A fresh machine compiles for about a minute; until then the torch path runs.
    """
    if _module is None and not _failed and not _lock.locked():
        threading.Thread(target=load, name="carpool-build-attention", daemon=True).start()


def available() -> bool:
    return _module is not None


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x += residual`` (in place, when given), then returns rms_norm(x) * weight."""
    return _module.add_rms_norm(x, residual, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return _module.silu_mul(gate_up)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_of_row: torch.Tensor, ctx_len: torch.Tensor, scale: float) -> torch.Tensor:
    return _module.paged_attention(q, k_cache, v_cache, block_tables, seq_of_row, ctx_len, scale)
