// The int8 x int8 linear's row-wise ends (quant.py, EngineConfig.quantization="int8"), written
// once against simd.h's vocabulary and included by layers.cpp once per instruction set (after
// layer_kernels.h, whose round_as and row kernels they use).  The GEMM is
// decode_gemm.cpp's (where the engine plan sends the rows; its store scales the int32 sums back to
// the model dtype) or torch._int_mm (oneDNN; then `dequantize` below scales them back); these kernels
// are what comes before and after it:
// - before: quantize each row of activations to int8 with its own fp32 scale (amax / 127), fused
//   into the op that produces the row (residual add + RMSNorm, SiLU * up) so that op writes int8;
// - after: the int32 sums times row scale times column scale, rounded to the model dtype.
// Why kernels: in torch ops the two ends were ~12 small ops per linear (x.float, abs, amax, clamp,
// mul, round, to(int8), _int_mm, .float, mul, mul, to(bf16)), ~2500 per decode step of SmolLM2,
// each waking the thread pool; measured, that made int8 0.65-0.80x of bf16 although the int8 GEMM
// alone is ~1.8x faster (docs/engine.md).
//
// The math follows the torch reference (quant.quantize_rows, quant.dequantize) op for op:
// q = round(x * ((1 / amax) * 127)) (ties to even), row scale = amax * (1 / 127),
// y = T((acc * row scale) * column scale); so each kernel's output equals those torch ops around
// the add_rms_norm and silu_mul kernels bit for bit (tests/engine/test_kernels.py).


// Quantizes n values (already rounded to the model dtype) to int8; returns the row's scale.
template <typename S>
inline float quantize_row(const S* v, int64_t n, int8_t* q) {
  const int64_t nv = n / W * W;
  Vf m = zero();
  float m_tail = 0.f;
  for (int64_t k = 0; k < nv; k += W) m = max(m, vabs(load(v + k)));
  for (int64_t k = nv; k < n; ++k) m_tail = std::max(m_tail, std::fabs(static_cast<float>(v[k])));
  const float amax = std::max(std::max(reduce_max(m), m_tail), 1e-12f);
  const float inv = (1.f / amax) * 127.f;  // torch's 127.0 / tensor is reciprocal(tensor) * 127
  const Vf iv = set1(inv);
  for (int64_t k = 0; k < nv; k += W) store_i8(q + k, mul(load(v + k), iv));
  for (int64_t k = nv; k < n; ++k) {
    const float r = std::nearbyint(static_cast<float>(v[k]) * inv);
    q[k] = static_cast<int8_t>(std::min(127.f, std::max(-128.f, r)));
  }
  return amax * (1.f / 127.f);
}

// acc [., n] at column k -> T((acc * rs) * cs[k]) (+ bias, rounded to T again), as fp32.  The sums
// come as int32 or already as fp32 (oneDNN's prepacked int8 GEMM writes them so: float(acc), the
// value the int32 ones are converted to here).
template <typename T, typename A>
inline Vf dequant(const A* a, float rs, const float* cs, const T* b, int64_t k) {
  Vf y = round_as<T>(mul(mul(load(a + k), set1(rs)), load(cs + k)));
  if (b) y = round_as<T>(add(y, load(b + k)));
  return y;
}

template <typename T, typename A>
inline float dequant_scalar(const A* a, float rs, const float* cs, const T* b, int64_t k) {
  float y = round_as_scalar<T>(static_cast<float>(a[k]) * rs * cs[k]);
  if (b) y = round_as_scalar<T>(y + static_cast<float>(b[k]));
  return y;
}

// x [rows, n] -> q int8 [rows, n], qs [rows]
template <typename T>
void quantize_rows(const T* x, int8_t* q, float* qs, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) qs[i] = quantize_row(x + i * n, n, q + i * n);
  });
}

// One row: a [n] sums scaled back into o [n] in T with row scale rs.
template <typename T, typename A>
inline void dequantize_row(const A* a, float rs, const float* cs, const T* bias, T* o, int64_t n) {
  const int64_t nv = n / W * W;
  for (int64_t k = 0; k < nv; k += W) store(o + k, dequant(a, rs, cs, bias, k));
  for (int64_t k = nv; k < n; ++k) o[k] = static_cast<T>(dequant_scalar(a, rs, cs, bias, k));
}

// acc [rows, n] (int32 or fp32 sums) -> out [rows, n] in T (the fused q|k|v projection's output).
template <typename T, typename A>
void dequantize(const A* acc, const float* rs, const float* cs, const T* bias, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dequantize_row(acc + i * n, rs[i], cs, bias, out + i * n, n);
  });
}

// x [rows, n] (x += r in place when r is given, rounded to T) -> add_rms_norm's h = T(w * T(x /
// rms(x))) quantized into q [rows, n] / qs [rows]: the RMSNorm before an int8 linear.  Each row of
// h is computed by add_rms_norm's own row kernel into a buffer, then quantized.
template <typename T>
void add_rms_norm_quant(T* x, const T* r, const T* w, int8_t* q, float* qs, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    std::vector<float> h(n);
    for (int64_t i = begin; i < end; ++i) {
      add_rms_norm_row<T>(x + i * n, r ? r + i * n : nullptr, w, h.data(), n, eps);
      qs[i] = quantize_row(h.data(), n, q + i * n);
    }
  });
}

// gu [rows, 2n] = [gate | up] -> silu_mul's p = T(T(silu(gate)) * up) quantized into q [rows, n] /
// qs [rows]: SiLU * up before the int8 down projection (silu_mul's row kernel, then quantized).
template <typename T>
void silu_mul_quant(const T* gu, int8_t* q, float* qs, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, silu_row_grain(n), [&](int64_t begin, int64_t end) {
    std::vector<float> p(n);
    for (int64_t i = begin; i < end; ++i) {
      silu_mul_row<T>(gu + i * 2 * n, gu + i * 2 * n + n, p.data(), n);
      qs[i] = quantize_row(p.data(), n, q + i * n);
    }
  });
}
