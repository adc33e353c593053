// Paged attention for one layer of a flat batch (decode tokens and prefill chunks together).
//
// attention() takes the fused q|k|v projection of every new token (RoPE already applied), writes
// the new keys and values into the paged cache, and returns the attention output of every row:
// - rows [0, num_kernel_rows) (decodes and prefill chunks) run the SIMD kernel of
//   attention_kernels.h, straight from the paged cache through the block tables; bf16 rows (decodes
//   and prefill blocks) on a CPU with AVX-512 BF16 go to attention_bf16.cpp's dot-product kernels;
// - each long prefill chunk (a row of flash_seqs) runs torch's CPU flash attention
//   (at::_scaled_dot_product_flash_attention_for_cpu, blocked and AMX/AVX-512 GEMM based): once
//   causally over the chunk's own keys, once over its cached prefix (gathered block by block), and
//   the two partial results are merged by their log-sum-exp.  Measured on a 2-core Xeon with AMX
//   (benchmarks/attention_kernels.py): ~550 GFLOP/s against ~50 for the previous scalar kernel;
//   the SIMD kernel stays for decodes (memory bound: one pass over K and V) and short chunks,
//   where two torch calls per sequence cost more than the math.
#include <ATen/Parallel.h>
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

namespace carpool {

namespace {

// Calls NS::FN<T, D>(args...) for the instruction set, dtype and head dim of a call.
#define CARPOOL_DISPATCH_ISA(isa, CALL) \
  switch (isa) {                        \
    case kAvx512: {                     \
      namespace ns = avx512;            \
      CALL;                             \
      break;                            \
    }                                   \
    case kAvx2: {                       \
      namespace ns = avx2;              \
      CALL;                             \
      break;                            \
    }                                   \
    default: {                          \
      namespace ns = scalar;            \
      CALL;                             \
    }                                   \
  }

bool is_int8(const at::Tensor& cache) { return cache.scalar_type() == at::kChar; }

// Head dim of a cache: an int8 cache's rows end in their fp32 scale (attention_kernels.h).
int64_t head_dim_of(const at::Tensor& cache) { return cache.size(3) - (is_int8(cache) ? kScaleBytes : 0); }

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
#define CARPOOL_ROWS(DIM) \
  CARPOOL_DISPATCH_ISA(isa, (ns::attend_rows<T, DIM>(q, qs, k, v, tb, mb, sr, cl, o, os, rows, hq, hkv, bs, scale, \
                                                     bf16_dot, k8, v8)))
  switch (d) {
    case 64: CARPOOL_ROWS(64); break;
    case 128: CARPOOL_ROWS(128); break;
    case 32: CARPOOL_ROWS(32); break;
    case 16: CARPOOL_ROWS(16); break;
    default: TORCH_CHECK(false, "attention: head_dim ", d, " is not compiled in (16, 32, 64, 128)");
  }
#undef CARPOOL_ROWS
}

template <typename T>
void merge(const at::Tensor& o1, const at::Tensor& l1, const at::Tensor& o2, const at::Tensor& l2, at::Tensor& out,
           int64_t isa) {
  // o: [1, H, n, D] views (any strides); lse: [1, H, n]; out: [n, H*D] rows.
  TORCH_CHECK(l1.scalar_type() == at::kFloat && l2.scalar_type() == at::kFloat, "attention: fp32 log-sum-exp expected");
  const int64_t nh = o1.size(1), n = o1.size(2), d = o1.size(3);
  const T *a = o1.data_ptr<T>(), *b = o2.data_ptr<T>();
  const float *la = l1.data_ptr<float>(), *lb = l2.data_ptr<float>();
  T* z = out.data_ptr<T>();
  CARPOOL_DISPATCH_ISA(isa, (ns::merge_partials<T>(a, o1.stride(2), o1.stride(1), la, l1.stride(1), l1.stride(2), b,
                                                   o2.stride(2), o2.stride(1), lb, l2.stride(1), l2.stride(2), z,
                                                   out.stride(0), n, nh, d)));
}

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

}  // namespace

// qkv [T, (hq + 2 hkv) * D] (rows may be strided); k/v cache [NB, BS, hkv, D] (contiguous), or
// int8 [NB, BS, hkv, D + 4] (each head vector's fp32 scale after it: kv_cache_dtype "int8");
// slot_mapping [T]; block_tables [S, max_blocks]; seq_of_row / ctx_len [num_kernel_rows]: the
// scheduled sequence of each kernel row and how many keys it sees; flash_seqs [P, 4] int64 rows
// (row start, row count, sequence index into block_tables, cached tokens before the chunk).
// Returns [T, hq * D].
at::Tensor attention(at::Tensor qkv, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping,
                     at::Tensor block_tables, at::Tensor seq_of_row, at::Tensor ctx_len, int64_t num_kernel_rows,
                     at::Tensor flash_seqs, int64_t num_heads, double scale, int64_t isa) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "attention: qkv must be [T, width] with unit column stride");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "attention: the caches must be contiguous");
  TORCH_CHECK(isa <= best_isa(), "attention: instruction set ", isa, " is not supported by this CPU");
  const bool q8 = is_int8(k_cache);
  TORCH_CHECK(is_int8(v_cache) == q8, "attention: the K and V caches must have the same dtype");
  const int64_t t = qkv.size(0), hq = num_heads, hkv = k_cache.size(2), d = head_dim_of(k_cache), bs = k_cache.size(1);
  TORCH_CHECK(qkv.size(1) == (hq + 2 * hkv) * d, "attention: qkv width ", qkv.size(1), " != (", hq, " + 2 * ", hkv,
              ") * ", d);
  if (!q8) {
    write_cache(qkv, k_cache, v_cache, slot_mapping, hq);
  } else {
    switch (qkv.scalar_type()) {
      case at::kBFloat16: write_cache_int8<at::BFloat16>(qkv, k_cache, v_cache, slot_mapping, hq); break;
      case at::kFloat: write_cache_int8<float>(qkv, k_cache, v_cache, slot_mapping, hq); break;
      case at::kHalf: write_cache_int8<at::Half>(qkv, k_cache, v_cache, slot_mapping, hq); break;
      default: TORCH_CHECK(false, "attention: unsupported dtype ", qkv.scalar_type());
    }
  }
  auto out = at::empty({t, hq * d}, qkv.options());
  const float s = static_cast<float>(scale);
  if (num_kernel_rows > 0) {
    switch (qkv.scalar_type()) {
      case at::kBFloat16: rows_kernel<at::BFloat16>(qkv, k_cache, v_cache, block_tables, seq_of_row, ctx_len, out,
                                                    num_kernel_rows, hq, s, isa); break;
      case at::kFloat: rows_kernel<float>(qkv, k_cache, v_cache, block_tables, seq_of_row, ctx_len, out,
                                          num_kernel_rows, hq, s, isa); break;
      case at::kHalf: rows_kernel<at::Half>(qkv, k_cache, v_cache, block_tables, seq_of_row, ctx_len, out,
                                            num_kernel_rows, hq, s, isa); break;
      default: TORCH_CHECK(false, "attention: unsupported dtype ", qkv.scalar_type());
    }
  }
  const int64_t p = flash_seqs.size(0);
  const int64_t* fs = flash_seqs.data_ptr<int64_t>();
  for (int64_t i = 0; i < p; ++i) {
    const int64_t row0 = fs[4 * i], n = fs[4 * i + 1], seq = fs[4 * i + 2], cached = fs[4 * i + 3];
    auto rows = qkv.narrow(0, row0, n);
    // [1, heads, n, D] views of the chunk's q, k, v (no copies).
    auto q = rows.narrow(1, 0, hq * d).view({n, hq, d}).unsqueeze(0).transpose(1, 2);
    auto k = rows.narrow(1, hq * d, hkv * d).view({n, hkv, d}).unsqueeze(0).transpose(1, 2);
    auto v = rows.narrow(1, (hq + hkv) * d, hkv * d).view({n, hkv, d}).unsqueeze(0).transpose(1, 2);
    auto [o_new, lse_new] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, true, std::nullopt, scale);
    auto dst = out.narrow(0, row0, n);
    if (cached == 0) {
      dst.view({n, hq, d}).copy_(o_new[0].transpose(0, 1));
      continue;
    }
    // The cached prefix: whole blocks gathered (each block is contiguous in the cache), then cut.
    const int64_t nb = (cached + bs - 1) / bs;
    auto ids = block_tables[seq].narrow(0, 0, nb);
    auto kb = k_cache.index_select(0, ids), vb = v_cache.index_select(0, ids);
    if (q8) {  // the chunk's own keys above are the unrounded ones; its cached prefix is what the cache holds
      kb = dequantize_blocks(kb, qkv.scalar_type());
      vb = dequantize_blocks(vb, qkv.scalar_type());
    }
    auto kp = kb.view({nb * bs, hkv, d}).narrow(0, 0, cached).unsqueeze(0).transpose(1, 2);
    auto vp = vb.view({nb * bs, hkv, d}).narrow(0, 0, cached).unsqueeze(0).transpose(1, 2);
    auto [o_pre, lse_pre] = at::_scaled_dot_product_flash_attention_for_cpu(q, kp, vp, 0.0, false, std::nullopt, scale);
    switch (qkv.scalar_type()) {
      case at::kBFloat16: merge<at::BFloat16>(o_new, lse_new, o_pre, lse_pre, dst, isa); break;
      case at::kFloat: merge<float>(o_new, lse_new, o_pre, lse_pre, dst, isa); break;
      case at::kHalf: merge<at::Half>(o_new, lse_new, o_pre, lse_pre, dst, isa); break;
      default: TORCH_CHECK(false, "attention: unsupported dtype ", qkv.scalar_type());
    }
  }
  return out;
}

}  // namespace carpool
