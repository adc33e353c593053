// int8 x int8 -> int32 GEMM for decode-sized batches on AVX-512 VNNI: the int8 linears' product
// when a step has at most quant.VNNI_GEMM_MAX_ROWS rows (larger ones stay torch._int_mm).
//
// Why its own kernel (measured on the 2-core Zen 4, SmolLM2's four linears of 30 layers at 64 rows,
// each layer's weights read once, as a decode step reads them): torch._int_mm (oneDNN) took
// 25.5-27.7 ms, this kernel 18.8 ms; with one layer's weights hot in cache 19.2-20.9 against 16.3.
// oneDNN packs nothing ahead for a weight it sees once per call and its loads of a weight that is
// not in cache stall; here the weight is packed once at load (quant.pack_vnni) and the next
// column block's bytes are prefetched while the current one computes.  From ~512 rows on oneDNN
// is faster again (it blocks over rows, this kernel re-reads the activations per column block).
//
// The weight is stored as w + 128 (uint8) and the activations are the signed operand, so each
// row's int8 values are broadcast straight from memory (vpdpbusd's m32bcst) with no conversion
// pass; sum((w + 128) * a) = w.a + 128 * sum(a), and the second term is taken off per row.
// Packed layout [N / 32][K / 4][32][4]: a k-step of a 32-column block is 128 contiguous bytes,
// two registers of 16 columns x 4 consecutive k.  Tile: 8 rows x 32 columns = 16 accumulators,
// the two weight registers and a broadcast; wider tiles (6 x 48, 6 x 64) spilled and ran at half
// the speed.  Exact: the int32 sums equal torch._int_mm's (tests/engine/test_int8_gemm.py).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstring>

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
#pragma GCC target("avx512f,avx512bw,avx512vnni")
namespace {

constexpr int kCols = 32;  // columns of a packed block
constexpr int kRows = 8;   // rows of a tile

// R rows of a (row stride k) times one packed block -> c (row stride ldc); comp[r] = 128 * sum(a_r).
// While it runs, the next block's bytes (pf, when given) are prefetched, 128 bytes a k-step.
template <int R>
__attribute__((always_inline)) inline void tile(const int8_t* a, int64_t k, const uint8_t* w, int32_t* c, int64_t ldc,
                                                const int32_t* comp, const uint8_t* pf) {
  __m512i acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
  for (int64_t k4 = 0; k4 < k / 4; ++k4) {
    const uint8_t* wk = w + k4 * kCols * 4;
    if (pf) {
      _mm_prefetch(reinterpret_cast<const char*>(pf + k4 * kCols * 4), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(pf + k4 * kCols * 4 + 64), _MM_HINT_T0);
    }
    const __m512i w0 = _mm512_loadu_si512(wk), w1 = _mm512_loadu_si512(wk + 64);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t quad;  // 4 consecutive int8 of row r
      std::memcpy(&quad, a + r * k + k4 * 4, 4);
      const __m512i av = _mm512_set1_epi32(quad);
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], w0, av);
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], w1, av);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m512i cr = _mm512_set1_epi32(comp[r]);
    _mm512_storeu_si512(c + r * ldc, _mm512_sub_epi32(acc[r][0], cr));
    _mm512_storeu_si512(c + r * ldc + 16, _mm512_sub_epi32(acc[r][1], cr));
  }
}

// The last rows - rows % kRows of a block, with a tile of exactly that many rows.
template <int R>
void tail(const int8_t* a, int64_t k, const uint8_t* w, int32_t* c, int64_t ldc, const int32_t* comp,
          const uint8_t* pf, int64_t rows) {
  if constexpr (R > 0) {
    if (rows == R)
      tile<R>(a, k, w, c, ldc, comp, pf);
    else
      tail<R - 1>(a, k, w, c, ldc, comp, pf, rows);
  }
}

// Rows [m0, m1) of a times one packed block; the first tile prefetches the next block.
void block(const int8_t* a, int64_t m0, int64_t m1, int64_t k, const uint8_t* w, int32_t* c, int64_t ldc,
           const int32_t* comp, const uint8_t* pf) {
  int64_t m = m0;
  for (; m + kRows <= m1; m += kRows, pf = nullptr) tile<kRows>(a + m * k, k, w, c + m * ldc, ldc, comp + m, pf);
  if (m < m1) tail<kRows - 1>(a + m * k, k, w, c + m * ldc, ldc, comp + m, pf, m1 - m);
}

// 128 * sum of each row of a [rows, k] (k a multiple of 4): vpdpbusd against ones.
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

// a [m, k] x packed [n / 32 blocks] -> c [m, n], on the thread pool.
void gemm(const int8_t* a, const uint8_t* w, int32_t* c, int32_t* comp, int64_t m, int64_t k, int64_t n) {
  row_sums(a, m, k, comp);
  const int64_t blocks = n / kCols, block_bytes = k * kCols;
  // An odd, small number of blocks would leave one thread a block more than the other: split
  // each block's rows in two halves instead (items are (block, half), in order).
  const int64_t halves = (blocks % 2 == 1 && blocks < 32) ? 2 : 1;
  const int64_t half_rows = (m + halves - 1) / halves;
  at::parallel_for(0, blocks * halves, 1, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t b = it / halves, h = it % halves;
      const int64_t next = (it + 1) / halves;
      const uint8_t* pf = (it + 1 < end && next != b) ? w + next * block_bytes : nullptr;
      const int64_t m0 = h * half_rows, m1 = std::min(m, m0 + half_rows);
      block(a, m0, m1, k, w + b * block_bytes, c + b * kCols, n, comp, pf);
    }
  });
}

}  // namespace
#pragma GCC pop_options

// Checks and allocates outside the AVX-512 region: nothing here may run AVX-512 before the CPU check.
at::Tensor int8_gemm(at::Tensor x, at::Tensor packed, int64_t n) {
  TORCH_CHECK(cpu_has_vnni_gemm(), "int8_gemm: this CPU has no AVX-512 VNNI (use torch._int_mm)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kChar && x.is_contiguous(),
              "int8_gemm: x must be contiguous int8 [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % 4 == 0 && n % kCols == 0, "int8_gemm: K must be a multiple of 4 and N of 32, got K=", k, " N=", n);
  // (w + 128) * a summed over K stays inside int32 up to K = 65536.
  TORCH_CHECK(k <= 65536, "int8_gemm: K=", k, " is past 65536, where the int32 sums could overflow");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() == n * k,
              "int8_gemm: packed must be quant.pack_vnni's contiguous uint8 of N x K values");
  auto c = at::empty({m, n}, x.options().dtype(at::kInt));
  if (m == 0) return c;
  auto comp = at::empty({m}, x.options().dtype(at::kInt));
  gemm(x.data_ptr<int8_t>(), packed.data_ptr<uint8_t>(), c.data_ptr<int32_t>(), comp.data_ptr<int32_t>(), m, k, n);
  return c;
}

}  // namespace carpool
