// The Python module of carpool's kernels: the ops of attention.cpp and layers.cpp (with the int8
// linear's ends), decode_gemm.cpp's GEMMs (the row counts the engine plan sends them), and the instruction
// set dispatch level (best_isa) the Python side passes back to every call.
#include <torch/extension.h>

#include "attention_bf16.h"
#include "simd.h"

namespace carpool {
at::Tensor attention(at::Tensor qkv, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping,
                     at::Tensor block_tables, at::Tensor seq_of_row, at::Tensor ctx_len, int64_t num_kernel_rows,
                     at::Tensor flash_seqs, int64_t num_heads, double scale, int64_t isa);
at::Tensor add_rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor w, double eps, int64_t isa);
at::Tensor silu_mul(at::Tensor gu, int64_t isa);
at::Tensor top_k_rows(at::Tensor x, int64_t k, int64_t isa);
void rope_(at::Tensor qkv, at::Tensor positions, at::Tensor cos, at::Tensor sin, int64_t heads, int64_t head_dim,
           int64_t isa);
std::tuple<at::Tensor, at::Tensor> quantize_rows(at::Tensor x, int64_t isa);
at::Tensor int8_dequantize(at::Tensor acc, at::Tensor rs, at::Tensor cs, c10::optional<at::Tensor> bias,
                           at::ScalarType dtype, int64_t isa);
std::tuple<at::Tensor, at::Tensor> add_rms_norm_quant(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor w,
                                                      double eps, int64_t isa);
std::tuple<at::Tensor, at::Tensor> silu_mul_quant(at::Tensor gu, int64_t isa);
bool cpu_has_vnni_gemm();
at::Tensor int8_gemm(at::Tensor x, at::Tensor packed, int64_t n, bool split_rows);
at::Tensor int8_gemm_dequant(at::Tensor x, at::Tensor packed, int64_t n, at::Tensor row_scale, at::Tensor col_scale,
                             c10::optional<at::Tensor> bias, at::ScalarType dtype, bool split_rows);
at::Tensor bf16_gemm(at::Tensor x, at::Tensor packed, int64_t n, bool split_rows);
void set_row_grains(int64_t light_values, int64_t silu_values);
std::tuple<int64_t, int64_t> row_grains();
}  // namespace carpool

// The compute ops run without the GIL, as torch's own ops do: a server's event loop shares the
// process with the engine's thread, and while a kernel held the GIL an arriving request could
// not even be read (it waited for the interpreter's switch interval, ~5 ms, at every hand-over).
// Their arguments are converted before the release and nothing in them touches Python objects.
namespace {
const pybind11::call_guard<pybind11::gil_scoped_release> kNoGil;
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("best_isa", &carpool::best_isa, "widest instruction set this CPU runs: 0 scalar, 1 AVX2, 2 AVX-512");
  m.def("attention", &carpool::attention, kNoGil, "paged attention of a flat batch (writes the new K/V first)");
  m.def("cpu_has_avx512_bf16", &carpool::cpu_has_avx512_bf16, "whether this CPU runs AVX-512 BF16");
  m.def("attention_bf16_enabled", &carpool::attention_bf16_enabled,
        "whether bf16 prefill blocks run on AVX-512 BF16 dot products (default: where the CPU has them)");
  m.def("cpu_has_avx512_vnni", &carpool::cpu_has_avx512_vnni, "whether this CPU runs AVX-512 VNNI (and BF16)");
  m.def("attention_int8_enabled", &carpool::attention_int8_enabled,
        "whether decode rows of an int8 KV cache are read as int8 (default: where the CPU has VNNI)");
  m.def("set_attention_int8_enabled", &carpool::set_attention_int8_enabled,
        "off: decode rows of an int8 KV cache are staged into bf16 like every other item (tests compare)");
  m.def("set_attention_bf16_enabled", &carpool::set_attention_bf16_enabled,
        "turn the AVX-512 BF16 prefill path on (where the CPU has it) or off (the fp32 path)");
  m.def("set_row_grains", &carpool::set_row_grains,
        "values a row-wise pass holds at most to run on one thread: (light ops, SiLU * up)");
  m.def("row_grains", &carpool::row_grains, "the limits set_row_grains set: (light ops, SiLU * up)");
  m.def("add_rms_norm", &carpool::add_rms_norm, kNoGil, "x += residual (in place, optional); returns rms_norm(x) * w");
  m.def("silu_mul", &carpool::silu_mul, kNoGil, "[gate | up] -> silu(gate) * up");
  m.def("top_k_rows", &carpool::top_k_rows, kNoGil, "each row's k largest columns, largest first");
  m.def("rope_", &carpool::rope_, kNoGil, "rotate-half RoPE in place on the q and k heads of qkv");
  m.def("quantize_rows", &carpool::quantize_rows, kNoGil, "each row to int8 with its own fp32 scale (amax / 127)");
  m.def("int8_dequantize", &carpool::int8_dequantize, kNoGil, "int32 acc * row scale * column scale (+ bias) -> dtype");
  m.def("add_rms_norm_quant", &carpool::add_rms_norm_quant, kNoGil,
        "x += residual (in place, optional), then rms_norm(x) * w quantized to int8 rows");
  m.def("silu_mul_quant", &carpool::silu_mul_quant, kNoGil, "[gate | up] -> silu(gate) * up, quantized to int8 rows");
  m.def("cpu_has_vnni_gemm", &carpool::cpu_has_vnni_gemm, "whether this CPU runs int8_gemm (AVX-512 VNNI)");
  m.def("int8_gemm", &carpool::int8_gemm, kNoGil, "int8 [M, K] x a pack_vnni weight -> int32 [M, N] (AVX-512 VNNI)",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("split_rows") = false);
  m.def("int8_gemm_dequant", &carpool::int8_gemm_dequant, kNoGil,
        "int8_gemm scaled back: T((sums * row scale) * column scale) (+ bias) [M, N] in dtype",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("row_scale"), py::arg("col_scale"), py::arg("bias"),
        py::arg("dtype"), py::arg("split_rows") = false);
  m.def("bf16_gemm", &carpool::bf16_gemm, kNoGil, "bf16 [M, K] x a pack_bf16 weight -> bf16 [M, N] (AVX-512 BF16)",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("split_rows") = false);
}
