// Prefill and decode attention on AVX-512 BF16 (attention_bf16.cpp): the tiled path of attention_kernels.h
// for bf16 models on CPUs that multiply bf16 pairs natively (vdpbf16ps).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <vector>

namespace carpool {

// Bytes after each head vector of an int8 KV cache [blocks, bs, hkv, D + kScaleBytes]: its fp32
// scale (attention.cpp writes it, attention_kernels.h's stage_kv reads it).
constexpr int64_t kScaleBytes = 4;

// offs[l] = element offset in a paged cache [blocks, bs, hkv, D] of key l's vector at head_off
// (h * D), for the first len keys of a sequence through its block table; offs[len .. total) repeat
// key 0 (padding and prefetch distance: read, weighted 0; the cache holds finite values).  Shared
// by both attention paths (attention_kernels.h, attention_bf16.cpp).
// The pointer form writes total entries at offs (len >= 1).
inline void key_offsets(const int64_t* table, int64_t len, int64_t total, int64_t bs, int64_t kstride,
                        int64_t head_off, int64_t* offs) {
  for (int64_t l = 0, blk = 0; l < len; ++blk)
    for (int64_t o = 0; o < bs && l < len; ++o, ++l) offs[l] = (table[blk] * bs + o) * kstride + head_off;
  for (int64_t l = len; l < total; ++l) offs[l] = offs[0];
}

inline void key_offsets(const int64_t* table, int64_t len, int64_t total, int64_t bs, int64_t kstride,
                        int64_t head_off, std::vector<int64_t>& offs) {
  offs.resize(static_cast<size_t>(total));
  key_offsets(table, len, total, bs, kstride, head_off, offs.data());
}

// The work items thread t of nthreads takes: those whose cost midpoint falls in its share of the
// total (cum[w] = cost of the items before item w), so a few costly items (long contexts) do not
// leave one thread idle while another finishes them.  Shared by the attention paths' item loops.
inline std::vector<int64_t> share_of(const std::vector<double>& cum, int64_t t, int64_t nthreads) {
  const int64_t items = static_cast<int64_t>(cum.size()) - 1;
  const double lo = cum[items] * t / nthreads, hi = cum[items] * (t + 1) / nthreads;
  std::vector<int64_t> mine;
  for (int64_t w = 0; w < items; ++w) {
    const double mid = 0.5 * (cum[w] + cum[w + 1]);
    if (mid >= lo && mid < hi) mine.push_back(w);
  }
  return mine;
}

// Whether this CPU and OS run AVX-512 BF16 (with AVX-512 F/BW/DQ/VL).
bool cpu_has_avx512_bf16();

// Whether attend_rows hands bf16 blocks of many query vectors to attend_item_bf16: on by default
// where the CPU has the instructions; set(false) keeps the fp32 path (tests compare both).
bool attention_bf16_enabled();
void set_attention_bf16_enabled(bool on);

// One work item of attend_rows: rows [row0, row0 + nr) of one sequence (ctx_len[row] keys each,
// through its block table) against KV head h and its g query heads.  Returns false, doing
// nothing, for shapes it does not cover (head_dim other than 32, 64, 128; more than 128 query
// vectors); the caller then runs its own path.
bool attend_item_bf16(const c10::BFloat16* q, int64_t q_stride, const c10::BFloat16* kc, const c10::BFloat16* vc,
                      const int64_t* table, const int64_t* ctx_len, c10::BFloat16* out, int64_t out_stride,
                      int64_t row0, int64_t nr, int64_t h, int64_t g, int64_t hkv, int64_t bs, int64_t d, float scale);

// stage_kv of attention_kernels.h for bf16 with the CPU's own rounding (vcvtne2ps2bf16: the same
// values, a third of the instructions of the emulated rounding).  False, doing nothing, for a head
// dim that is not a multiple of 32.
bool stage_kv_bf16(const int8_t* kq, const int8_t* vq, const int64_t* table, int64_t keys, int64_t bs, int64_t hkv,
                   int64_t d, int64_t h0, int64_t h1, c10::BFloat16* ks, c10::BFloat16* vs);

// Whether attend_rows sends decode rows of an int8 cache to attend_row_int8 (AVX-512 VNNI, on by
// default where the CPU has it with AVX-512 BF16); off: they are staged (stage_kv) like every other
// item.  Tests compare both.
bool cpu_has_avx512_vnni();
bool attention_int8_enabled();
void set_attention_int8_enabled(bool on);

// attend_row_bf16 on an int8 cache, reading it as int8 (queries quantized to int8, probabilities
// to int16 per chunk of keys; attention_bf16.cpp says how).  False, doing nothing, for head dims
// other than 64 and 128 or more than 4 query heads a KV head.
bool attend_row_int8(const c10::BFloat16* q, int64_t q_stride, const int8_t* kq, const int8_t* vq,
                     const int64_t* table, const int64_t* ctx_len, c10::BFloat16* out, int64_t out_stride,
                     int64_t row, int64_t g, int64_t hkv, int64_t bs, int64_t d, float scale,
                     const int64_t* next_table, int64_t next_len);

// One decode row (a block of one query row) against all hkv KV heads, g query heads each, reading
// each key's whole cache row once; its prefetches run on into the first keys of the next row the
// thread takes (next_table, next_len keys; next_len 0: none).  Returns false, doing nothing, for
// shapes it does not cover (head_dim other than 32, 64, 128; more than 4 query heads a KV head).
bool attend_row_bf16(const c10::BFloat16* q, int64_t q_stride, const c10::BFloat16* kc, const c10::BFloat16* vc,
                     const int64_t* table, const int64_t* ctx_len, c10::BFloat16* out, int64_t out_stride,
                     int64_t row, int64_t g, int64_t hkv, int64_t bs, int64_t d, float scale,
                     const int64_t* next_table, int64_t next_len);

}  // namespace carpool
