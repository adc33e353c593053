// Small SIMD vocabulary shared by the kernels: one namespace per instruction set, each with the
// same names (Vf, W, load, store, fmadd, gather, reduce_add, exp, store_i8, ...), so a kernel
// body written once is compiled three times (see per_isa.h) and the right copy is picked at run time.
//
// The build uses no -march flag: every AVX2 / AVX-512 function is compiled under a
// `#pragma GCC target` region, so one .so runs on any x86-64 CPU and the dispatcher
// (carpool::best_isa) chooses the widest copy the CPU and the OS support.
//
// Rounding: conversions to bf16 round to nearest even exactly as c10::BFloat16 does (NaN -> 0x7fc0),
// to fp16 as c10::Half does, so a kernel output equals what the same math in torch would store.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace carpool {

// The instruction sets a kernel can be compiled for, widest last.  The values are part of the
// Python interface (Kernels.isa).
enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// The widest instruction set this CPU and OS run (libgcc's cpu model checks the OS saves the
// AVX/AVX-512 state, not only the CPUID bits).
inline int64_t best_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
    return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return kAvx2;
#endif
  return kScalar;
}

// Cephes' single-precision exp: exp(x) = 2^n * p(r), r = x - n ln2, |r| <= ln2/2; ~1 ulp on
// [-87, 88].  Below -87.3 the result is 0 (softmax inputs are <= 0 after the max is taken, and
// e^-87 is far below the sum it is added to); above 88.3 it saturates at e^88.3.
constexpr float kExpLo = -87.3f, kExpHi = 88.3f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f,
                kP3 = 4.1665795894e-2f, kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

// ---------------------------------------------------------------------------------- scalar
namespace scalar {
struct Vf {
  float v;
};
constexpr int W = 1;
inline Vf zero() { return {0.f}; }
inline Vf set1(float x) { return {x}; }
inline Vf load(const float* p) { return {*p}; }
inline Vf load(const c10::BFloat16* p) { return {static_cast<float>(*p)}; }
inline Vf load(const c10::Half* p) { return {static_cast<float>(*p)}; }
inline void store(float* p, Vf x) { *p = x.v; }
inline void store(c10::BFloat16* p, Vf x) { *p = c10::BFloat16(x.v); }
inline void store(c10::Half* p, Vf x) { *p = c10::Half(x.v); }
inline Vf round_bf16(Vf x) { return {static_cast<float>(c10::BFloat16(x.v))}; }
inline Vf round_half(Vf x) { return {static_cast<float>(c10::Half(x.v))}; }
inline Vf add(Vf a, Vf b) { return {a.v + b.v}; }
inline Vf sub(Vf a, Vf b) { return {a.v - b.v}; }
inline Vf mul(Vf a, Vf b) { return {a.v * b.v}; }
inline Vf div(Vf a, Vf b) { return {a.v / b.v}; }
inline Vf fmadd(Vf a, Vf b, Vf c) { return {a.v * b.v + c.v}; }
inline Vf max(Vf a, Vf b) { return {a.v > b.v ? a.v : b.v}; }
inline Vf gather(const float* base, int stride) { (void)stride; return {*base}; }
inline float reduce_add(Vf a) { return a.v; }
inline float reduce_max(Vf a) { return a.v; }
inline Vf exp(Vf x) { return {x.v < kExpLo ? 0.f : std::exp(x.v)}; }
inline Vf load(const int32_t* p) { return {static_cast<float>(*p)}; }
inline Vf load(const int8_t* p) { return {static_cast<float>(*p)}; }
inline Vf vabs(Vf a) { return {std::fabs(a.v)}; }
// Bit i set where a[i] > b[i] (false for NaN).
inline unsigned gt_mask(Vf a, Vf b) { return a.v > b.v ? 1u : 0u; }
// Rounds to nearest (ties to even, as torch.round) and saturates to [-128, 127].
inline void store_i8(int8_t* p, Vf x) {
  const float r = std::nearbyint(x.v);
  *p = static_cast<int8_t>(r > 127.f ? 127.f : (r < -128.f ? -128.f : r));
}
}  // namespace scalar

// ------------------------------------------------------------------------------------ AVX2
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
struct Vf {
  __m256 v;
};
constexpr int W = 8;
inline Vf zero() { return {_mm256_setzero_ps()}; }
inline Vf set1(float x) { return {_mm256_set1_ps(x)}; }
inline Vf load(const float* p) { return {_mm256_loadu_ps(p)}; }
inline Vf load(const c10::BFloat16* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
}
inline Vf load(const c10::Half* p) { return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
inline void store(float* p, Vf x) { _mm256_storeu_ps(p, x.v); }
// x rounded to bf16 (nearest even, NaN -> 0x7fc0) and widened back, in registers (round_half: to
// fp16); store(BFloat16*) keeps the high half of each of its values.
inline Vf round_bf16(Vf x) {
  __m256i u = _mm256_castps_si256(x.v);
  __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                  _mm256_set1_epi32(0x7fff));
  __m256i r = _mm256_and_si256(_mm256_add_epi32(u, bias), _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x.v, x.v, _CMP_UNORD_Q));
  return {_mm256_castsi256_ps(_mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), nan))};
}
inline void store(c10::BFloat16* p, Vf x) {
  __m256i r = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(x).v), 16);
  __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline void store(c10::Half* p, Vf x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline Vf round_half(Vf x) { return {_mm256_cvtph_ps(_mm256_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))}; }
inline Vf add(Vf a, Vf b) { return {_mm256_add_ps(a.v, b.v)}; }
inline Vf sub(Vf a, Vf b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline Vf mul(Vf a, Vf b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline Vf div(Vf a, Vf b) { return {_mm256_div_ps(a.v, b.v)}; }
inline Vf fmadd(Vf a, Vf b, Vf c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline Vf max(Vf a, Vf b) { return {_mm256_max_ps(a.v, b.v)}; }
inline Vf gather(const float* base, int stride) {
  const __m256i idx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(stride));
  return {_mm256_i32gather_ps(base, idx, 4)};
}
inline float reduce_add(Vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float reduce_max(Vf a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline Vf exp(Vf x) {
  __m256 under = _mm256_cmp_ps(x.v, _mm256_set1_ps(kExpLo), _CMP_LT_OQ);
  __m256 xc = _mm256_min_ps(_mm256_max_ps(x.v, _mm256_set1_ps(kExpLo)), _mm256_set1_ps(kExpHi));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kP0);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP5));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);  // n * 2^23 added to the exponent bits
  __m256 y = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
  return {_mm256_andnot_ps(under, y)};
}
inline Vf load(const int32_t* p) { return {_mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
inline Vf load(const int8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
}
inline Vf vabs(Vf a) { return {_mm256_andnot_ps(_mm256_set1_ps(-0.f), a.v)}; }
inline unsigned gt_mask(Vf a, Vf b) { return static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(a.v, b.v, _CMP_GT_OQ))); }
// Rounds to nearest even (the default MXCSR mode, as torch.round) and saturates to [-128, 127].
inline void store_i8(int8_t* p, Vf x) {
  const __m256i i = _mm256_cvtps_epi32(x.v);
  const __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(h, h));
}
}  // namespace avx2
#pragma GCC pop_options

// --------------------------------------------------------------------------------- AVX-512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")
namespace avx512 {
struct Vf {
  __m512 v;
};
constexpr int W = 16;
inline Vf zero() { return {_mm512_setzero_ps()}; }
inline Vf set1(float x) { return {_mm512_set1_ps(x)}; }
inline Vf load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Vf load(const c10::BFloat16* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
}
inline Vf load(const c10::Half* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
inline void store(float* p, Vf x) { _mm512_storeu_ps(p, x.v); }
inline Vf round_bf16(Vf x) {
  __m512i u = _mm512_castps_si512(x.v);
  __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                  _mm512_set1_epi32(0x7fff));
  __m512i r = _mm512_and_si512(_mm512_add_epi32(u, bias), _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  __mmask16 nan = _mm512_cmp_ps_mask(x.v, x.v, _CMP_UNORD_Q);
  return {_mm512_castsi512_ps(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc00000)))};
}
inline void store(c10::BFloat16* p, Vf x) {
  __m512i r = _mm512_srli_epi32(_mm512_castps_si512(round_bf16(x).v), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
inline void store(c10::Half* p, Vf x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline Vf round_half(Vf x) { return {_mm512_cvtph_ps(_mm512_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))}; }
inline Vf add(Vf a, Vf b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vf sub(Vf a, Vf b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vf mul(Vf a, Vf b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vf div(Vf a, Vf b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vf fmadd(Vf a, Vf b, Vf c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Vf max(Vf a, Vf b) { return {_mm512_max_ps(a.v, b.v)}; }
inline Vf gather(const float* base, int stride) {
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(stride));
  return {_mm512_i32gather_ps(idx, base, 4)};
}
inline float reduce_add(Vf a) { return _mm512_reduce_add_ps(a.v); }
inline float reduce_max(Vf a) { return _mm512_reduce_max_ps(a.v); }
inline Vf exp(Vf x) {
  __mmask16 under = _mm512_cmp_ps_mask(x.v, _mm512_set1_ps(kExpLo), _CMP_LT_OQ);
  __m512 xc = _mm512_min_ps(_mm512_max_ps(x.v, _mm512_set1_ps(kExpLo)), _mm512_set1_ps(kExpHi));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kP0);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP5));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return {_mm512_maskz_scalef_ps(static_cast<__mmask16>(~under), p, n)};
}
inline Vf load(const int32_t* p) { return {_mm512_cvtepi32_ps(_mm512_loadu_si512(p))}; }
inline Vf load(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
inline Vf vabs(Vf a) { return {_mm512_abs_ps(a.v)}; }
inline unsigned gt_mask(Vf a, Vf b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ); }
// Rounds to nearest even (the default MXCSR mode, as torch.round) and saturates to [-128, 127].
inline void store_i8(int8_t* p, Vf x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(x.v)));
}
}  // namespace avx512
#pragma GCC pop_options

}  // namespace carpool

// The one dispatch of every op onto per_isa.h's copies of the kernel headers.
// CARPOOL_ISA runs CALL with `ns` naming the namespace of instruction set `isa`; CARPOOL_DISPATCH
// also checks the CPU runs `isa` and makes `T` the element type of `dtype` (bf16, fp32, fp16),
// naming the op `name` in its errors.
#define CARPOOL_ISA(isa, CALL)                          \
  switch (isa) {                                        \
    case ::carpool::kAvx512: {                          \
      namespace ns = ::carpool::avx512;                 \
      CALL;                                             \
      break;                                            \
    }                                                   \
    case ::carpool::kAvx2: {                            \
      namespace ns = ::carpool::avx2;                   \
      CALL;                                             \
      break;                                            \
    }                                                   \
    default: {                                          \
      namespace ns = ::carpool::scalar;                 \
      CALL;                                             \
    }                                                   \
  }

#define CARPOOL_DISPATCH(isa, dtype, name, CALL)                                                          \
  [&] {                                                                                                   \
    TORCH_CHECK((isa) >= 0 && (isa) <= ::carpool::best_isa(), name ": instruction set ", isa,            \
                " is not supported by this CPU");                                                         \
    auto run_isa = [&](auto tag) {                                                                        \
      using T = decltype(tag);                                                                            \
      CARPOOL_ISA(isa, CALL)                                                                              \
    };                                                                                                    \
    switch (dtype) {                                                                                      \
      case at::kBFloat16: run_isa(at::BFloat16()); break;                                                 \
      case at::kFloat: run_isa(float()); break;                                                           \
      case at::kHalf: run_isa(at::Half()); break;                                                         \
      default: TORCH_CHECK(false, name ": unsupported dtype ", dtype);                                    \
    }                                                                                                     \
  }()
