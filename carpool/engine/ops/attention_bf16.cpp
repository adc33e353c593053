// Prefill and decode attention with AVX-512 BF16 dot products, for bf16 models on CPUs that have them
// (Zen 4, Cooper Lake, Sapphire Rapids and later).
//
// Why its own kernel: on the long mixed workload (prompts of 20-2000 tokens) attention was a third
// of the engine's time, running at ~140 GFLOP/s on fp32 FMAs (the tiled path of
// attention_kernels.h), and torch's CPU flash attention was slower still without AMX.  vdpbf16ps
// multiplies 32 bf16 pairs into 16 fp32 sums per instruction, twice the fp32 FMA rate, and reads
// the cache's bf16 as it is (no conversion to fp32).
//
// Layout: the lanes of a vector run over the item's query vectors (rows x query heads of one KV
// head, padded to 16), so
// - scores: S[key][query] += q pair . k pair, the key's pair broadcast straight from the paged
//   cache, the queries' pairs packed once per item ([pair][query]); no key transpose;
// - softmax: max, exp and sum run down the key axis, a whole vector of queries at a time (no
//   horizontal reductions);
// - values: out^T[d][query] += P pair . v pair, with the probabilities rounded to bf16 after
//   normalisation (as HF's eager attention does before its bf16 matmul), packed as (key 2m,
//   key 2m+1) pairs, and the value rows interleaved in pairs the same way.
// Accumulation is fp32 throughout; the output is rounded to bf16 as c10::BFloat16 does.
#include "attention_bf16.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "simd.h"

namespace carpool {

bool cpu_has_avx512_bf16() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return best_isa() == kAvx512 && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

bool cpu_has_avx512_vnni() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return cpu_has_avx512_bf16() && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

namespace {
std::atomic<bool> g_enabled{cpu_has_avx512_bf16()};
std::atomic<bool> g_int8_enabled{cpu_has_avx512_vnni()};
}  // namespace

bool attention_int8_enabled() { return g_int8_enabled.load(std::memory_order_relaxed); }

void set_attention_int8_enabled(bool on) {
  g_int8_enabled.store(on && cpu_has_avx512_vnni(), std::memory_order_relaxed);
}

bool attention_bf16_enabled() { return g_enabled.load(std::memory_order_relaxed); }

void set_attention_bf16_enabled(bool on) { g_enabled.store(on && cpu_has_avx512_bf16(), std::memory_order_relaxed); }

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx512vnni,fma,f16c")

namespace {

// Accumulator registers a micro-kernel keeps (of 32): the rest hold its loaded operands.
constexpr int kAcc = 24;
// Largest power of two <= n (the value micro-kernel's block of head dims must divide head_dim).
constexpr int pow2_floor(int n) { return n >= 16 ? 16 : n >= 8 ? 8 : n >= 4 ? 4 : n >= 2 ? 2 : 1; }

// Index vectors of vpermw / vpermt2w: the 16-bit lanes (0, k, 1, k + 1, ..., 15, k + 15), which
// interleave lanes 0-15 of the first source with lanes 0-15 of the second (k = 16: the two halves
// of one vector; k = 32: two vectors).
alignas(64) constexpr int16_t kInterleave16[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                   8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
alignas(64) constexpr int16_t kInterleave32[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                   8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};

inline __m512bh as_bh(__m512i v) {
  __m512bh r;
  std::memcpy(&r, &v, sizeof r);
  return r;
}
inline __m512i as_i(__m512bh v) {
  __m512i r;
  std::memcpy(&r, &v, sizeof r);
  return r;
}

// Value rows a and b (D values each) interleaved: 32-bit lane d of out[d / 16] holds (a[d], b[d]),
// the pairing vdpbf16ps multiplies with a probability pair (p_a, p_b).
template <int D>
inline void pair_rows(const c10::BFloat16* a, const c10::BFloat16* b, __m512i* out) {
  const __m512i lo = _mm512_load_si512(kInterleave32);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int k = 0; k < D / 16; k += 2) {  // 32 head dims of each row at a time
    const __m512i va = _mm512_loadu_si512(a + k * 16), vb = _mm512_loadu_si512(b + k * 16);
    out[k] = _mm512_permutex2var_epi16(va, lo, vb);
    out[k + 1] = _mm512_permutex2var_epi16(va, hi, vb);
  }
}

// exp(scale * (x - max)) for raw scores x <= max (or -inf: 0), as 2^t with t = x * c - max * c,
// c = scale * log2(e), one fused multiply-subtract.  2^t = 2^n * 2^f, n = round(t), |f| <= 1/2,
// 2^f by a degree-5 polynomial (relative error 1.8e-7, that of an fp32 exp; fitted for this
// kernel).  Why not avx512::exp: with head_dim 64 the softmax pass costs as much as a third of
// the dot products that feed it, and this form takes 10 instructions a vector where the general
// exp (argument range checks, Cody-Waite reduction, the scale multiplied separately) took 17.
// t is clamped at -200: 2^-200 scales to exactly 0, as a masked (-inf) score must.
inline __m512 exp2_scaled(__m512 x, __m512 c, __m512 mc) {
  const __m512 t = _mm512_max_ps(_mm512_fmsub_ps(x, c, mc), _mm512_set1_ps(-200.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3220824766904116e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.671695530414581e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550885573029518e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022237956523895e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931468844413757e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

struct Scratch {
  std::vector<int32_t> qp;  // [D/2 pairs][QW queries]: each query's bf16 pairs
  std::vector<float> s;     // [rows][QW] scores (a decode row: [query][rows]), then in place the bf16 pairs
  std::vector<int32_t> vp;  // [rows/2][D]: value rows 2m and 2m+1 interleaved in pairs
  std::vector<float> o;     // [D][QW] outputs, transposed (a decode row: [query][D] sums between chunks)
  std::vector<int64_t> offs;
};

Scratch& scratch() {  // one a thread, grown to the largest item it has run
  thread_local Scratch sc;
  return sc;
}

// S[l0 + b][:] = q . k_{l0+b} (unscaled: exp2_scaled applies the scale) for LB keys, QZ vectors of
// queries; from key minlen on, -inf where a query's context cv ends; mx keeps each query's running
// maximum.
template <int QZ, int LB, int P>
inline void score_block(const int32_t* qp, const c10::BFloat16* kc, const int64_t* offs, int64_t l0,
                        const __m512i* cv, int64_t minlen, __m512* mx, float* s) {
  constexpr int QW = QZ * 16;
  __m512 acc[LB][QZ];
  const int32_t* kp[LB];
  for (int b = 0; b < LB; ++b) {
    kp[b] = reinterpret_cast<const int32_t*>(kc + offs[l0 + b]);
    _mm_prefetch(reinterpret_cast<const char*>(kc + offs[l0 + LB + b]), _MM_HINT_T0);
    if (P * 4 > 64) _mm_prefetch(reinterpret_cast<const char*>(kc + offs[l0 + LB + b]) + 64, _MM_HINT_T0);
    for (int z = 0; z < QZ; ++z) acc[b][z] = _mm512_setzero_ps();
  }
  for (int p = 0; p < P; ++p) {
    __m512bh qv[QZ];
    for (int z = 0; z < QZ; ++z) qv[z] = as_bh(_mm512_loadu_si512(qp + p * QW + z * 16));
    for (int b = 0; b < LB; ++b) {
      const __m512bh kb = as_bh(_mm512_set1_epi32(kp[b][p]));
      for (int z = 0; z < QZ; ++z) acc[b][z] = _mm512_dpbf16_ps(acc[b][z], qv[z], kb);
    }
  }
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  for (int b = 0; b < LB; ++b)
    for (int z = 0; z < QZ; ++z) {
      __m512 v = acc[b][z];
      if (l0 + b >= minlen)
        v = _mm512_mask_mov_ps(v, _mm512_cmpge_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(l0 + b)), cv[z]), ninf);
      mx[z] = _mm512_max_ps(mx[z], v);
      _mm512_storeu_ps(s + (l0 + b) * QW + z * 16, v);
    }
}

// o[d0 + j][:] = inv * (sum over key pairs m of P pair . v pair), for DB head dims from d0.
template <int QZ, int DB, int D>
inline void value_block(const int32_t* pp, const int32_t* vp, int64_t pairs, int d0, const __m512* inv, float* o) {
  constexpr int QW = QZ * 16;
  __m512 acc[DB][QZ];
  for (int j = 0; j < DB; ++j)
    for (int z = 0; z < QZ; ++z) acc[j][z] = _mm512_setzero_ps();
  for (int64_t m = 0; m < pairs; ++m) {
    __m512bh pv[QZ];
    for (int z = 0; z < QZ; ++z) pv[z] = as_bh(_mm512_loadu_si512(pp + m * QW + z * 16));
    const int32_t* vm = vp + m * D + d0;
    for (int j = 0; j < DB; ++j) {
      const __m512bh vb = as_bh(_mm512_set1_epi32(vm[j]));
      for (int z = 0; z < QZ; ++z) acc[j][z] = _mm512_dpbf16_ps(acc[j][z], pv[z], vb);
    }
  }
  for (int j = 0; j < DB; ++j)
    for (int z = 0; z < QZ; ++z) _mm512_storeu_ps(o + (d0 + j) * QW + z * 16, _mm512_mul_ps(acc[j][z], inv[z]));
}

template <int D, int QZ>
void item(const c10::BFloat16* q, int64_t q_stride, const c10::BFloat16* kc, const c10::BFloat16* vc,
          const int64_t* table, const int64_t* ctx_len, c10::BFloat16* out, int64_t out_stride, int64_t row0,
          int64_t nr, int64_t h, int64_t g, int64_t hkv, int64_t bs, float scale, Scratch& sc) {
  constexpr int P = D / 2, QW = QZ * 16, NV = D / 16;
  constexpr int LB = kAcc / QZ, DB = pow2_floor(kAcc / QZ) < D ? pow2_floor(kAcc / QZ) : D;
  const int64_t nq = nr * g;
  int64_t maxlen = 0, minlen = INT64_MAX;
  for (int64_t r = 0; r < nr; ++r) {
    maxlen = std::max(maxlen, ctx_len[row0 + r]);
    minlen = std::min(minlen, ctx_len[row0 + r]);
  }
  // Score rows: whole key blocks of the score kernel and whole key pairs of the value kernel.
  const int64_t rows = (maxlen + 2 * LB - 1) / (2 * LB) * (2 * LB), pairs = rows / 2;
  // Key offsets to maxlen, then key 0 for the padding rows and LB ahead (the prefetch).
  key_offsets(table, maxlen, rows + LB, bs, hkv * D, h * D, sc.offs);
  const int64_t* offs = sc.offs.data();

  // Queries' pairs, [pair][query]; padding queries are zero (finite scores, output dropped).
  sc.qp.assign(static_cast<size_t>(P * QW), 0);
  for (int64_t x = 0; x < nq; ++x) {
    const int32_t* qx = reinterpret_cast<const int32_t*>(q + (row0 + x / g) * q_stride + (h * g + x % g) * D);
    for (int p = 0; p < P; ++p) sc.qp[p * QW + x] = qx[p];
  }
  alignas(64) int32_t ctx[QW];
  for (int64_t x = 0; x < QW; ++x) ctx[x] = static_cast<int32_t>(x < nq ? ctx_len[row0 + x / g] : maxlen);

  // Scores with the causal mask (keys a query must not see, and the padding rows, are -inf) and
  // each query's maximum, in one pass.
  __m512 mx[QZ], sum[QZ], inv[QZ];
  __m512i cv[QZ];
  for (int z = 0; z < QZ; ++z) {
    cv[z] = _mm512_load_si512(ctx + z * 16);
    mx[z] = _mm512_set1_ps(-INFINITY);
    sum[z] = _mm512_setzero_ps();
  }
  sc.s.resize(static_cast<size_t>(rows * QW));
  float* s = sc.s.data();
  for (int64_t l0 = 0; l0 < rows; l0 += LB)
    score_block<QZ, LB, P>(sc.qp.data(), kc, offs, l0, cv, minlen, mx, s);
  // exp(s - max) (-inf -> 0) summed, and rounded to bf16 pairs (keys 2m, 2m+1 of a query in one
  // 32-bit lane) over the scores in place: pair m lands at row m, below rows 2m and 2m + 1 it was
  // read from.  The 1 / sum is applied to the output (one multiply per output, not per key): the
  // probabilities are rounded before normalising, where HF rounds after; both are bf16 roundings
  // of the same fp32 values, within the kernels' tolerance (tests/engine/test_kernels.py) and equal
  // to HF token for token on the parity prompts.  One pass here instead of four: at head_dim 64 a
  // pass over the scores costs about as much as the dot products that made them.
  const __m512i interleave = _mm512_load_si512(kInterleave16);
  const __m512 c = _mm512_set1_ps(scale * kLog2e);
  __m512 mxc[QZ];
  for (int z = 0; z < QZ; ++z) mxc[z] = _mm512_mul_ps(mx[z], c);
  int32_t* pp = reinterpret_cast<int32_t*>(s);
  for (int64_t m = 0; m < pairs; ++m)
    for (int z = 0; z < QZ; ++z) {
      const __m512 a = exp2_scaled(_mm512_loadu_ps(s + 2 * m * QW + z * 16), c, mxc[z]);
      const __m512 b = exp2_scaled(_mm512_loadu_ps(s + (2 * m + 1) * QW + z * 16), c, mxc[z]);
      sum[z] = _mm512_add_ps(sum[z], _mm512_add_ps(a, b));
      _mm512_storeu_si512(pp + m * QW + z * 16, _mm512_permutexvar_epi16(interleave, as_i(_mm512_cvtne2ps_pbh(b, a))));
    }
  for (int z = 0; z < QZ; ++z) inv[z] = _mm512_div_ps(_mm512_set1_ps(1.f), sum[z]);

  // Value rows 2m and 2m + 1 interleaved: 32-bit lane d holds (v[2m][d], v[2m+1][d]).
  sc.vp.resize(static_cast<size_t>(pairs * D));
  int32_t* vp = sc.vp.data();
  for (int64_t m = 0; m < pairs; ++m) {
    __m512i vz[NV];
    pair_rows<D>(vc + offs[2 * m], vc + offs[2 * m + 1], vz);
    for (int i = 0; i < NV; ++i) _mm512_storeu_si512(vp + m * D + i * 16, vz[i]);
  }

  sc.o.resize(static_cast<size_t>(D * QW));
  for (int d0 = 0; d0 < D; d0 += DB) value_block<QZ, DB, D>(pp, vp, pairs, d0, inv, sc.o.data());
  const float* o = sc.o.data();
  for (int64_t x = 0; x < nq; ++x) {
    c10::BFloat16* dst = out + (row0 + x / g) * out_stride + (h * g + x % g) * D;
    for (int d = 0; d < D; ++d) dst[d] = c10::BFloat16(o[d * QW + x]);
  }
}

// r[b] = the sum of v[b]'s 16 lanes, for 16 vectors at once: a transpose-and-add tree (45
// shuffles and adds, where 16 separate horizontal sums take ~130).  `add` adds two vectors: fp32
// lanes for scores (reduce16), int32 lanes held in __m512 bits for decode_row_i8 (reduce16_i32).
template <typename Add>
inline __m512 reduce16_with(__m512* v, Add add) {
  __m512 w[8], x[4], y[2];
  for (int k = 0; k < 8; ++k)  // [a0+a2, b0+b2, a1+a3, b1+b3] in each 128-bit lane
    w[k] = add(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k)  // each 128-bit lane: its 4-lane sums of v[4k .. 4k+3]
    x[k] = add(_mm512_shuffle_ps(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
               _mm512_shuffle_ps(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int k = 0; k < 2; ++k)  // 128-bit lanes 0+1 and 2+3 of x[2k], then of x[2k+1]
    y[k] = add(_mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
               _mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return add(_mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
             _mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

inline __m512 reduce16(__m512* v) {
  return reduce16_with(v, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
}

inline __m512i reduce16_i32(__m512* v) {
  return _mm512_castps_si512(reduce16_with(v, [](__m512 a, __m512 b) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  }));
}

// A decode row's softmax, first half: the scaled scores sr[0 .. rows) (-inf where masked) become
// exp(x - max) in place; returns 1 / their sum, broadcast (the caller normalises as it stores).
inline __m512 exp_row(float* sr, int64_t rows) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t l = 0; l < rows; l += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + l));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t l = 0; l < rows; l += 16) {
    const __m512 e = avx512::exp({_mm512_sub_ps(_mm512_loadu_ps(sr + l), m)}).v;
    _mm512_storeu_ps(sr + l, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
}

// A decode row (one query row) against every KV head at once, G query heads each.  A real decode
// batch reads its whole cache from memory every step, so this item is built around the stream:
// each key's whole cache row (hkv * D values) is read once, in key order, prefetched kAheadBytes
// ahead, and the prefetches run on into the next item's first keys.  (An item per KV head read a
// third of each row and left the memory idle while later heads' items ran from L2: 14 GB/s of the
// ~26 this VM reads.)
// Scores: 16 keys at a time as bf16 dot products (q and k as they are in memory, 32 pairs an
// instruction) summed by reduce16; softmax along the keys; values in chunks of kChunk keys, two
// keys at a time interleaved in pairs, into register accumulators saved between chunks.
// The same products summed in the same order as the per-head item it replaced.
//
// How far ahead, in bytes of cache rows, into L2 (T1: 1 MB a core here; T0, into L1, evicted the
// rows being read).  64 decode rows x 300 keys over 30 layers' caches (444 MB, SmolLM2's shape),
// ms a step: an item per KV head, T0 16 keys ahead 30.7; this item, T0 24 KB ahead 34-36, T1
// 48 KB 26.1; with the run-on into the next item, T1 48 KB 23.0, 72 KB 23.6, 96 KB 19.1-21.9,
// 192 KB 26.7.
constexpr int64_t kAheadBytes = 96 * 1024;
constexpr int kChunk = 32;  // keys of the value pass a head takes before the next head

inline void prefetch_l2(const c10::BFloat16* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + line, _MM_HINT_T1);
}

template <int D, int G>
void decode_row(const c10::BFloat16* q, int64_t q_stride, const c10::BFloat16* kc, const c10::BFloat16* vc,
                const int64_t* table, const int64_t* ctx_len, c10::BFloat16* out, int64_t out_stride, int64_t row,
                int64_t hkv, int64_t bs, float scale, const int64_t* next_table, int64_t next_len, Scratch& sc) {
  constexpr int NZ = D / 32, NV = D / 16;
  const int64_t len = ctx_len[row], nq = hkv * G;
  const int64_t rows = (len + 31) / 32 * 32, pairs = rows / 2;
  const int64_t row_bytes = hkv * D * 2;  // a key's cache row, all heads
  const int64_t ahead = std::max<int64_t>(16, kAheadBytes / row_bytes / 16 * 16);  // keys
  key_offsets(table, len, rows + ahead, bs, hkv * D, 0, sc.offs);
  if (next_len > 0)  // the next row's first keys after this row's: prefetched only, never read
    key_offsets(next_table, std::min(next_len, ahead), ahead, bs, hkv * D, 0, sc.offs.data() + rows);
  const int64_t* offs = sc.offs.data();
  sc.s.resize(static_cast<size_t>(nq * rows));
  float* s = sc.s.data();
  const c10::BFloat16* qrow = q + row * q_stride;
  for (int64_t k = 0; k < std::min(len, ahead); ++k) prefetch_l2(kc + offs[k], row_bytes);
  const __m512 sc_v = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t l0 = 0; l0 < rows; l0 += 16) {
    const __mmask16 valid = _mm512_cmplt_epi32_mask(_mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(l0)), lane),
                                                    _mm512_set1_epi32(static_cast<int32_t>(len)));
    for (int64_t h = 0; h < hkv; ++h)
      for (int j = 0; j < G; ++j) {
        // This query's share of the 16 keys `ahead` on: prefetches spread over the block's work.
        const int64_t r = h * G + j;
        for (int64_t b = r * 16 / nq; b < (r + 1) * 16 / nq; ++b)
          prefetch_l2(kc + offs[l0 + ahead + b], row_bytes);
        __m512bh qv[NZ];
        for (int z = 0; z < NZ; ++z) qv[z] = as_bh(_mm512_loadu_si512(qrow + (h * G + j) * D + z * 32));
        __m512 part[16];
        for (int b = 0; b < 16; ++b) {
          const c10::BFloat16* kp = kc + offs[l0 + b] + h * D;
          __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], as_bh(_mm512_loadu_si512(kp)));
          for (int z = 1; z < NZ; ++z) a = _mm512_dpbf16_ps(a, qv[z], as_bh(_mm512_loadu_si512(kp + z * 32)));
          part[b] = a;
        }
        _mm512_storeu_ps(s + (h * G + j) * rows + l0,
                         _mm512_mask_mov_ps(ninf, valid, _mm512_mul_ps(reduce16(part), sc_v)));
      }
  }
  for (int64_t k = 0; k < std::min(len, ahead); ++k) prefetch_l2(vc + offs[k], row_bytes);  // values' first keys
  // Softmax along each query's keys; probabilities normalised, then rounded to bf16 in key order,
  // which is already the (key 2m, key 2m+1) pairing the value pass wants.
  int32_t* pp = reinterpret_cast<int32_t*>(s);  // [nq][pairs], over the scores (query r at r * pairs)
  for (int64_t r = 0; r < nq; ++r) {
    float* sr = s + r * rows;
    const __m512 inv = exp_row(sr, rows);
    // Query r's pairs land at r * pairs <= r * rows: each read before it is overwritten, and
    // earlier queries' scores are no longer needed.
    for (int64_t l = 0; l < rows; l += 32)
      _mm512_storeu_si512(pp + r * pairs + l / 2, as_i(_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(sr + l + 16), inv),
                                                                          _mm512_mul_ps(_mm512_loadu_ps(sr + l), inv))));
  }
  sc.o.assign(static_cast<size_t>(nq * D), 0.f);  // [nq][D] value sums between chunks
  float* acc_mem = sc.o.data();
  for (int64_t c0 = 0; c0 < pairs; c0 += kChunk / 2) {
    const int64_t c1 = std::min<int64_t>(pairs, c0 + kChunk / 2);
    for (int64_t h = 0; h < hkv; ++h) {
      for (int64_t k = 2 * c0 + h * kChunk / hkv; k < 2 * c0 + (h + 1) * kChunk / hkv; ++k)  // head h's share
        prefetch_l2(vc + offs[k + ahead], row_bytes);
      __m512 acc[G][NV];
      for (int j = 0; j < G; ++j)
        for (int i = 0; i < NV; ++i) acc[j][i] = _mm512_loadu_ps(acc_mem + (h * G + j) * D + i * 16);
      for (int64_t m = c0; m < c1; ++m) {
        __m512i vz[NV];
        pair_rows<D>(vc + offs[2 * m] + h * D, vc + offs[2 * m + 1] + h * D, vz);
        for (int j = 0; j < G; ++j) {
          const __m512bh pb = as_bh(_mm512_set1_epi32(pp[(h * G + j) * pairs + m]));
          for (int i = 0; i < NV; ++i) acc[j][i] = _mm512_dpbf16_ps(acc[j][i], as_bh(vz[i]), pb);
        }
      }
      for (int j = 0; j < G; ++j)
        for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc_mem + (h * G + j) * D + i * 16, acc[j][i]);
    }
  }
  for (int64_t r = 0; r < nq; ++r)
    for (int i = 0; i < NV; ++i)
      avx512::store(out + row * out_stride + r * D + i * 16, avx512::Vf{_mm512_loadu_ps(acc_mem + r * D + i * 16)});
}

// decode_row on an int8 cache (kv_cache_dtype "int8"; layout in attention_bf16.h): the same
// stream (each key's whole cache row once, in key order, prefetched ahead), half the bytes.
// Scores: the row's queries quantized to int8 (one scale a query head, as the keys have one a
// token and head), 64 products a vpdpbusd with the keys read as k + 128 (xor 0x80, the unsigned
// operand) and 128 * sum(q) taken off after; times the query's and the key's scales.  Values:
// per chunk of 32 keys, each probability times its value's scale, quantized to int16 with one
// scale per query and chunk (the largest product of the chunk -> 32767: an error of at most
// 1/65534 of that product on each), 2 keys a vpdpwssd against the values widened to int16 in
// (key 2m, key 2m+1) pairs; int32 sums flushed to fp32 after each chunk (32 x 32767 x 127 fits).
// Compared to staging the dequantized rows for decode_row: no key is written and read twice.
constexpr int64_t kMaxKvHeadsI8 = 32;  // decode_row_i8's stack arrays; more KV heads: staged
// How far ahead decode_row_i8 prefetches, in bytes of cache rows.  Not decode_row's 96 KB: these
// rows are half as long and cheaper to compute, and a longer distance left the prefetches queueing
// (64 rows x 330 keys x 30 layers, SmolLM2's shape, ms: 8 KB 16.4-18.8, 16 KB 15.9-16.1, 48 KB
// 16.3-16.5, 96 KB 19.4-19.8; bf16 cache with decode_row 19.2-22.5 in the same runs).
constexpr int64_t kAheadBytesI8 = 16 * 1024;

template <int D, int G>
void decode_row_i8(const c10::BFloat16* q, int64_t q_stride, const int8_t* kq, const int8_t* vq,
                   const int64_t* table, const int64_t* ctx_len, c10::BFloat16* out, int64_t out_stride,
                   int64_t row, int64_t hkv, int64_t bs, float scale, const int64_t* next_table, int64_t next_len,
                   Scratch& sc) {
  static_assert(D % 64 == 0, "a key's head vector is read 64 int8 values at a time");
  constexpr int NK = D / 64, NV = D / 16;
  constexpr int64_t HR = D + kScaleBytes;  // bytes of one head vector and its scale
  const int64_t len = ctx_len[row], nq = hkv * G;
  const int64_t rows = (len + 31) / 32 * 32;
  const int64_t row_bytes = hkv * HR;  // a key's cache row, all heads
  const int64_t ahead = std::max<int64_t>(16, kAheadBytesI8 / row_bytes / 16 * 16);  // keys
  key_offsets(table, len, rows + ahead, bs, row_bytes, 0, sc.offs);
  if (next_len > 0) key_offsets(next_table, std::min(next_len, ahead), ahead, bs, row_bytes, 0, sc.offs.data() + rows);
  const int64_t* offs = sc.offs.data();
  // Keys [k0, k1) of base into L2, each cache line once: a block's rows are contiguous but not
  // line-aligned (hkv * (D + 4) bytes), so a run of consecutive rows is prefetched as one range.
  // (Inlined: a call would spill every live vector register, all caller-saved.)
  const auto prefetch = [&](const int8_t* base, int64_t k0, int64_t k1) __attribute__((always_inline)) {
    for (int64_t k = k0; k < k1;) {
      int64_t e = k + 1;
      while (e < k1 && offs[e] == offs[e - 1] + row_bytes) ++e;
      const uintptr_t a = reinterpret_cast<uintptr_t>(base + offs[k]), end = a + (e - k) * row_bytes;
      for (uintptr_t line = a & ~uintptr_t{63}; line < end; line += 64) _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T1);
      k = e;
    }
  };
  prefetch(kq, 0, std::min(len, ahead));

  // The queries in int8: qi [nq][D], their scales and 128 * sum(qi) (the k + 128 correction).
  sc.qp.resize(static_cast<size_t>(nq * D / 4 + 2 * nq));
  int8_t* qi = reinterpret_cast<int8_t*>(sc.qp.data());
  float* qscale = reinterpret_cast<float*>(sc.qp.data() + nq * D / 4);
  int32_t* qcorr = sc.qp.data() + nq * D / 4 + nq;
  const c10::BFloat16* qrow = q + row * q_stride;
  for (int64_t r = 0; r < nq; ++r) {
    __m512 x[NV];
    __m512 m = _mm512_setzero_ps();
    for (int i = 0; i < NV; ++i) {
      x[i] = avx512::load(qrow + r * D + i * 16).v;
      m = _mm512_max_ps(m, _mm512_abs_ps(x[i]));
    }
    const float amax = std::max(_mm512_reduce_max_ps(m), 1e-30f);
    const __m512 inv = _mm512_set1_ps(127.f / amax);
    __m512i sum = _mm512_setzero_si512();
    for (int i = 0; i < NV; ++i) {
      const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(x[i], inv));  // rounds to nearest even
      sum = _mm512_add_epi32(sum, v);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qi + r * D + i * 16), _mm512_cvtsepi32_epi8(v));
    }
    qscale[r] = amax / 127.f * scale;
    qcorr[r] = 128 * _mm512_reduce_add_epi32(sum);
  }

  sc.s.resize(static_cast<size_t>(nq * rows));
  float* s = sc.s.data();
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  alignas(64) float ks[16];
  int64_t share[kMaxKvHeadsI8 * G + 1], vshare[kMaxKvHeadsI8 + 1];  // prefetches spread over the work
  for (int64_t r = 0; r <= nq; ++r) share[r] = r * 16 / nq;
  for (int64_t h = 0; h <= hkv; ++h) vshare[h] = h * 32 / hkv;
  for (int64_t l0 = 0; l0 < rows; l0 += 16) {
    const __mmask16 valid = _mm512_cmplt_epi32_mask(_mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(l0)), lane),
                                                    _mm512_set1_epi32(static_cast<int32_t>(len)));
    for (int64_t h = 0; h < hkv; ++h) {
      for (int b = 0; b < 16; ++b) std::memcpy(ks + b, kq + offs[l0 + b] + h * HR + D, sizeof(float));
      const __m512 kscale = _mm512_load_ps(ks);
      for (int j = 0; j < G; ++j) {
        const int64_t r = h * G + j;
        prefetch(kq, l0 + ahead + share[r], l0 + ahead + share[r + 1]);  // this query's share of the next keys
        __m512i qv[NK];
        for (int z = 0; z < NK; ++z) qv[z] = _mm512_loadu_si512(qi + r * D + z * 64);
        __m512 part[16];
        for (int b = 0; b < 16; ++b) {
          const int8_t* kp = kq + offs[l0 + b] + h * HR;
          __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_xor_si512(_mm512_loadu_si512(kp), flip), qv[0]);
          for (int z = 1; z < NK; ++z)
            a = _mm512_dpbusd_epi32(a, _mm512_xor_si512(_mm512_loadu_si512(kp + z * 64), flip), qv[z]);
          part[b] = _mm512_castsi512_ps(a);
        }
        // The 16 keys' integer dot products (reduce16's tree on the integer lanes), corrected.
        const __m512i dots = _mm512_sub_epi32(reduce16_i32(part), _mm512_set1_epi32(qcorr[r]));
        const __m512 sv = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dots), _mm512_set1_ps(qscale[r])), kscale);
        _mm512_storeu_ps(s + r * rows + l0, _mm512_mask_mov_ps(ninf, valid, sv));
      }
    }
  }
  prefetch(vq, 0, std::min(len, ahead));  // values' first keys
  // Softmax along each query's keys, normalised, in place (fp32).
  for (int64_t r = 0; r < nq; ++r) {
    float* sr = s + r * rows;
    const __m512 inv = exp_row(sr, rows);
    for (int64_t l = 0; l < rows; l += 16) _mm512_storeu_ps(sr + l, _mm512_mul_ps(_mm512_loadu_ps(sr + l), inv));
  }
  sc.o.assign(static_cast<size_t>(nq * D), 0.f);  // [nq][D] fp32 sums
  float* acc_mem = sc.o.data();
  const __m512i lo = _mm512_load_si512(kInterleave32);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  alignas(64) float vs[32];
  alignas(64) int32_t pp[G][16];  // a query's 16 int16 probability pairs of the chunk
  float ps[G];
  for (int64_t c0 = 0; c0 < rows; c0 += 32) {
    for (int64_t h = 0; h < hkv; ++h) {
      prefetch(vq, c0 + ahead + vshare[h], c0 + ahead + vshare[h + 1]);  // head h's share
      for (int b = 0; b < 32; ++b) std::memcpy(vs + b, vq + offs[c0 + b] + h * HR + D, sizeof(float));
      const __m512 vs0 = _mm512_load_ps(vs), vs1 = _mm512_load_ps(vs + 16);
      for (int j = 0; j < G; ++j) {
        const float* pr = s + (h * G + j) * rows + c0;
        const __m512 p0 = _mm512_mul_ps(_mm512_loadu_ps(pr), vs0), p1 = _mm512_mul_ps(_mm512_loadu_ps(pr + 16), vs1);
        const float mx = _mm512_reduce_max_ps(_mm512_max_ps(p0, p1));
        ps[j] = mx * (1.f / 32767.f);
        const __m512 inv = _mm512_set1_ps(mx > 0.f ? 32767.f / mx : 0.f);
        const __m256i a = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(p0, inv)));
        const __m256i b = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(p1, inv)));
        _mm512_store_si512(pp[j], _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));  // keys in order = pairs
      }
      __m512i acc[G][NV];
      for (int j = 0; j < G; ++j)
        for (int i = 0; i < NV; ++i) acc[j][i] = _mm512_setzero_si512();
      for (int m = 0; m < 16; ++m) {
        const int8_t *va = vq + offs[c0 + 2 * m] + h * HR, *vb = vq + offs[c0 + 2 * m + 1] + h * HR;
        __m512i vz[NV];
        for (int i = 0; i < NV; i += 2) {  // 32 head dims of both rows, widened, in (a, b) pairs
          const __m512i wa = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(va + i * 16)));
          const __m512i wb = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vb + i * 16)));
          vz[i] = _mm512_permutex2var_epi16(wa, lo, wb);
          vz[i + 1] = _mm512_permutex2var_epi16(wa, hi, wb);
        }
        for (int j = 0; j < G; ++j) {
          const __m512i pb = _mm512_set1_epi32(pp[j][m]);
          for (int i = 0; i < NV; ++i) acc[j][i] = _mm512_dpwssd_epi32(acc[j][i], vz[i], pb);
        }
      }
      for (int j = 0; j < G; ++j) {
        const __m512 c = _mm512_set1_ps(ps[j]);
        float* am = acc_mem + (h * G + j) * D;
        for (int i = 0; i < NV; ++i)
          _mm512_storeu_ps(am + i * 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[j][i]), c, _mm512_loadu_ps(am + i * 16)));
      }
    }
  }
  for (int64_t r = 0; r < nq; ++r)
    for (int i = 0; i < NV; ++i)
      avx512::store(out + row * out_stride + r * D + i * 16, avx512::Vf{_mm512_loadu_ps(acc_mem + r * D + i * 16)});
}

template <int D>
bool row_i8_d(const c10::BFloat16* q, int64_t q_stride, const int8_t* kq, const int8_t* vq, const int64_t* table,
              const int64_t* ctx_len, c10::BFloat16* out, int64_t out_stride, int64_t row, int64_t g, int64_t hkv,
              int64_t bs, float scale, const int64_t* next_table, int64_t next_len) {
  if (hkv > kMaxKvHeadsI8) return false;
  Scratch& sc = scratch();
  switch (g) {
    case 1: decode_row_i8<D, 1>(q, q_stride, kq, vq, table, ctx_len, out, out_stride, row, hkv, bs, scale, next_table, next_len, sc); return true;
    case 2: decode_row_i8<D, 2>(q, q_stride, kq, vq, table, ctx_len, out, out_stride, row, hkv, bs, scale, next_table, next_len, sc); return true;
    case 3: decode_row_i8<D, 3>(q, q_stride, kq, vq, table, ctx_len, out, out_stride, row, hkv, bs, scale, next_table, next_len, sc); return true;
    case 4: decode_row_i8<D, 4>(q, q_stride, kq, vq, table, ctx_len, out, out_stride, row, hkv, bs, scale, next_table, next_len, sc); return true;
    default: return false;
  }
}

template <int D>
bool row_d(const c10::BFloat16* q, int64_t q_stride, const c10::BFloat16* kc, const c10::BFloat16* vc,
           const int64_t* table, const int64_t* ctx_len, c10::BFloat16* out, int64_t out_stride, int64_t row,
           int64_t g, int64_t hkv, int64_t bs, float scale, const int64_t* next_table, int64_t next_len) {
  Scratch& sc = scratch();
  switch (g) {  // more query heads would not keep their sums in registers
    case 1: decode_row<D, 1>(q, q_stride, kc, vc, table, ctx_len, out, out_stride, row, hkv, bs, scale, next_table, next_len, sc); return true;
    case 2: decode_row<D, 2>(q, q_stride, kc, vc, table, ctx_len, out, out_stride, row, hkv, bs, scale, next_table, next_len, sc); return true;
    case 3: decode_row<D, 3>(q, q_stride, kc, vc, table, ctx_len, out, out_stride, row, hkv, bs, scale, next_table, next_len, sc); return true;
    case 4: decode_row<D, 4>(q, q_stride, kc, vc, table, ctx_len, out, out_stride, row, hkv, bs, scale, next_table, next_len, sc); return true;
    default: return false;
  }
}

template <int D>
bool item_d(const c10::BFloat16* q, int64_t q_stride, const c10::BFloat16* kc, const c10::BFloat16* vc,
            const int64_t* table, const int64_t* ctx_len, c10::BFloat16* out, int64_t out_stride, int64_t row0,
            int64_t nr, int64_t h, int64_t g, int64_t hkv, int64_t bs, float scale) {
  Scratch& sc = scratch();
  const int64_t qz = (nr * g + 15) / 16;
#define CARPOOL_ITEM(QZ) \
  case QZ: item<D, QZ>(q, q_stride, kc, vc, table, ctx_len, out, out_stride, row0, nr, h, g, hkv, bs, scale, sc); return true
  switch (qz) {
    CARPOOL_ITEM(1);
    CARPOOL_ITEM(2);
    CARPOOL_ITEM(3);
    CARPOOL_ITEM(4);
    CARPOOL_ITEM(5);
    CARPOOL_ITEM(6);
    CARPOOL_ITEM(7);
    CARPOOL_ITEM(8);
    default: return false;
  }
#undef CARPOOL_ITEM
}

}  // namespace

bool stage_kv_bf16(const int8_t* kq, const int8_t* vq, const int64_t* table, int64_t keys, int64_t bs, int64_t hkv,
                   int64_t d, int64_t h0, int64_t h1, c10::BFloat16* ks, c10::BFloat16* vs) {
  if (d % 32 != 0) return false;
  const int64_t row = d + kScaleBytes;
  const auto dequant = [](const int8_t* src, __m512 c) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)))), c);
  };
  for (int64_t l = 0; l < keys; ++l) {
    const int64_t slot = table[l / bs] * bs + l % bs;
    if (l % bs == 0 && l + 2 * bs < keys) {  // two pages ahead: pages are scattered, no hardware stream
      const int64_t ahead = table[l / bs + 2] * bs * hkv * row;
      for (int64_t x = 0; x < bs * hkv * row; x += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(kq + ahead + x), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(vq + ahead + x), _MM_HINT_T0);
      }
    }
    for (int64_t h = h0; h < h1; ++h) {
      const int8_t *k = kq + (slot * hkv + h) * row, *v = vq + (slot * hkv + h) * row;
      float sk, sv;
      std::memcpy(&sk, k + d, sizeof sk);
      std::memcpy(&sv, v + d, sizeof sv);
      const __m512 ck = _mm512_set1_ps(sk), cv = _mm512_set1_ps(sv);
      const int64_t dst = (l * hkv + h) * d;
      for (int64_t i = 0; i < d; i += 32) {
        _mm512_storeu_si512(ks + dst + i, as_i(_mm512_cvtne2ps_pbh(dequant(k + i + 16, ck), dequant(k + i, ck))));
        _mm512_storeu_si512(vs + dst + i, as_i(_mm512_cvtne2ps_pbh(dequant(v + i + 16, cv), dequant(v + i, cv))));
      }
    }
  }
  return true;
}

bool attend_item_bf16(const c10::BFloat16* q, int64_t q_stride, const c10::BFloat16* kc, const c10::BFloat16* vc,
                      const int64_t* table, const int64_t* ctx_len, c10::BFloat16* out, int64_t out_stride,
                      int64_t row0, int64_t nr, int64_t h, int64_t g, int64_t hkv, int64_t bs, int64_t d, float scale) {
  switch (d) {
    case 64: return item_d<64>(q, q_stride, kc, vc, table, ctx_len, out, out_stride, row0, nr, h, g, hkv, bs, scale);
    case 128: return item_d<128>(q, q_stride, kc, vc, table, ctx_len, out, out_stride, row0, nr, h, g, hkv, bs, scale);
    case 32: return item_d<32>(q, q_stride, kc, vc, table, ctx_len, out, out_stride, row0, nr, h, g, hkv, bs, scale);
    default: return false;
  }
}

bool attend_row_int8(const c10::BFloat16* q, int64_t q_stride, const int8_t* kq, const int8_t* vq,
                     const int64_t* table, const int64_t* ctx_len, c10::BFloat16* out, int64_t out_stride,
                     int64_t row, int64_t g, int64_t hkv, int64_t bs, int64_t d, float scale,
                     const int64_t* next_table, int64_t next_len) {
  switch (d) {
    case 64: return row_i8_d<64>(q, q_stride, kq, vq, table, ctx_len, out, out_stride, row, g, hkv, bs, scale, next_table, next_len);
    case 128: return row_i8_d<128>(q, q_stride, kq, vq, table, ctx_len, out, out_stride, row, g, hkv, bs, scale, next_table, next_len);
    default: return false;
  }
}

bool attend_row_bf16(const c10::BFloat16* q, int64_t q_stride, const c10::BFloat16* kc, const c10::BFloat16* vc,
                     const int64_t* table, const int64_t* ctx_len, c10::BFloat16* out, int64_t out_stride,
                     int64_t row, int64_t g, int64_t hkv, int64_t bs, int64_t d, float scale,
                     const int64_t* next_table, int64_t next_len) {
  switch (d) {
    case 64: return row_d<64>(q, q_stride, kc, vc, table, ctx_len, out, out_stride, row, g, hkv, bs, scale, next_table, next_len);
    case 128: return row_d<128>(q, q_stride, kc, vc, table, ctx_len, out, out_stride, row, g, hkv, bs, scale, next_table, next_len);
    case 32: return row_d<32>(q, q_stride, kc, vc, table, ctx_len, out, out_stride, row, g, hkv, bs, scale, next_table, next_len);
    default: return false;
  }
}

#pragma GCC pop_options

}  // namespace carpool
