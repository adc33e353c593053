// The linears' own GEMM (for the row counts the engine plan sends it, engine/plan.py; the others
// run oneDNN's): int8 x int8 -> int32 on AVX-512 VNNI (the int8 model) and bf16 x bf16 ->
// bf16 with fp32 sums on AVX-512 BF16 (the bf16 model).
//
// Why our own (measured on the 2-core Zen 4, SmolLM2's four linears of 30 layers at 64 rows, each
// layer's weights read once, as a decode step reads them): int8 torch._int_mm 25.5-27.7 ms, this
// kernel 18.8; bf16 F.linear 59-64 ms, this kernel 34.5-35.5 (the tied 49152-row head: 13.6 vs
// 9.1).  With one layer's weights hot in cache oneDNN is at the VNNI / BF16 peak; what it lacks is
// a weight that is packed once and read ahead: a decode step meets each weight once, from memory,
// and oneDNN's loads of it stall.  Here each weight is packed once at load (decode_gemm.py) and
// the next column block's bytes are prefetched while the current one computes.  From ~512 rows
// on oneDNN is faster again (it blocks over rows; this kernel re-reads the rows per column block).
//
// Packed layout [N / 32][K / S][32][S] (S = 4 int8 or 2 bf16, the values one lane's dot product
// takes): a k-step of a 32-column block is 128 contiguous bytes, two registers of 16 columns.
// The row's S values are broadcast straight from memory (a 32-bit broadcast) into the other
// operand.  Tile: 8 rows x 32 columns = 16 accumulators, the two weight registers and a
// broadcast; wider tiles (6 x 48, 6 x 64) spilled and ran at half the speed.
// - int8: the weight is stored as w + 128 (uint8, vpdpbusd's unsigned side) and the activations
//   are the signed side; sum((w + 128) * a) = w.a + 128 * sum(a), the second term taken off per
//   row.  Exact: the int32 sums equal torch._int_mm's.
// - bf16: vdpbf16ps adds each pair's two products into the fp32 sum, k in order, as oneDNN's
//   kernel does; the sum is rounded to bf16 (nearest even).  Against F.linear ~0.005% of outputs
//   differ by one bf16 step (tests/engine/test_decode_gemm.py).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <type_traits>

#include "attention_bf16.h"  // cpu_has_avx512_bf16: the bf16 GEMM runs where the bf16 attention does
#include "simd.h"

namespace carpool {

bool cpu_has_vnni_gemm() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return best_isa() == kAvx512 && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16")
namespace {

constexpr int kCols = 32;  // columns of a packed block
constexpr int kRows = 8;   // rows of a tile

// int8 rows (a) x a packed w + 128 block -> int32; comp[r] = 128 * sum(a_r).
struct Int8Tile {
  using In = int8_t;
  using W = uint8_t;
  using Out = int32_t;
  static constexpr int kStep = 4;
  const int32_t* comp;
  static __m512i zero() { return _mm512_setzero_si512(); }
  // In asm, not _mm512_dpbusd_epi32: GCC 12 moves each accumulator of the intrinsic through a
  // second register (two extra moves a dot product, and the 17th register spills to the stack);
  // measured on a Zen 5, 8 x 32 tile at 64 rows, one thread: 340 GMAC/s with the intrinsic, 513
  // in asm, the VNNI peak being ~525 (2 vpdpbusd a cycle).
  static __m512i dot(__m512i acc, __m512i w, __m512i a) {
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(a));
    return acc;
  }
  __m512i sums(__m512i acc, int64_t row) const { return _mm512_sub_epi32(acc, _mm512_set1_epi32(comp[row])); }
  void store(Out* c, __m512i acc, int64_t row, int64_t) const { _mm512_storeu_si512(c, sums(acc, row)); }
};

// The same sums scaled back to the model dtype T as the tile's store: T((sum * rs[row]) * cs[col])
// (+ bias, rounded to T again), quant_kernels.h's `dequant` formula, so the values equal
// int8_gemm followed by int8_dequantize (in bf16 up to results below bf16's normal range, which
// vcvtneps2bf16 flushes to zero, as in Bf16Tile).  Why in the GEMM: the int32 product is twice
// the bytes of the bf16 one and the ops after it re-read it from the cache of the core that wrote
// it; stored in the model dtype, the int8 layer's row-wise ops are the bf16 model's.
template <typename T>
struct Int8DequantTile : Int8Tile {
  using Out = T;
  const float* rs;  // [M] the rows' scales
  const float* cs;  // [N] the weight's column scales
  const T* bias;    // [N] or null
  void store(Out* c, __m512i acc, int64_t row, int64_t col) const {
    __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums(acc, row)), _mm512_set1_ps(rs[row])),
                             _mm512_loadu_ps(cs + col));
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      // One instruction a rounding (round to nearest even, as c10::BFloat16), not simd.h's six.
      if (bias) y = _mm512_add_ps(_mm512_cvtpbh_ps(_mm512_cvtneps_pbh(y)), avx512::load(bias + col).v);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(c), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(y)));
    } else {
      if constexpr (std::is_same_v<T, c10::Half>) {
        if (bias) y = _mm512_add_ps(avx512::round_half({y}).v, avx512::load(bias + col).v);
      } else if (bias) {
        y = _mm512_add_ps(y, _mm512_loadu_ps(bias + col));
      }
      avx512::store(c, avx512::Vf{y});
    }
  }
};

// bf16 rows x a packed bf16 block -> fp32 sums rounded to bf16.
struct Bf16Tile {
  using In = uint16_t;
  using W = uint16_t;
  using Out = uint16_t;
  static constexpr int kStep = 2;
  static __m512 zero() { return _mm512_setzero_ps(); }
  static __m512 dot(__m512 acc, __m512i w, __m512i a) {
    return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(w));
  }
  void store(Out* c, __m512 acc, int64_t, int64_t) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(acc)));
  }
};

// R rows of a (row stride k, starting at row `row`) times one packed block (its first column
// `col`) -> c (row stride ldc).
// While it runs, pf_lines cache lines from pf on are prefetched, spread evenly over its k-steps.
template <int R, typename T>
__attribute__((always_inline)) inline void tile(const T& op, const typename T::In* a, int64_t row, int64_t col,
                                                int64_t k, const typename T::W* w, typename T::Out* c, int64_t ldc,
                                                const char* pf, int64_t pf_lines) {
  using Acc = decltype(T::zero());
  Acc acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = T::zero();
  const int64_t steps = k / T::kStep;
  int64_t due = 0;  // pf_lines spread evenly over the k-steps
  for (int64_t s = 0; s < steps; ++s) {
    const auto* ws = w + s * kCols * T::kStep;
    for (due += pf_lines; due >= steps; due -= steps, pf += 64) _mm_prefetch(pf, _MM_HINT_T0);
    const __m512i w0 = _mm512_loadu_si512(ws), w1 = _mm512_loadu_si512(ws + 16 * T::kStep);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t quad;  // the row's kStep values at this k-step
      std::memcpy(&quad, a + r * k + s * T::kStep, 4);
      const __m512i av = _mm512_set1_epi32(quad);
      acc[r][0] = T::dot(acc[r][0], w0, av);
      acc[r][1] = T::dot(acc[r][1], w1, av);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    op.store(c + r * ldc, acc[r][0], row + r, col);
    op.store(c + r * ldc + 16, acc[r][1], row + r, col + 16);
  }
}

// The last rows % kRows rows of a block, with a tile of exactly that many rows.
template <int R, typename T>
void tail(const T& op, const typename T::In* a, int64_t row, int64_t col, int64_t k, const typename T::W* w,
          typename T::Out* c, int64_t ldc, const char* pf, int64_t pf_lines, int64_t rows) {
  if constexpr (R > 0) {
    if (rows == R)
      tile<R>(op, a, row, col, k, w, c, ldc, pf, pf_lines);
    else
      tail<R - 1>(op, a, row, col, k, w, c, ldc, pf, pf_lines, rows);
  }
}

// The fewest pieces per block that make blocks * pieces a multiple of the thread count (1 when the
// blocks already divide evenly), never more pieces than rows.
int64_t row_parts(int64_t blocks, int64_t m) {
  const int64_t threads = std::max<int64_t>(at::get_num_threads(), 1);
  return std::max<int64_t>(std::min(threads / std::gcd(blocks, threads), m), 1);
}

// a [m, k] x packed [n / 32 blocks] -> c [m, n], on the thread pool.  Items are (block, piece): each
// thread takes a share of the blocks, and with split_rows each block's rows are also cut in
// row_parts pieces, so that the items divide evenly between the threads where the blocks do not
// (some threads would take a block more than the others).  Each piece reads the block's weights
// again, so whether cutting pays depends on the rows, the block count and the CPU: the engine plan
// times both where they differ (plan.py).  The tiles of a block prefetch the next one between
// them: when the first tile fetched it all (two lines a k-step) the loads queued behind one
// another; spread over all of them, in the engine (64 reviews-128 prompts x 256 tokens, wall, two
// alternating rounds) int8 9.63 / 9.63 -> 9.48 / 9.50 s, bf16 12.75 / 12.68 -> 12.48 / 12.45 s.
// Two blocks ahead was no better (9.64 / 9.47 vs 9.54 / 9.47 s).
template <typename T>
void gemm(const T& op, const typename T::In* a, const typename T::W* w, typename T::Out* c, int64_t m, int64_t k,
          int64_t n, bool split_rows) {
  const int64_t blocks = n / kCols, block_elems = k * kCols;
  const int64_t parts = split_rows ? row_parts(blocks, m) : 1;
  const int64_t part_rows = (m + parts - 1) / parts;
  at::parallel_for(0, blocks * parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t b = it / parts, h = it % parts, next = (it + 1) / parts;
      const auto* wb = w + b * block_elems;
      auto* pf = (it + 1 < end && next != b) ? reinterpret_cast<const char*>(w + next * block_elems) : nullptr;
      const int64_t m1 = std::min(m, (h + 1) * part_rows);
      int64_t row = h * part_rows;
      // The next block's lines, shared out evenly over this item's tiles (and each tile's k-steps).
      const int64_t lines = pf ? block_elems * static_cast<int64_t>(sizeof(typename T::W)) / 64 : 0;
      const int64_t per_tile = (lines * kRows + (m1 - row) - 1) / std::max<int64_t>(m1 - row, 1);
      for (int64_t done = 0; row < m1; row += kRows) {
        const int64_t nl = std::min(per_tile, lines - done);
        const char* p = nl > 0 ? pf + done * 64 : nullptr;
        if (row + kRows <= m1)
          tile<kRows>(op, a + row * k, row, b * kCols, k, wb, c + row * n + b * kCols, n, p, nl);
        else
          tail<kRows - 1>(op, a + row * k, row, b * kCols, k, wb, c + row * n + b * kCols, n, p, nl, m1 - row);
        done += nl;
      }
    }
  });
}

// 128 * sum of each row of a [rows, k]: vpdpbusd against ones.
void row_sums(const int8_t* a, int64_t rows, int64_t k, int32_t* comp) {
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t i = 0; i < rows; ++i) {
    const int8_t* row = a + i * k;
    __m512i s = _mm512_setzero_si512();
    int64_t j = 0;
    for (; j + 64 <= k; j += 64) s = _mm512_dpbusd_epi32(s, ones, _mm512_loadu_si512(row + j));
    int32_t t = _mm512_reduce_add_epi32(s);
    for (; j < k; ++j) t += row[j];
    comp[i] = 128 * t;
  }
}

void gemm_int8(const int8_t* a, const uint8_t* w, int32_t* c, int32_t* comp, int64_t m, int64_t k, int64_t n,
               bool split_rows) {
  row_sums(a, m, k, comp);
  gemm(Int8Tile{comp}, a, w, c, m, k, n, split_rows);
}

template <typename T>
void gemm_int8_dequant(const int8_t* a, const uint8_t* w, T* c, int32_t* comp, const float* rs, const float* cs,
                       const T* bias, int64_t m, int64_t k, int64_t n, bool split_rows) {
  row_sums(a, m, k, comp);
  Int8DequantTile<T> op;
  op.comp = comp;
  op.rs = rs;
  op.cs = cs;
  op.bias = bias;
  gemm(op, a, w, c, m, k, n, split_rows);
}

void gemm_bf16(const uint16_t* a, const uint16_t* w, uint16_t* c, int64_t m, int64_t k, int64_t n, bool split_rows) {
  gemm(Bf16Tile{}, a, w, c, m, k, n, split_rows);
}

}  // namespace
#pragma GCC pop_options

// Checks and allocations stay outside the AVX-512 region: nothing may run AVX-512 before the CPU check.

namespace {
void check_shapes(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t step, at::ScalarType x_type,
                  at::ScalarType w_type, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == x_type && x.is_contiguous(), op, ": x must be contiguous ",
              x_type, " [M, K]");
  const int64_t k = x.size(1);
  TORCH_CHECK(k % step == 0 && n % kCols == 0, op, ": K must be a multiple of ", step, " and N of 32, got K=", k,
              " N=", n);
  TORCH_CHECK(packed.scalar_type() == w_type && packed.is_contiguous() && packed.numel() == n * k, op,
              ": packed must be decode_gemm.py's contiguous ", w_type, " of N x K values");
}
// The checks of both int8 GEMMs: the CPU, the shapes, and K.
void check_int8(const at::Tensor& x, const at::Tensor& packed, int64_t n, const char* op) {
  TORCH_CHECK(cpu_has_vnni_gemm(), op, ": this CPU has no AVX-512 VNNI (use torch._int_mm)");
  check_shapes(x, packed, n, 4, at::kChar, at::kByte, op);
  // (w + 128) * a summed over K stays inside int32 up to K = 65536.
  TORCH_CHECK(x.size(1) <= 65536, op, ": K=", x.size(1), " is past 65536, where the int32 sums could overflow");
}
}  // namespace

at::Tensor int8_gemm(at::Tensor x, at::Tensor packed, int64_t n, bool split_rows) {
  check_int8(x, packed, n, "int8_gemm");
  const int64_t m = x.size(0), k = x.size(1);
  auto c = at::empty({m, n}, x.options().dtype(at::kInt));
  if (m == 0) return c;
  auto comp = at::empty({m}, x.options().dtype(at::kInt));
  gemm_int8(x.data_ptr<int8_t>(), packed.data_ptr<uint8_t>(), c.data_ptr<int32_t>(), comp.data_ptr<int32_t>(), m, k,
            n, split_rows);
  return c;
}

at::Tensor int8_gemm_dequant(at::Tensor x, at::Tensor packed, int64_t n, at::Tensor row_scale, at::Tensor col_scale,
                             c10::optional<at::Tensor> bias, at::ScalarType dtype, bool split_rows) {
  check_int8(x, packed, n, "int8_gemm_dequant");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(row_scale.scalar_type() == at::kFloat && row_scale.is_contiguous() && row_scale.numel() == m,
              "int8_gemm_dequant: row_scale must be contiguous fp32 [M]");
  TORCH_CHECK(col_scale.scalar_type() == at::kFloat && col_scale.is_contiguous() && col_scale.numel() == n,
              "int8_gemm_dequant: col_scale must be contiguous fp32 [N]");
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == dtype && b.numel() == n, "int8_gemm_dequant: bias must be [N] in dtype");
  }
  auto c = at::empty({m, n}, x.options().dtype(dtype));
  if (m == 0) return c;
  auto comp = at::empty({m}, x.options().dtype(at::kInt));
  auto run = [&](auto tag) {
    using T = decltype(tag);
    gemm_int8_dequant<T>(x.data_ptr<int8_t>(), packed.data_ptr<uint8_t>(), c.data_ptr<T>(), comp.data_ptr<int32_t>(),
                         row_scale.data_ptr<float>(), col_scale.data_ptr<float>(),
                         b.defined() ? b.data_ptr<T>() : nullptr, m, k, n, split_rows);
  };
  switch (dtype) {
    case at::kBFloat16: run(c10::BFloat16()); break;
    case at::kHalf: run(c10::Half()); break;
    case at::kFloat: run(float()); break;
    default: TORCH_CHECK(false, "int8_gemm_dequant: dtype must be bfloat16, float16 or float32, got ", dtype);
  }
  return c;
}

at::Tensor bf16_gemm(at::Tensor x, at::Tensor packed, int64_t n, bool split_rows) {
  TORCH_CHECK(cpu_has_avx512_bf16(), "bf16_gemm: this CPU has no AVX-512 BF16 (use F.linear)");
  check_shapes(x, packed, n, 2, at::kBFloat16, at::kBFloat16, "bf16_gemm");
  const int64_t m = x.size(0), k = x.size(1);
  auto c = at::empty({m, n}, x.options());
  if (m == 0) return c;
  gemm_bf16(reinterpret_cast<const uint16_t*>(x.data_ptr()), reinterpret_cast<const uint16_t*>(packed.data_ptr()),
            reinterpret_cast<uint16_t*>(c.data_ptr()), m, k, n, split_rows);
  return c;
}

}  // namespace carpool
