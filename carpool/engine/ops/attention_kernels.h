// Attention kernel bodies, written once against simd.h's vocabulary (Vf, W, load, fmadd, ...).
// attention.cpp has per_isa.h include this file three times, inside namespace
// carpool::{avx512,avx2,scalar} and the matching `#pragma GCC target` region, so each copy is
// compiled for its instruction set.
// No include guard on purpose; the headers it needs are included by attention.cpp first.

// Rows are processed in blocks of up to kRows consecutive rows of one sequence (a short prefill
// chunk; a decode is a block of one), per KV head: each key/value vector is loaded and converted
// to fp32 once and used by every query row x query head of the block (GQA without copies).
constexpr int64_t kRows = 16;
// Rows of a block for attend_item_bf16 (at most 128 query vectors): each key is read and its pairs
// broadcast once for 96 query vectors (SmolLM2's 3 query heads a KV head) instead of 48; a 2000-token
// prompt's layer 16.8 -> 16.2 ms, eight 200-token prompts 2.1 -> 1.7 ms.
constexpr int64_t kRowsBf16 = 32;

// Below this many query vectors (rows x query heads) an item computes each score as a dot product
// (decodes: memory bound, one pass over K and V); from it on, W keys at a time with the key tile
// transposed so the lanes run over keys (no horizontal sums; ~2.5x fewer instructions per score).
constexpr int64_t kTiledMinQueries = 8;
// Vector registers of the instruction set (blocking factors of the tiled path are sized to them).
constexpr int kRegs = W == 16 ? 32 : 16;
// Keys ahead of the current one whose cache lines are prefetched (the pages of a sequence are
// scattered, so the hardware prefetcher loses the stream at every page boundary).
constexpr int64_t kPrefetch = 24;

// Softmax over each query's padded score row, in fp32 (as HF's eager attention); -inf entries
// (keys a row must not see, padding) become exactly 0.
inline void softmax_rows(float* scores, int64_t nq, int64_t lpad) {
  for (int64_t x = 0; x < nq; ++x) {
    float* sx = scores + x * lpad;
    Vf m = set1(-INFINITY);
    for (int64_t l = 0; l < lpad; l += W) m = max(m, load(sx + l));
    const Vf mx = set1(reduce_max(m));
    Vf sum = zero();
    for (int64_t l = 0; l < lpad; l += W) {
      Vf e = exp(sub(load(sx + l), mx));  // -inf - max -> below kExpLo -> exactly 0
      store(sx + l, e);
      sum = add(sum, e);
    }
    const Vf inv = set1(1.f / reduce_add(sum));
    for (int64_t l = 0; l < lpad; l += W) store(sx + l, mul(load(sx + l), inv));
  }
}

// One work item: rows [row0, row0 + nr) of one sequence against KV head h.
// Two passes over the context: scores (into a per-thread buffer), softmax, then the value pass;
// each key and value vector is read from the paged cache once.
template <typename T, int D>
inline void attend_item(const T* q, int64_t q_stride, const T* kc, const T* vc, const int64_t* table,
                        const int64_t* ctx_len, T* out, int64_t out_stride, int64_t row0, int64_t nr, int64_t h,
                        int64_t g, int64_t hkv, int64_t bs, float scale, std::vector<float>& buf,
                        std::vector<int64_t>& offs) {
  constexpr int NV = D / W;
  const int64_t nq = nr * g;
  int64_t maxlen = 0;
  for (int64_t r = 0; r < nr; ++r) maxlen = ctx_len[row0 + r] > maxlen ? ctx_len[row0 + r] : maxlen;
  const int64_t lpad = (maxlen + W - 1) / W * W;  // score rows padded to whole vectors
  const bool tiled = nq >= kTiledMinQueries;
  buf.resize(static_cast<size_t>(nq * (lpad + 2 * D) + (tiled ? 2 * W * D : 0)));
  float* scores = buf.data();
  float* qf = scores + nq * lpad;
  float* acc = qf + nq * D;
  float* tile = acc + nq * D;  // [W keys][D] fp32 (tiled path)
  float* tile_t = tile + W * D;  // [D][W keys] fp32, the transpose
  // Element offset of key l's head-h vector in the cache; the padding repeats key 0 (read, never used).
  key_offsets(table, maxlen, lpad + kPrefetch, bs, hkv * D, h * D, offs);
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t j = 0; j < g; ++j)
      for (int i = 0; i < NV; ++i)
        store(qf + (r * g + j) * D + i * W,
              mul(load(q + (row0 + r) * q_stride + (h * g + j) * D + i * W), set1(scale)));
  for (int64_t x = 0; x < nq * lpad; ++x) scores[x] = -INFINITY;

  if (!tiled) {
    for (int64_t l = 0; l < maxlen; ++l) {
      _mm_prefetch(reinterpret_cast<const char*>(kc + offs[l + kPrefetch]), _MM_HINT_T0);
      if (D * sizeof(T) > 64) _mm_prefetch(reinterpret_cast<const char*>(kc + offs[l + kPrefetch]) + 64, _MM_HINT_T0);
      const T* kp = kc + offs[l];
      Vf kv[NV];
      for (int i = 0; i < NV; ++i) kv[i] = load(kp + i * W);
      for (int64_t r = 0; r < nr; ++r) {
        if (l >= ctx_len[row0 + r]) continue;
        for (int64_t j = 0; j < g; ++j) {
          const float* qj = qf + (r * g + j) * D;
          Vf s = mul(load(qj), kv[0]);
          for (int i = 1; i < NV; ++i) s = fmadd(load(qj + i * W), kv[i], s);
          scores[(r * g + j) * lpad + l] = reduce_add(s);
        }
      }
    }
    softmax_rows(scores, nq, lpad);
    for (int64_t x = 0; x < nq * D; ++x) acc[x] = 0.f;
    for (int64_t l = 0; l < maxlen; ++l) {
      _mm_prefetch(reinterpret_cast<const char*>(vc + offs[l + kPrefetch]), _MM_HINT_T0);
      if (D * sizeof(T) > 64) _mm_prefetch(reinterpret_cast<const char*>(vc + offs[l + kPrefetch]) + 64, _MM_HINT_T0);
      const T* vp = vc + offs[l];
      Vf vv[NV];
      for (int i = 0; i < NV; ++i) vv[i] = load(vp + i * W);
      for (int64_t r = 0; r < nr; ++r) {
        if (l >= ctx_len[row0 + r]) continue;
        for (int64_t j = 0; j < g; ++j) {
          const int64_t x = r * g + j;
          const Vf p = set1(scores[x * lpad + l]);
          float* ax = acc + x * D;
          for (int i = 0; i < NV; ++i) store(ax + i * W, fmadd(p, vv[i], load(ax + i * W)));
        }
      }
    }
  } else {
    // Scores, W keys at a time: the tile's keys converted to fp32 and transposed to [D][W]; a
    // query's W scores are D multiply-adds of a broadcast q element with a row of the transpose,
    // DC rows at a time held in registers while every query of the item passes over them.
    constexpr int DC = D < kRegs / 2 ? D : kRegs / 2;
    for (int64_t l0 = 0; l0 < lpad; l0 += W) {
      for (int64_t w = 0; w < W; ++w)
        for (int i = 0; i < NV; ++i) store(tile + w * D + i * W, load(kc + offs[l0 + w] + i * W));
      for (int d = 0; d < D; ++d) store(tile_t + d * W, gather(tile + d, D));
      for (int d0 = 0; d0 < D; d0 += DC) {
        Vf kt[DC];
        for (int d = 0; d < DC; ++d) kt[d] = load(tile_t + (d0 + d) * W);
        for (int64_t x = 0; x < nq; ++x) {
          if (l0 >= ctx_len[row0 + x / g]) continue;
          const float* qx = qf + x * D + d0;
          float* sx = scores + x * lpad + l0;
          Vf acc_s = d0 ? load(sx) : zero();
          for (int d = 0; d < DC; ++d) acc_s = fmadd(set1(qx[d]), kt[d], acc_s);
          store(sx, acc_s);
        }
      }
      for (int64_t x = 0; x < nq; ++x) {  // keys past a row's context (and the padding): -inf
        const int64_t ctx = ctx_len[row0 + x / g];
        for (int64_t w = std::max<int64_t>(ctx - l0, 0); w < W; ++w) scores[x * lpad + l0 + w] = -INFINITY;
      }
    }
    softmax_rows(scores, nq, lpad);
    // Values, W keys at a time: KG keys' value vectors held in registers while every query adds
    // them into its accumulator (loaded and stored once per KG keys).
    constexpr int KG0 = (kRegs - NV - 2) / NV >= 4 ? 4 : (kRegs - NV - 2) / NV >= 2 ? 2 : 1;
    constexpr int KG = KG0 < W ? KG0 : W;
    for (int64_t x = 0; x < nq * D; ++x) acc[x] = 0.f;
    for (int64_t l0 = 0; l0 < lpad; l0 += W) {
      for (int64_t w = 0; w < W; ++w)
        for (int i = 0; i < NV; ++i) store(tile + w * D + i * W, load(vc + offs[l0 + w] + i * W));
      for (int w0 = 0; w0 < W; w0 += KG) {
        Vf vt[KG][NV];
        for (int k = 0; k < KG; ++k)
          for (int i = 0; i < NV; ++i) vt[k][i] = load(tile + (w0 + k) * D + i * W);
        for (int64_t x = 0; x < nq; ++x) {
          if (l0 + w0 >= ctx_len[row0 + x / g]) continue;
          const float* px = scores + x * lpad + l0 + w0;  // 0 for keys this row must not see
          float* ax = acc + x * D;
          Vf a[NV];
          for (int i = 0; i < NV; ++i) a[i] = load(ax + i * W);
          for (int k = 0; k < KG; ++k) {
            const Vf p = set1(px[k]);
            for (int i = 0; i < NV; ++i) a[i] = fmadd(p, vt[k][i], a[i]);
          }
          for (int i = 0; i < NV; ++i) store(ax + i * W, a[i]);
        }
      }
    }
  }
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t j = 0; j < g; ++j)
      for (int i = 0; i < NV; ++i)
        store(out + (row0 + r) * out_stride + (h * g + j) * D + i * W, load(acc + (r * g + j) * D + i * W));
}

// An int8 KV cache (EngineConfig.kv_cache_dtype="int8", engine/kv_quant.py): each token's head
// vector is D int8 values then its fp32 scale, [blocks, bs, hkv, D + kScaleBytes].
// A decode row on AVX-512 VNNI reads it as int8 (attend_row_int8, attention_bf16.cpp).  Every
// other item first dequantizes the keys and values it will read (heads h0..h1 of the sequence's
// first `keys` tokens) into per-thread buffers laid out as a model-dtype cache of consecutive
// blocks, x * scale rounded to T as kv_quant.unpack does, and then runs the same kernels on them
// through an identity block table: one dequantization serves every path (prefill blocks, each ISA,
// bf16 dot products) with the results of a model-dtype cache of those values
// (tests/engine/test_kv_int8.py).  It costs a write and a read of every key's values: staged
// decode rows took 0.99 ms a layer where the bf16 cache took 0.61 and the int8 decode row 0.51
// (benchmarks/attention_kernels.py, 64 rows x 300 keys), hence the int8 decode row.

template <typename T, int D>
void stage_kv(const int8_t* kq, const int8_t* vq, const int64_t* table, int64_t keys, int64_t bs, int64_t hkv,
              int64_t h0, int64_t h1, std::vector<T>& ks, std::vector<T>& vs, std::vector<int64_t>& ident,
              bool bf16_dot) {
  const int64_t nb = (keys + bs - 1) / bs, row = D + kScaleBytes;
  if (static_cast<int64_t>(ks.size()) < nb * bs * hkv * D) {  // grown to the longest item, never shrunk
    ks.resize(static_cast<size_t>(nb * bs * hkv * D));
    vs.resize(ks.size());
  }
  if (static_cast<int64_t>(ident.size()) < nb) {
    const int64_t had = static_cast<int64_t>(ident.size());
    ident.resize(static_cast<size_t>(nb));
    for (int64_t b = had; b < nb; ++b) ident[b] = b;
  }
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (bf16_dot && stage_kv_bf16(kq, vq, table, keys, bs, hkv, D, h0, h1, ks.data(), vs.data())) return;
  }
  for (int64_t l = 0; l < keys; ++l) {
    const int64_t slot = table[l / bs] * bs + l % bs;
    if (l % bs == 0 && l + 2 * bs < keys) {  // two pages ahead: pages are scattered, no hardware stream
      const int64_t ahead = (table[l / bs + 2] * bs) * hkv * row;
      for (int64_t x = 0; x < bs * hkv * row; x += 64) {
        __builtin_prefetch(kq + ahead + x);
        __builtin_prefetch(vq + ahead + x);
      }
    }
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t src = (slot * hkv + h) * row, dst = (l * hkv + h) * D;
      float sk, sv;
      std::memcpy(&sk, kq + src + D, sizeof sk);
      std::memcpy(&sv, vq + src + D, sizeof sv);
      const Vf ck = set1(sk), cv = set1(sv);
      for (int64_t i = 0; i < D; i += W) {
        store(ks.data() + dst + i, mul(load(kq + src + i), ck));
        store(vs.data() + dst + i, mul(load(vq + src + i), cv));
      }
    }
  }
}

// Every row attends to the first ctx_len[row] keys of its sequence, read through its block table.
// Work items (row block x KV head; a one-row block on the bf16 path takes all heads) are split
// between the threads by cost (rows x context; share_of).
// bf16_dot: bf16 items go to attend_row_bf16 / attend_item_bf16 (AVX-512 BF16 dot products,
// attention_bf16.cpp) when they cover their shape.  kq/vq: an int8 cache (kc/vc unused), staged
// item by item (stage_kv above); null for a model-dtype cache.
template <typename T, int D>
void attend_rows(const T* q, int64_t q_stride, const T* kc, const T* vc, const int64_t* tables, int64_t max_blocks,
                 const int64_t* seq_of_row, const int64_t* ctx_len, T* out, int64_t out_stride, int64_t rows,
                 int64_t hq, int64_t hkv, int64_t bs, float scale, bool bf16_dot, const int8_t* kq = nullptr,
                 const int8_t* vq = nullptr) {
  const int64_t g = hq / hkv;
  // The bf16 kernel takes up to 128 query vectors an item: more rows a block read each key for.
  const int64_t block_rows = bf16_dot ? std::max<int64_t>(kRows, std::min<int64_t>(kRowsBf16, 128 / g)) : kRows;
  std::vector<int64_t> starts;
  for (int64_t t = 0; t < rows; ++t)
    if (t == 0 || seq_of_row[t] != seq_of_row[t - 1] || t - starts.back() == block_rows) starts.push_back(t);
  const int64_t nblk = static_cast<int64_t>(starts.size());
  starts.push_back(rows);
  // Items: (block, KV head), or (block, -1) for a one-row block on the bf16 path: that item takes
  // every head at once (attend_row_bf16 reads each key's whole cache row in one stream).
  std::vector<int64_t> item_b, item_h;
  std::vector<double> cum(1, 0.0);  // cum[w] = cost of the items before item w
  for (int64_t b = 0; b < nblk; ++b) {
    const int64_t nr = starts[b + 1] - starts[b];
    const double cost = static_cast<double>(nr * g) * (ctx_len[starts[b + 1] - 1] + 16);
    const bool whole = bf16_dot && nr == 1;
    for (int64_t h = whole ? -1 : 0; h < (whole ? 0 : hkv); ++h) {
      item_b.push_back(b);
      item_h.push_back(h);
      cum.push_back(cum.back() + (whole ? cost * hkv : cost));
    }
  }
  const int64_t items = static_cast<int64_t>(item_b.size());
  const int64_t nthreads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  at::parallel_for(0, nthreads, 1, [&](int64_t tb, int64_t te) {
    std::vector<float> buf;
    std::vector<int64_t> offs;
    // Kept between calls: fresh buffers of a few hundred KB fault their pages in at every layer.
    thread_local std::vector<int64_t> ident;
    thread_local std::vector<T> staged_k, staged_v;
    for (int64_t t = tb; t < te; ++t) {
      const std::vector<int64_t> mine = share_of(cum, t, nthreads);
      for (size_t i = 0; i < mine.size(); ++i) {
        const int64_t w = mine[i], b = item_b[w], r0 = starts[b], nr = starts[b + 1] - r0;
        const int64_t* table = tables + seq_of_row[r0] * max_blocks;
        const int64_t h0 = item_h[w] < 0 ? 0 : item_h[w], h1 = item_h[w] < 0 ? hkv : h0 + 1;  // heads it covers
        const T *kc_i = kc, *vc_i = vc;
        // A whole-row item streams on into the next one's first keys (this thread's next item).
        const bool next = i + 1 < mine.size() && item_h[mine[i + 1]] < 0;
        const int64_t nrow = next ? starts[item_b[mine[i + 1]]] : 0;
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          // A decode row of an int8 cache: read as int8 where the CPU has VNNI (no staging).
          if (kq != nullptr && item_h[w] < 0 && attention_int8_enabled() &&
              attend_row_int8(q, q_stride, kq, vq, table, ctx_len, out, out_stride, r0, g, hkv, bs, D, scale,
                              tables + seq_of_row[nrow] * max_blocks, next ? ctx_len[nrow] : 0))
            continue;
        }
        if (kq != nullptr) {  // rows of a block see at most the last row's keys
          stage_kv<T, D>(kq, vq, table, ctx_len[r0 + nr - 1], bs, hkv, h0, h1, staged_k, staged_v, ident, bf16_dot);
          kc_i = staged_k.data();
          vc_i = staged_v.data();
          table = ident.data();
        }
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          // Staged items stream in stage_kv instead: no run-on into the next item's cache rows.
          const bool run_on = next && kq == nullptr;
          if (item_h[w] < 0 && attend_row_bf16(q, q_stride, kc_i, vc_i, table, ctx_len, out, out_stride, r0, g, hkv,
                                               bs, D, scale, tables + seq_of_row[nrow] * max_blocks,
                                               run_on ? ctx_len[nrow] : 0))
            continue;
        }
        for (int64_t h = h0; h < h1; ++h) {
          if constexpr (std::is_same_v<T, c10::BFloat16>) {
            if (bf16_dot && attend_item_bf16(q, q_stride, kc_i, vc_i, table, ctx_len, out, out_stride, r0, nr, h, g,
                                             hkv, bs, D, scale))
              continue;
          }
          attend_item<T, D>(q, q_stride, kc_i, vc_i, table, ctx_len, out, out_stride, r0, nr, h, g, hkv, bs, scale, buf,
                            offs);
        }
      }
    }
  });
}

// out = (o1 * e^lse1 + o2 * e^lse2) / (e^lse1 + e^lse2): two softmax-normalised partial attentions
// over disjoint key sets (a chunk's own keys and its cached prefix) combined into the one over both.
// o1/o2 [n, H, D] with row strides; lse [H, n] with strides (lse_h, lse_t); out [n, H, D] rows.
template <typename T>
void merge_partials(const T* o1, int64_t o1_t, int64_t o1_h, const float* l1, int64_t l1_h, int64_t l1_t, const T* o2,
                    int64_t o2_t, int64_t o2_h, const float* l2, int64_t l2_h, int64_t l2_t, T* out, int64_t out_t,
                    int64_t n, int64_t nh, int64_t d) {
  at::parallel_for(0, n, 16, [&](int64_t tb, int64_t te) {
    for (int64_t t = tb; t < te; ++t)
      for (int64_t h = 0; h < nh; ++h) {
        const float a = l1[h * l1_h + t * l1_t], b = l2[h * l2_h + t * l2_t];
        const float m = a > b ? a : b;
        const float wa = std::exp(a - m), wb = std::exp(b - m);
        const float inv = 1.f / (wa + wb);
        const Vf ca = set1(wa * inv), cb = set1(wb * inv);
        const T* x = o1 + t * o1_t + h * o1_h;
        const T* y = o2 + t * o2_t + h * o2_h;
        T* z = out + t * out_t + h * d;
        for (int64_t i = 0; i < d; i += W) store(z + i, fmadd(load(x + i), ca, mul(load(y + i), cb)));
      }
  });
}
