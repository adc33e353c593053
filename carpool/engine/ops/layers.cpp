// The decoder layer's row-wise ops (kernels in layer_kernels.h): residual add + RMSNorm, SiLU * up,
// and RoPE in place on the fused q|k|v projection.  One parallel pass each instead of a chain of
// torch ops; on SmolLM2 they took ~5% of a long-prompt step as torch ops (engine_profile.py).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <type_traits>

#include "simd.h"

#define CARPOOL_KERNELS "layer_kernels.h"
#include "per_isa.h"

namespace carpool {

namespace {

// Runs CALL with `ns` naming the instruction set's namespace and `T` the tensor's element type.
#define CARPOOL_DISPATCH(isa, dtype, name, CALL)                                                 \
  [&] {                                                                                          \
    TORCH_CHECK(isa <= best_isa(), name ": instruction set ", isa, " is not supported by this CPU"); \
    auto run_isa = [&](auto tag) {                                                               \
      using T = decltype(tag);                                                                   \
      switch (isa) {                                                                             \
        case kAvx512: { namespace ns = avx512; CALL; break; }                                    \
        case kAvx2: { namespace ns = avx2; CALL; break; }                                        \
        default: { namespace ns = scalar; CALL; }                                                \
      }                                                                                          \
    };                                                                                           \
    switch (dtype) {                                                                             \
      case at::kBFloat16: run_isa(at::BFloat16()); break;                                        \
      case at::kFloat: run_isa(float()); break;                                                  \
      case at::kHalf: run_isa(at::Half()); break;                                                \
      default: TORCH_CHECK(false, name ": unsupported dtype ", dtype);                           \
    }                                                                                            \
  }()

}  // namespace

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

}  // namespace carpool
