// The int8 x int8 linear's row-wise ends (quant.py, EngineConfig.quantization="int8"), written
// once against simd.h's vocabulary and included by layers.cpp once per instruction set (after
// layer_kernels.h, whose round_as they use).  The GEMM itself stays torch._int_mm (oneDNN, VNNI);
// these kernels are what comes before and after it:
// - before: quantize each row of activations to int8 with its own fp32 scale (amax / 127), fused
//   into the op that produces the row (residual add + RMSNorm, SiLU * up) so that op writes int8;
// - after: the int32 accumulator times row scale times column scale, rounded to the model dtype,
//   fused into the op that consumes it (residual add + RMSNorm, SiLU * up).
// Why kernels: in torch ops the two ends were ~12 small ops per linear (x.float, abs, amax, clamp,
// mul, round, to(int8), _int_mm, .float, mul, mul, to(bf16)), ~2500 per decode step of SmolLM2,
// each waking the thread pool; measured, that made int8 0.65-0.80x of bf16 although the int8 GEMM
// alone is ~1.8x faster (docs/engine.md).
//
// The math follows the torch reference (quant.quantize_rows, quant.dequantize) op for op:
// q = round(x * ((1 / amax) * 127)) (ties to even), row scale = amax * (1 / 127),
// y = T((acc * row scale) * column scale), then the consumer's own rounding as layer_kernels.h
// does; so each kernel's output equals those torch ops around the existing add_rms_norm and
// silu_mul kernels bit for bit (tests/engine/test_kernels.py).


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

// acc [., n] int32 at column k -> T((acc * rs) * cs[k]) (+ bias, rounded to T again), as fp32.
template <typename T>
inline Vf dequant(const int32_t* a, float rs, const float* cs, const T* b, int64_t k) {
  Vf y = round_as<T>(mul(mul(load(a + k), set1(rs)), load(cs + k)));
  if (b) y = round_as<T>(add(y, load(b + k)));
  return y;
}

template <typename T>
inline float dequant_scalar(const int32_t* a, float rs, const float* cs, const T* b, int64_t k) {
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

// One row: a [n] int32 scaled back into o [n] in T with row scale rs.
template <typename T>
inline void dequantize_row(const int32_t* a, float rs, const float* cs, const T* bias, T* o, int64_t n) {
  const int64_t nv = n / W * W;
  for (int64_t k = 0; k < nv; k += W) store(o + k, dequant(a, rs, cs, bias, k));
  for (int64_t k = nv; k < n; ++k) o[k] = static_cast<T>(dequant_scalar(a, rs, cs, bias, k));
}

// acc [rows, n] int32 -> out [rows, n] in T (the fused q|k|v projection's output).
template <typename T>
void dequantize(const int32_t* acc, const float* rs, const float* cs, const T* bias, T* out, int64_t rows,
                int64_t n) {
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dequantize_row(acc + i * n, rs[i], cs, bias, out + i * n, n);
  });
}

// dequantize, then rope_row (layer_kernels.h) on each row: the q|k|v projection's scale-back and
// RoPE in one pass.  pos [rows]; cos/sin [max_pos, d/2] in T.
template <typename T>
void dequantize_rope(const int32_t* acc, const float* rs, const float* cs, const T* bias, T* out, int64_t rows,
                     int64_t n, const int64_t* pos, const T* cos, const T* sin, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      dequantize_row(acc + i * n, rs[i], cs, bias, out + i * n, n);
      rope_row(out + i * n, cos + pos[i] * half, sin + pos[i] * half, heads, d);
    }
  });
}

// x [rows, n] += dequant(acc) (in place, rounded to T; skipped when acc is null), then
// h = T(w * T(x / rms(x))) as add_rms_norm; h is written to `out` (T) when given, else quantized
// into q [rows, n] / qs [rows].
template <typename T>
void dequant_add_rms_norm(T* x, const int32_t* acc, const float* rs, const float* cs, const T* bias, const T* w,
                          T* out, int8_t* q, float* qs, int64_t rows, int64_t n, float eps) {
  const int64_t nv = n / W * W;
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(q ? n : 0);
    for (int64_t i = begin; i < end; ++i) {
      T* xi = x + i * n;
      Vf ss = zero();
      float ss_tail = 0.f;
      if (acc) {
        const int32_t* a = acc + i * n;
        for (int64_t k = 0; k < nv; k += W) {
          const Vf v = round_as<T>(add(load(xi + k), dequant(a, rs[i], cs, bias, k)));
          store(xi + k, v);
          ss = fmadd(v, v, ss);
        }
        for (int64_t k = nv; k < n; ++k) {
          const float v = round_as_scalar<T>(static_cast<float>(xi[k]) + dequant_scalar(a, rs[i], cs, bias, k));
          xi[k] = static_cast<T>(v);
          ss_tail += v * v;
        }
      } else {
        for (int64_t k = 0; k < nv; k += W) {
          const Vf v = load(xi + k);
          ss = fmadd(v, v, ss);
        }
        for (int64_t k = nv; k < n; ++k) ss_tail += static_cast<float>(xi[k]) * static_cast<float>(xi[k]);
      }
      const float inv = 1.f / std::sqrt((reduce_add(ss) + ss_tail) / static_cast<float>(n) + eps);
      const Vf iv = set1(inv);
      if (q) {
        float* bi = buf.data();
        for (int64_t k = 0; k < nv; k += W) store(bi + k, round_as<T>(mul(load(w + k), round_as<T>(mul(load(xi + k), iv)))));
        for (int64_t k = nv; k < n; ++k)
          bi[k] = round_as_scalar<T>(static_cast<float>(w[k]) * round_as_scalar<T>(static_cast<float>(xi[k]) * inv));
        qs[i] = quantize_row(bi, n, q + i * n);
      } else {
        T* oi = out + i * n;
        for (int64_t k = 0; k < nv; k += W) store(oi + k, mul(load(w + k), round_as<T>(mul(load(xi + k), iv))));
        for (int64_t k = nv; k < n; ++k)
          oi[k] = static_cast<T>(static_cast<float>(w[k]) * round_as_scalar<T>(static_cast<float>(xi[k]) * inv));
      }
    }
  });
}

// acc [rows, 2n] int32 = [gate | up] -> p = T(T(silu(gate)) * up) (gate and up dequantized to T
// first), quantized into q [rows, n] / qs [rows].
template <typename T>
void dequant_silu_mul_quant(const int32_t* acc, const float* rs, const float* cs, int8_t* q, float* qs, int64_t rows,
                            int64_t n) {
  const int64_t nv = n / W * W;
  const T* no_bias = nullptr;
  at::parallel_for(0, rows, silu_row_grain(n), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(n);
    float* bi = buf.data();
    for (int64_t i = begin; i < end; ++i) {
      const int32_t* g = acc + i * 2 * n;
      const int32_t* u = g + n;
      for (int64_t k = 0; k < nv; k += W) {
        const Vf a = dequant(g, rs[i], cs, no_bias, k);
        const Vf s = round_as<T>(div(a, add(set1(1.f), exp(sub(zero(), a)))));
        store(bi + k, round_as<T>(mul(s, dequant(u, rs[i], cs + n, no_bias, k))));
      }
      for (int64_t k = nv; k < n; ++k) {
        const float a = dequant_scalar(g, rs[i], cs, no_bias, k);
        bi[k] = round_as_scalar<T>(round_as_scalar<T>(a / (1.f + std::exp(-a))) *
                                   dequant_scalar(u, rs[i], cs + n, no_bias, k));
      }
      qs[i] = quantize_row(bi, n, q + i * n);
    }
  });
}
