// The decoder layer's row-wise ops (kernels in layer_kernels.h): residual add + RMSNorm, SiLU * up,
// and RoPE in place on the fused q|k|v projection; and the int8 linear's ends fused into them
// (quant_kernels.h).  One parallel pass each instead of a chain of
// torch ops; on SmolLM2 they took ~5% of a long-prompt step as torch ops (engine_profile.py).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace carpool {
// The values a row-wise pass holds at most to run on one thread (layer_kernels.h's row_grain);
// these starting values are what a 2-core Zen 5 preferred, the engine plan sets measured ones.
std::atomic<int64_t> g_row_grain_values{int64_t{1} << 17};
std::atomic<int64_t> g_silu_grain_values{int64_t{1} << 15};

void set_row_grains(int64_t light_values, int64_t silu_values) {
  TORCH_CHECK(light_values >= 0 && silu_values >= 0, "set_row_grains: the limits are counts of values, >= 0");
  g_row_grain_values.store(light_values, std::memory_order_relaxed);
  g_silu_grain_values.store(silu_values, std::memory_order_relaxed);
}

std::tuple<int64_t, int64_t> row_grains() {
  return {g_row_grain_values.load(std::memory_order_relaxed), g_silu_grain_values.load(std::memory_order_relaxed)};
}
}  // namespace carpool

#define CARPOOL_KERNELS "layer_kernels.h"
#include "per_isa.h"
#define CARPOOL_KERNELS "quant_kernels.h"
#include "per_isa.h"

namespace carpool {

// x [rows, n] -> int64 [rows, k]: each row's k largest columns, largest first (top_k_rows).
at::Tensor top_k_rows(at::Tensor x, int64_t k, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "top_k_rows: x must be a contiguous [rows, n] tensor");
  TORCH_CHECK(k >= 1 && k <= x.size(1), "top_k_rows: k must be in [1, ", x.size(1), "], got ", k);
  auto out = at::empty({x.size(0), k}, x.options().dtype(at::kLong));
  CARPOOL_DISPATCH(isa, x.scalar_type(), "top_k_rows",
                   (ns::top_k_rows<T>(x.data_ptr<T>(), out.data_ptr<int64_t>(), x.size(0), x.size(1), k)));
  return out;
}

// x [T, H] (x += residual in place when given); returns rms_norm(x) * w.
at::Tensor add_rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor w, double eps, int64_t isa) {
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "add_rms_norm: contiguous inputs expected");
  auto out = at::empty_like(x);
  const int64_t n = x.size(-1), rows = x.numel() / n;
  at::Tensor r;
  if (residual.has_value()) r = residual->contiguous();
  const float e = static_cast<float>(eps);
  CARPOOL_DISPATCH(isa, x.scalar_type(), "add_rms_norm",
                   (ns::add_rms_norm<T>(x.data_ptr<T>(), r.defined() ? r.data_ptr<T>() : nullptr, w.data_ptr<T>(),
                                        out.data_ptr<T>(), rows, n, e)));
  return out;
}

// gu [T, 2I] = [gate | up] -> silu(gate) * up  [T, I]
at::Tensor silu_mul(at::Tensor gu, int64_t isa) {
  gu = gu.contiguous();
  const int64_t n = gu.size(-1) / 2, rows = gu.numel() / (2 * n);
  auto out = at::empty({rows, n}, gu.options());
  CARPOOL_DISPATCH(isa, gu.scalar_type(), "silu_mul", (ns::silu_mul<T>(gu.data_ptr<T>(), out.data_ptr<T>(), rows, n)));
  return out;
}

// qkv [T, width] (unit column stride): RoPE in place on its first `heads` heads of head_dim
// columns each (the q heads, then the k heads); positions [T]; cos/sin [max_pos, head_dim / 2].
void rope_(at::Tensor qkv, at::Tensor positions, at::Tensor cos, at::Tensor sin, int64_t heads, int64_t head_dim,
           int64_t isa) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "rope_: qkv must be [T, width] with unit column stride");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) * 2 == head_dim, "rope_: bad cos/sin table");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type(), "rope_: cos/sin must have qkv's dtype");
  TORCH_CHECK(heads * head_dim <= qkv.size(1), "rope_: ", heads, " heads do not fit in width ", qkv.size(1));
  const int64_t tokens = qkv.size(0), stride = qkv.stride(0);
  auto pos = positions.contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(p[t] >= 0 && p[t] < cos.size(0), "rope_: position ", p[t], " is outside the cos/sin table");
  CARPOOL_DISPATCH(isa, qkv.scalar_type(), "rope_",
                   (ns::rope<T>(qkv.data_ptr<T>(), stride, p, cos.data_ptr<T>(), sin.data_ptr<T>(),
                                tokens, heads, head_dim)));
}

// ---------------------------------------------------------------- int8 (quant_kernels.h)

namespace {

void check_scales(const at::Tensor& acc, const at::Tensor& rs, const at::Tensor& cs, int64_t cols, const char* name) {
  TORCH_CHECK((acc.scalar_type() == at::kInt || acc.scalar_type() == at::kFloat) && acc.dim() == 2 &&
                  acc.is_contiguous(), name, ": acc must be a contiguous int32 or fp32 [rows, cols]");
  TORCH_CHECK(rs.scalar_type() == at::kFloat && rs.is_contiguous() && rs.numel() == acc.size(0), name,
              ": row scales must be fp32 [rows]");
  TORCH_CHECK(cs.scalar_type() == at::kFloat && cs.is_contiguous() && cs.numel() == cols, name,
              ": column scales must be fp32 [cols]");
}

// The optional bias of an int8 op, contiguous, checked to be [n] in `dtype`; undefined when absent.
at::Tensor checked_bias(const c10::optional<at::Tensor>& bias, at::ScalarType dtype, int64_t n, const char* name) {
  if (!bias.has_value()) return {};
  at::Tensor b = bias->contiguous();
  TORCH_CHECK(b.scalar_type() == dtype && b.numel() == n, name, ": bias must be [n] in dtype");
  return b;
}

}  // namespace

// x [T, n] -> (int8 [T, n], fp32 scales [T]): each row rounded to amax / 127 steps.
std::tuple<at::Tensor, at::Tensor> quantize_rows(at::Tensor x, int64_t isa) {
  x = x.contiguous();
  TORCH_CHECK(x.dim() == 2, "quantize_rows: x must be [rows, n]");
  const int64_t rows = x.size(0), n = x.size(1);
  auto q = at::empty({rows, n}, x.options().dtype(at::kChar));
  auto qs = at::empty({rows}, x.options().dtype(at::kFloat));
  CARPOOL_DISPATCH(isa, x.scalar_type(), "quantize_rows",
                   (ns::quantize_rows<T>(x.data_ptr<T>(), q.data_ptr<int8_t>(), qs.data_ptr<float>(), rows, n)));
  return {q, qs};
}

// acc int32 or fp32 [T, n] (the sums), row scales [T], column scales [n], bias [n] or None -> [T, n] in `dtype`.
at::Tensor int8_dequantize(at::Tensor acc, at::Tensor rs, at::Tensor cs, c10::optional<at::Tensor> bias,
                           at::ScalarType dtype, int64_t isa) {
  check_scales(acc, rs, cs, acc.size(1), "int8_dequantize");
  const int64_t rows = acc.size(0), n = acc.size(1);
  auto out = at::empty({rows, n}, acc.options().dtype(dtype));
  const at::Tensor b = checked_bias(bias, dtype, n, "int8_dequantize");
  const bool fp32_sums = acc.scalar_type() == at::kFloat;
  CARPOOL_DISPATCH(isa, dtype, "int8_dequantize",
                   (fp32_sums ? ns::dequantize<T>(acc.data_ptr<float>(), rs.data_ptr<float>(), cs.data_ptr<float>(),
                                                  b.defined() ? b.data_ptr<T>() : nullptr, out.data_ptr<T>(), rows, n)
                              : ns::dequantize<T>(acc.data_ptr<int32_t>(), rs.data_ptr<float>(),
                                                  cs.data_ptr<float>(), b.defined() ? b.data_ptr<T>() : nullptr,
                                                  out.data_ptr<T>(), rows, n)));
  return out;
}

// x [T, n] (x += residual in place when given) -> add_rms_norm's rms_norm(x) * w quantized:
// (int8 [T, n], fp32 scales [T]).
std::tuple<at::Tensor, at::Tensor> add_rms_norm_quant(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor w,
                                                      double eps, int64_t isa) {
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.dim() == 2, "add_rms_norm_quant: contiguous [rows, n] x");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.numel() == n, "add_rms_norm_quant: w must be [n] in x's dtype");
  at::Tensor r;
  if (residual.has_value()) {
    r = residual->contiguous();
    TORCH_CHECK(r.scalar_type() == x.scalar_type() && r.sizes() == x.sizes(),
                "add_rms_norm_quant: residual must be x's shape and dtype");
  }
  auto q = at::empty({rows, n}, x.options().dtype(at::kChar));
  auto qs = at::empty({rows}, x.options().dtype(at::kFloat));
  const float e = static_cast<float>(eps);
  CARPOOL_DISPATCH(isa, x.scalar_type(), "add_rms_norm_quant",
                   (ns::add_rms_norm_quant<T>(x.data_ptr<T>(), r.defined() ? r.data_ptr<T>() : nullptr,
                                              w.data_ptr<T>(), q.data_ptr<int8_t>(), qs.data_ptr<float>(), rows, n,
                                              e)));
  return {q, qs};
}

// gu [T, 2I] = [gate | up] -> silu_mul's silu(gate) * up quantized: (int8 [T, I], fp32 scales [T]).
std::tuple<at::Tensor, at::Tensor> silu_mul_quant(at::Tensor gu, int64_t isa) {
  gu = gu.contiguous();
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0, "silu_mul_quant: gu must be [rows, 2I]");
  const int64_t rows = gu.size(0), n = gu.size(1) / 2;
  auto q = at::empty({rows, n}, gu.options().dtype(at::kChar));
  auto qs = at::empty({rows}, gu.options().dtype(at::kFloat));
  CARPOOL_DISPATCH(isa, gu.scalar_type(), "silu_mul_quant",
                   (ns::silu_mul_quant<T>(gu.data_ptr<T>(), q.data_ptr<int8_t>(), qs.data_ptr<float>(), rows, n)));
  return {q, qs};
}

}  // namespace carpool
