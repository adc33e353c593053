// The Python module of carpool's kernels: the ops of attention.cpp and layers.cpp, and the
// instruction set dispatch level (best_isa) the Python side passes back to every call.
#include <torch/extension.h>

#include "simd.h"

namespace carpool {
at::Tensor attention(at::Tensor qkv, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping,
                     at::Tensor block_tables, at::Tensor seq_of_row, at::Tensor ctx_len, int64_t num_kernel_rows,
                     at::Tensor flash_seqs, int64_t num_heads, double scale, int64_t isa);
at::Tensor add_rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor w, double eps, int64_t isa);
at::Tensor silu_mul(at::Tensor gu, int64_t isa);
void rope_(at::Tensor qkv, at::Tensor positions, at::Tensor cos, at::Tensor sin, int64_t heads, int64_t head_dim,
           int64_t isa);
}  // namespace carpool

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("best_isa", &carpool::best_isa, "widest instruction set this CPU runs: 0 scalar, 1 AVX2, 2 AVX-512");
  m.def("attention", &carpool::attention, "paged attention of a flat batch (writes the new K/V first)");
  m.def("add_rms_norm", &carpool::add_rms_norm, "x += residual (in place, optional); returns rms_norm(x) * w");
  m.def("silu_mul", &carpool::silu_mul, "[gate | up] -> silu(gate) * up");
  m.def("rope_", &carpool::rope_, "rotate-half RoPE in place on the q and k heads of qkv");
}
