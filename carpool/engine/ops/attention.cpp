// Paged attention for one layer of a flat batch (decode tokens and prefill chunks together).
//
// attention() takes the fused q|k|v projection of every new token (RoPE already applied), writes
// the new keys and values into the paged cache, and returns the attention output of every row.
// Three routes, chosen per chunk by the engine plan (engine/plan.py) on the machine it runs on:
// - rows [0, num_kernel_rows) (decodes and prefill chunks) run the SIMD kernel of
//   attention_kernels.h, straight from the paged cache through the block tables; bf16 rows (decodes
//   and prefill blocks) on a CPU with AVX-512 BF16 go to attention_bf16.cpp's dot-product kernels;
// - chunks of route 1 run attention_brgemm_kernels.h: two GEMMs per tile of keys on ATen's brgemm
//   micro-kernel (oneDNN's ukernel: AMX tiles where the CPU has them, AVX-512 or AVX2 elsewhere),
//   the keys packed tile by tile from the paged cache; a decode row is a chunk of one row;
// - chunks of route 0 run torch's CPU flash attention (at::_scaled_dot_product_flash_attention_for_cpu,
//   blocked and AMX/AVX-512 GEMM based): once causally over the chunk's own keys, once over its
//   cached prefix (gathered block by block), and the two partial results are merged by their
//   log-sum-exp.  Measured on a 2-core Xeon with AMX (benchmarks/attention_kernels.py): ~550 GFLOP/s
//   against ~50 for the previous scalar kernel.
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention_bf16.h"
#include "simd.h"

#define CARPOOL_KERNELS "attention_kernels.h"
#include "per_isa.h"
#define CARPOOL_KERNELS "attention_brgemm_kernels.h"
#include "per_isa.h"

namespace carpool {

namespace {

constexpr int64_t kFlash = 0, kBrgemm = 1;  // the routes of a chunk (column 4 of `chunks`)
constexpr int64_t kTileKeysOf = avx512::kTileKeys;  // the same in every ISA's copy

bool is_int8(const at::Tensor& cache) { return cache.scalar_type() == at::kChar; }

// Head dim of a cache: an int8 cache's rows end in their fp32 scale (attention_kernels.h).
int64_t head_dim_of(const at::Tensor& cache) { return cache.size(3) - (is_int8(cache) ? kScaleBytes : 0); }

// Copy the new tokens' keys and values (columns [hq*D, (hq+2*hkv)*D) of qkv) into their cache slots.
void write_cache(const at::Tensor& qkv, at::Tensor& kc, at::Tensor& vc, const at::Tensor& slots, int64_t hq) {
  const int64_t t = qkv.size(0), row = kc.size(2) * kc.size(3), qoff = hq * kc.size(3);
  const int64_t es = qkv.element_size(), qs = qkv.stride(0);
  const int64_t* s = slots.data_ptr<int64_t>();
  const char* src = static_cast<const char*>(qkv.data_ptr());
  char *k = static_cast<char*>(kc.data_ptr()), *v = static_cast<char*>(vc.data_ptr());
  at::parallel_for(0, t, 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      std::memcpy(k + s[i] * row * es, src + (i * qs + qoff) * es, row * es);
      std::memcpy(v + s[i] * row * es, src + (i * qs + qoff + row) * es, row * es);
    }
  });
}

// The same into an int8 cache [NB, BS, hkv, D + 4]: each head vector quantized symmetrically on
// its own, q = round(x * (127 / amax)) with its scale amax / 127 in the row's last 4 bytes; the
// formula of quant.quantize_rows (and kv_quant.pack), op for op, so both paths store the same bytes.
template <typename T>
void write_cache_int8(const at::Tensor& qkv, at::Tensor& kc, at::Tensor& vc, const at::Tensor& slots, int64_t hq) {
  const int64_t t = qkv.size(0), hkv = kc.size(2), row = kc.size(3), d = head_dim_of(kc), qs = qkv.stride(0);
  const int64_t* s = slots.data_ptr<int64_t>();
  const T* src = qkv.data_ptr<T>();
  int8_t *k = kc.data_ptr<int8_t>(), *v = vc.data_ptr<int8_t>();
  at::parallel_for(0, t, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      for (int64_t kv = 0; kv < 2; ++kv)
        for (int64_t h = 0; h < hkv; ++h) {
          const T* x = src + i * qs + (hq + kv * hkv + h) * d;
          int8_t* dst = (kv == 0 ? k : v) + (s[i] * hkv + h) * row;
          float amax = 0.f;
          for (int64_t j = 0; j < d; ++j) amax = std::max(amax, std::fabs(static_cast<float>(x[j])));
          amax = std::max(amax, 1e-12f);
          const float inv = (1.f / amax) * 127.f, scale = amax * (1.f / 127.f);
          for (int64_t j = 0; j < d; ++j) {
            const float r = std::nearbyint(static_cast<float>(x[j]) * inv);
            dst[j] = static_cast<int8_t>(std::min(127.f, std::max(-128.f, r)));
          }
          std::memcpy(dst + d, &scale, sizeof scale);
        }
  });
}

// int8 cache blocks [n, BS, hkv, D + 4] -> [n, BS, hkv, D] in dtype: x * scale, rounded once.
at::Tensor dequantize_blocks(const at::Tensor& blocks, at::ScalarType dtype) {
  const int64_t d = head_dim_of(blocks);
  auto scale = blocks.narrow(3, d, kScaleBytes).contiguous().view(at::kFloat);  // [n, BS, hkv, 1]
  return (blocks.narrow(3, 0, d).to(at::kFloat) * scale).to(dtype);
}

template <typename T>
void rows_kernel(const at::Tensor& qkv, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& tables,
                 const at::Tensor& seq_of_row, const at::Tensor& ctx_len, at::Tensor& out, int64_t rows, int64_t hq,
                 float scale, int64_t isa) {
  const int64_t d = head_dim_of(kc), bs = kc.size(1), hkv = kc.size(2);
  const T* q = qkv.data_ptr<T>();
  const int64_t qs = qkv.stride(0), os = out.stride(0), mb = tables.size(1);
  const bool q8 = is_int8(kc);
  const T *k = q8 ? nullptr : kc.data_ptr<T>(), *v = q8 ? nullptr : vc.data_ptr<T>();
  const int8_t *k8 = q8 ? kc.data_ptr<int8_t>() : nullptr, *v8 = q8 ? vc.data_ptr<int8_t>() : nullptr;
  const int64_t *tb = tables.data_ptr<int64_t>(), *sr = seq_of_row.data_ptr<int64_t>(), *cl = ctx_len.data_ptr<int64_t>();
  T* o = out.data_ptr<T>();
  const bool bf16_dot = isa == kAvx512 && attention_bf16_enabled();
#define CARPOOL_ROWS(DIM)                                                                                          \
  CARPOOL_ISA(isa, (ns::attend_rows<T, DIM>(q, qs, k, v, tb, mb, sr, cl, o, os, rows, hq, hkv, bs, scale, bf16_dot, \
                                            k8, v8)))
  switch (d) {
    case 64: CARPOOL_ROWS(64); break;
    case 128: CARPOOL_ROWS(128); break;
    case 32: CARPOOL_ROWS(32); break;
    case 16: CARPOOL_ROWS(16); break;
    default: TORCH_CHECK(false, "attention: head_dim ", d, " is not compiled in (16, 32, 64, 128)");
  }
#undef CARPOOL_ROWS
}

// One chunk through torch's flash attention: its own keys causally, its cached prefix (gathered
// block by block; an int8 cache dequantized) apart, the two merged by their log-sum-exp.
void flash_chunk(const at::Tensor& qkv, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_tables, const int64_t* chunk, at::Tensor& out, int64_t hq, double scale,
                 int64_t isa) {
  const int64_t row0 = chunk[0], n = chunk[1], seq = chunk[2], cached = chunk[3];
  const int64_t hkv = k_cache.size(2), d = head_dim_of(k_cache), bs = k_cache.size(1);
  auto rows = qkv.narrow(0, row0, n);
  // [1, heads, n, D] views of the chunk's q, k, v (no copies).
  auto q = rows.narrow(1, 0, hq * d).view({n, hq, d}).unsqueeze(0).transpose(1, 2);
  auto k = rows.narrow(1, hq * d, hkv * d).view({n, hkv, d}).unsqueeze(0).transpose(1, 2);
  auto v = rows.narrow(1, (hq + hkv) * d, hkv * d).view({n, hkv, d}).unsqueeze(0).transpose(1, 2);
  auto [o_new, lse_new] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, true, std::nullopt, scale);
  auto dst = out.narrow(0, row0, n);
  if (cached == 0) {
    dst.view({n, hq, d}).copy_(o_new[0].transpose(0, 1));
    return;
  }
  // The cached prefix: whole blocks gathered (each block is contiguous in the cache), then cut.
  const int64_t nb = (cached + bs - 1) / bs;
  auto ids = block_tables[seq].narrow(0, 0, nb);
  auto kb = k_cache.index_select(0, ids), vb = v_cache.index_select(0, ids);
  if (is_int8(k_cache)) {  // the chunk's own keys above are the unrounded ones; its prefix is what the cache holds
    kb = dequantize_blocks(kb, qkv.scalar_type());
    vb = dequantize_blocks(vb, qkv.scalar_type());
  }
  auto kp = kb.view({nb * bs, hkv, d}).narrow(0, 0, cached).unsqueeze(0).transpose(1, 2);
  auto vp = vb.view({nb * bs, hkv, d}).narrow(0, 0, cached).unsqueeze(0).transpose(1, 2);
  auto [o_pre, lse_pre] = at::_scaled_dot_product_flash_attention_for_cpu(q, kp, vp, 0.0, false, std::nullopt, scale);
  // o: [1, H, n, D] views (any strides); lse: [1, H, n]; dst: [n, H*D] rows.
  TORCH_CHECK(lse_new.scalar_type() == at::kFloat && lse_pre.scalar_type() == at::kFloat,
              "attention: fp32 log-sum-exp expected");
  const float *la = lse_new.data_ptr<float>(), *lb = lse_pre.data_ptr<float>();
  CARPOOL_DISPATCH(isa, qkv.scalar_type(), "attention",
                   (ns::merge_partials<T>(o_new.data_ptr<T>(), o_new.stride(2), o_new.stride(1), la,
                                          lse_new.stride(1), lse_new.stride(2), o_pre.data_ptr<T>(), o_pre.stride(2),
                                          o_pre.stride(1), lb, lse_pre.stride(1), lse_pre.stride(2),
                                          dst.data_ptr<T>(), dst.stride(0), n, hq, d)));
}

// C[M, N] = A[M, K] B[K, N] through ATen's brgemm, B in the layout attention_brgemm_kernels.h packs
// (bf16: pairs along K), on small whole numbers (exact in bf16 and in fp32 sums), against the plain
// loop; false where the micro-kernel is not built into this torch, does not run on this CPU, or
// reads its B another way.
template <typename T>
bool brgemm_layout_holds(int64_t m, int64_t n, int64_t k) {
  constexpr int64_t p = std::is_same_v<T, float> ? 1 : 2;
  std::vector<T> a(m * k), b(k * n);
  std::vector<float> c(m * n), want(m * n, 0.f);
  for (int64_t i = 0; i < m * k; ++i) a[i] = T(static_cast<float>(i % 7 - 3));
  for (int64_t kk = 0; kk < k; ++kk)
    for (int64_t j = 0; j < n; ++j) b[((kk / p) * n + j) * p + kk % p] = T(static_cast<float>((kk + 2 * j) % 5 - 2));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t kk = 0; kk < k; ++kk)
        want[i * n + j] += static_cast<float>(a[i * k + kk]) * static_cast<float>(b[((kk / p) * n + j) * p + kk % p]);
  at::native::cpublas::brgemm(m, n, k, k, n, n, false, a.data(), b.data(), c.data(), p == 2);
  at::native::cpublas::brgemm_release(p == 2);
  return c == want;
}

}  // namespace

bool brgemm_attention_runs(at::ScalarType dtype) {
  // The two products a unit runs, S = Q K^T (K = head dim) and O = P V (K = a tile's keys), at
  // every head dim the kernels take and a row count that is no multiple of a tile's.
  auto holds = [](auto tag) {
    using T = decltype(tag);
    for (const int64_t d : {16, 32, 64, 128})
      if (!brgemm_layout_holds<T>(5, kTileKeysOf, d) || !brgemm_layout_holds<T>(5, d, kTileKeysOf)) return false;
    return true;
  };
  try {
    if (dtype == at::kBFloat16) return holds(at::BFloat16());
    if (dtype == at::kFloat) return holds(float());
  } catch (const c10::Error&) {
  }
  return false;
}

// qkv [T, (hq + 2 hkv) * D] (rows may be strided); k/v cache [NB, BS, hkv, D] (contiguous), or
// int8 [NB, BS, hkv, D + 4] (each head vector's fp32 scale after it: kv_cache_dtype "int8");
// slot_mapping [T]; block_tables [S, max_blocks]; seq_of_row / ctx_len [num_kernel_rows]: the
// scheduled sequence of each kernel row and how many keys it sees; chunks [P, 5] int64 rows (row
// start, row count, sequence index into block_tables, cached tokens before the chunk, route: 0
// flash, 1 brgemm; the brgemm route takes a bf16 or fp32 cache).  Returns [T, hq * D].
at::Tensor attention(at::Tensor qkv, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping,
                     at::Tensor block_tables, at::Tensor seq_of_row, at::Tensor ctx_len, int64_t num_kernel_rows,
                     at::Tensor chunks, int64_t num_heads, double scale, int64_t isa) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "attention: qkv must be [T, width] with unit column stride");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "attention: the caches must be contiguous");
  TORCH_CHECK(chunks.dim() == 2 && chunks.size(1) == 5 && chunks.is_contiguous() && chunks.scalar_type() == at::kLong,
              "attention: chunks must be contiguous int64 [P, 5]");
  const bool q8 = is_int8(k_cache);
  TORCH_CHECK(is_int8(v_cache) == q8, "attention: the K and V caches must have the same dtype");
  const int64_t t = qkv.size(0), hq = num_heads, hkv = k_cache.size(2), d = head_dim_of(k_cache), bs = k_cache.size(1);
  TORCH_CHECK(qkv.size(1) == (hq + 2 * hkv) * d, "attention: qkv width ", qkv.size(1), " != (", hq, " + 2 * ", hkv,
              ") * ", d);
  if (!q8) {
    write_cache(qkv, k_cache, v_cache, slot_mapping, hq);
  } else {
    CARPOOL_DISPATCH(isa, qkv.scalar_type(), "attention",
                     (write_cache_int8<T>(qkv, k_cache, v_cache, slot_mapping, hq)));
  }
  auto out = at::empty({t, hq * d}, qkv.options());
  const float s = static_cast<float>(scale);
  if (num_kernel_rows > 0) {
    CARPOOL_DISPATCH(isa, qkv.scalar_type(), "attention",
                     (rows_kernel<T>(qkv, k_cache, v_cache, block_tables, seq_of_row, ctx_len, out, num_kernel_rows,
                                     hq, s, isa)));
  }
  const int64_t p = chunks.size(0);
  const int64_t* ch = chunks.data_ptr<int64_t>();
  bool brgemm = false;
  if (p > 0) {
    TORCH_CHECK(block_tables.dim() == 2 && block_tables.is_contiguous() && block_tables.scalar_type() == at::kLong,
                "attention: block_tables must be contiguous int64 [S, max_blocks]");
  }
  const int64_t* tables = p > 0 ? block_tables.data_ptr<int64_t>() : nullptr;
  const int64_t num_blocks = k_cache.size(0), width = p > 0 ? block_tables.size(1) : 0;
  for (int64_t i = 0; i < p; ++i) {
    // Both chunk routes index the output, the block table and the cache with these numbers
    // unchecked, so a wrong row here would read or write past a tensor: refuse it instead.
    const int64_t start = ch[5 * i], count = ch[5 * i + 1], seq = ch[5 * i + 2], cached = ch[5 * i + 3];
    TORCH_CHECK(ch[5 * i + 4] == kFlash || ch[5 * i + 4] == kBrgemm, "attention: chunk route must be 0 or 1");
    TORCH_CHECK(start >= 0 && count > 0 && start + count <= t, "attention: chunk ", i, " rows ", start, "+", count,
                " are outside the ", t, " rows of qkv");
    TORCH_CHECK(seq >= 0 && seq < block_tables.size(0), "attention: chunk ", i, " names sequence ", seq, " of ",
                block_tables.size(0));
    const int64_t used = (cached + count + bs - 1) / bs;
    TORCH_CHECK(cached >= 0 && used <= width, "attention: chunk ", i, " needs ", used, " blocks, its table holds ",
                width);
    for (int64_t b = 0; b < used; ++b) {
      const int64_t id = tables[seq * width + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "attention: chunk ", i, " names block ", id, " of ", num_blocks);
    }
    brgemm = brgemm || ch[5 * i + 4] == kBrgemm;
  }
  if (brgemm) {
    const auto dtype = qkv.scalar_type();
    TORCH_CHECK(!q8 && (dtype == at::kBFloat16 || dtype == at::kFloat),
                "attention: the brgemm route takes a bf16 or fp32 model and cache, got ", dtype,
                q8 ? " with an int8 cache" : "");
    CARPOOL_DISPATCH(isa, dtype, "attention",
                     (ns::attend_chunks_brgemm<T>(qkv.data_ptr<T>(), qkv.stride(0), k_cache.data_ptr<T>(),
                                                  v_cache.data_ptr<T>(), block_tables.data_ptr<int64_t>(),
                                                  block_tables.size(1), ch, p, out.data_ptr<T>(), out.stride(0), hq,
                                                  hkv, bs, d, s)));
  }
  for (int64_t i = 0; i < p; ++i)
    if (ch[5 * i + 4] == kFlash) flash_chunk(qkv, k_cache, v_cache, block_tables, ch + 5 * i, out, hq, scale, isa);
  return out;
}

}  // namespace carpool
