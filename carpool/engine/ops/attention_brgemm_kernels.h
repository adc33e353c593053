// Attention as two GEMMs per tile of keys on ATen's batch-reduce GEMM micro-kernel
// (at::native::cpublas::brgemm, oneDNN's ukernel): AMX tiles where the CPU has them, AVX-512
// (BF16) or AVX2 elsewhere, the same code.  Written once against simd.h's vocabulary; attention.cpp
// has per_isa.h include it three times (the softmax between the GEMMs is each copy's own SIMD).
// No include guard on purpose; attention.cpp includes what it needs first.
//
// A chunk (rows [row0, row0 + n) of one sequence that has `cached` keys before them, so row r sees
// cached + r + 1 keys; a decode row is a chunk of one) is cut into work units of one KV head and a
// span of up to kSpanRows rows.  A unit packs its keys once, straight from the paged cache through
// the block table (no gathered copy of the context), into the GEMM's B layout, tile by tile:
// - K^T for S = Q K^T: [D / 2][kTileKeys][2] in bf16 (each key's pairs of head dims: the VNNI
//   layout of vdpbf16ps and of AMX's tiles), [D][kTileKeys] in fp32;
// - V for O = P V: [kTileKeys / 2][D][2] in bf16 (each two keys' values interleaved), [kTileKeys][D]
//   in fp32.
// Then per block of query vectors (rows x the KV head's query heads, padded to a fixed M so the
// micro-kernels are generated once) a flash-style pass over the tiles the block's rows can see:
// S = Q K^T (fp32), scaled, masked past each row's last key, a running max; P = exp(S - max)
// rounded to the model dtype (torch's flash attention does the same); O = O * e^(old max - new
// max) + P V with fp32 sums; at the end O / sum of P, rounded once.  Padding keys of the last tile
// repeat key 0 (finite values) and are masked, so their P is exactly 0.

constexpr int64_t kTileKeys = 64;   // keys of a tile: columns of S, rows of the V tile
constexpr int64_t kBlockQueries = 64;  // query vectors (rows x query heads) of a GEMM block, at most
constexpr int64_t kSpanRows = 256;  // rows a unit packs its keys for: packing is 1 / (rows x heads) of the GEMMs

// The B layout of the reduction axis: bf16 takes pairs (vdpbf16ps / AMX), fp32 single values.
template <typename T>
constexpr int64_t kPair = std::is_same_v<T, float> ? 1 : 2;

// A tile's keys (element offsets offs, the keys of a page `stride` elements apart) as B of
// S = Q K^T: [D / p][tile][p], i.e. a transpose of 32-bit words (a bf16 pair, or one fp32 value).
// W keys of one page at a time are one strided gather per word; a group that crosses a page (a
// block size under W) or reaches into the padding is copied word by word.
template <typename T>
inline void pack_key_tile(const T* kc, const int64_t* offs, int64_t d, int64_t stride, T* out) {
  constexpr int64_t p = kPair<T>;
  static_assert(sizeof(T) * p == sizeof(float), "a word of the key layout is 32 bits");
  const int64_t words = d / p;
  const float* cache = reinterpret_cast<const float*>(kc);  // the cache as words: gathers move bits unchanged
  float* o = reinterpret_cast<float*>(out);
  for (int64_t j = 0; j < kTileKeys; j += W) {
    if (offs[j + W - 1] == offs[j] + (W - 1) * stride) {
      const float* first = cache + offs[j] / p;
      for (int64_t i = 0; i < words; ++i) store(o + i * kTileKeys + j, gather(first + i, static_cast<int>(stride / p)));
      continue;
    }
    const uint32_t* bits = reinterpret_cast<const uint32_t*>(kc);
    uint32_t* to = reinterpret_cast<uint32_t*>(out);
    for (int64_t l = j; l < j + W; ++l)
      for (int64_t i = 0; i < words; ++i) to[i * kTileKeys + l] = bits[offs[l] / p + i];
  }
}

// The same keys' values as B of O = P V: [tile / p][D][p] (bf16: each two keys' values interleaved).
template <typename T>
inline void pack_value_tile(const T* vc, const int64_t* offs, int64_t d, T* out) {
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t j = 0; j < kTileKeys; ++j) std::memcpy(out + j * d, vc + offs[j], d * sizeof(float));
  } else {
    uint32_t* o = reinterpret_cast<uint32_t*>(out);
    for (int64_t j = 0; j < kTileKeys; j += 2) {
      const uint16_t* a = reinterpret_cast<const uint16_t*>(vc + offs[j]);
      const uint16_t* b = reinterpret_cast<const uint16_t*>(vc + offs[j + 1]);
      uint32_t* dst = o + (j / 2) * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<uint32_t>(a[i]) | (static_cast<uint32_t>(b[i]) << 16);
    }
  }
}

// e = exp(x - m) of one score vector, stored as the model dtype; returns e as stored (the P the
// second GEMM multiplies), so the normalising sum is the sum of what was multiplied.
template <typename T>
inline Vf exp_stored(Vf x, Vf m, T* p) {
  const Vf e = exp(sub(x, m));
  store(p, e);
  if constexpr (std::is_same_v<T, float>) return e;
  return load(p);
}

struct BrgemmScratch {
  std::vector<float> s, o, mx, sum;
  std::vector<int64_t> offs;
};

template <typename T>
struct BrgemmBuffers {
  std::vector<T> q, p, kt, vt;
};

// One unit: rows [r0, r1) of chunk (row0, cached) against KV head h (g query heads).
template <typename T>
void brgemm_unit(const T* q, int64_t q_stride, const T* kc, const T* vc, const int64_t* table, int64_t row0,
                 int64_t cached, int64_t r0, int64_t r1, int64_t h, int64_t g, int64_t hkv, int64_t bs, int64_t d,
                 float scale, T* out, int64_t out_stride, BrgemmScratch& sc, BrgemmBuffers<T>& bb) {
  using at::native::cpublas::brgemm;
  constexpr bool vnni = !std::is_same_v<T, float>;
  const int64_t keys = cached + r1, tiles = (keys + kTileKeys - 1) / kTileKeys;
  const int64_t block_rows = r1 - r0 == 1 ? 1 : std::max<int64_t>(1, kBlockQueries / g), m = block_rows * g;
  key_offsets(table, keys, tiles * kTileKeys, bs, hkv * d, h * d, sc.offs);
  bb.kt.resize(static_cast<size_t>(tiles * kTileKeys * d));
  bb.vt.resize(bb.kt.size());
  for (int64_t t = 0; t < tiles; ++t) {
    pack_key_tile(kc, sc.offs.data() + t * kTileKeys, d, hkv * d, bb.kt.data() + t * kTileKeys * d);
    pack_value_tile(vc, sc.offs.data() + t * kTileKeys, d, bb.vt.data() + t * kTileKeys * d);
  }
  bb.q.assign(static_cast<size_t>(m * d), T(0.f));
  bb.p.resize(static_cast<size_t>(m * kTileKeys));
  sc.s.resize(static_cast<size_t>(m * kTileKeys));
  sc.o.resize(static_cast<size_t>(m * d));
  sc.mx.resize(static_cast<size_t>(m));
  sc.sum.resize(static_cast<size_t>(m));
  const Vf vscale = set1(scale);
  for (int64_t b0 = r0; b0 < r1; b0 += block_rows) {
    const int64_t nb = std::min(block_rows, r1 - b0);
    for (int64_t r = 0; r < nb; ++r)  // padding rows stay 0: finite scores, never written out
      for (int64_t j = 0; j < g; ++j)
        std::memcpy(bb.q.data() + (r * g + j) * d, q + (row0 + b0 + r) * q_stride + (h * g + j) * d, d * sizeof(T));
    std::fill(sc.o.begin(), sc.o.end(), 0.f);
    std::fill(sc.mx.begin(), sc.mx.end(), -INFINITY);
    std::fill(sc.sum.begin(), sc.sum.end(), 0.f);
    const int64_t seen = cached + b0 + nb;  // keys the block's last row sees
    for (int64_t t = 0; t * kTileKeys < seen; ++t) {
      const int64_t k0 = t * kTileKeys;
      brgemm(m, kTileKeys, d, d, kTileKeys, kTileKeys, false, bb.q.data(), bb.kt.data() + k0 * d, sc.s.data(), vnni);
      for (int64_t x = 0; x < m; ++x) {
        const int64_t r = std::min(x / g, nb - 1);  // a padding row repeats the last real one
        const int64_t valid = std::min<int64_t>(kTileKeys, cached + b0 + r + 1 - k0);
        float* sx = sc.s.data() + x * kTileKeys;
        for (int64_t j = std::max<int64_t>(valid, 0); j < kTileKeys; ++j) sx[j] = -INFINITY;
        Vf vm = set1(-INFINITY);
        for (int64_t j = 0; j < kTileKeys; j += W) {
          const Vf v = mul(load(sx + j), vscale);
          store(sx + j, v);
          vm = max(vm, v);
        }
        const float old = sc.mx[x], now = std::max(old, reduce_max(vm));
        if (now == -INFINITY) {  // nothing seen yet (cannot happen past the first tile): P = 0
          std::fill(bb.p.begin() + x * kTileKeys, bb.p.begin() + (x + 1) * kTileKeys, T(0.f));
          continue;
        }
        const Vf vnow = set1(now);
        Vf acc = zero();
        for (int64_t j = 0; j < kTileKeys; j += W)
          acc = add(acc, exp_stored(load(sx + j), vnow, bb.p.data() + x * kTileKeys + j));
        const float alpha = old == -INFINITY ? 0.f : std::exp(old - now);
        sc.sum[x] = sc.sum[x] * alpha + reduce_add(acc);
        sc.mx[x] = now;
        if (alpha != 1.f) {
          float* ox = sc.o.data() + x * d;
          for (int64_t i = 0; i < d; i += W) store(ox + i, mul(load(ox + i), set1(alpha)));
        }
      }
      brgemm(m, d, kTileKeys, kTileKeys, d, d, true, bb.p.data(), bb.vt.data() + k0 * d, sc.o.data(), vnni);
    }
    for (int64_t r = 0; r < nb; ++r)
      for (int64_t j = 0; j < g; ++j) {
        const int64_t x = r * g + j;
        const Vf inv = set1(1.f / sc.sum[x]);
        T* dst = out + (row0 + b0 + r) * out_stride + (h * g + j) * d;
        for (int64_t i = 0; i < d; i += W) store(dst + i, mul(load(sc.o.data() + x * d + i), inv));
      }
  }
}

// Every chunk of `chunks` ([P, 5] int64 rows: row start, rows, sequence, cached keys, route; the
// rows whose route is 1) through brgemm_unit, the units shared between the threads by cost.
template <typename T>
void attend_chunks_brgemm(const T* q, int64_t q_stride, const T* kc, const T* vc, const int64_t* tables,
                          int64_t max_blocks, const int64_t* chunks, int64_t nchunks, T* out, int64_t out_stride,
                          int64_t hq, int64_t hkv, int64_t bs, int64_t d, float scale) {
  const int64_t g = hq / hkv;
  struct Unit {
    int64_t chunk, r0, r1, h;
  };
  std::vector<Unit> units;
  std::vector<double> cum(1, 0.0);
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t* ch = chunks + 5 * c;
    if (ch[4] != 1) continue;
    for (int64_t r0 = 0; r0 < ch[1]; r0 += kSpanRows) {
      const int64_t r1 = std::min(ch[1], r0 + kSpanRows);
      const double cost = static_cast<double>((r1 - r0) * g) * (ch[3] + (r0 + r1) / 2 + 16);
      for (int64_t h = 0; h < hkv; ++h) {
        units.push_back({c, r0, r1, h});
        cum.push_back(cum.back() + cost);
      }
    }
  }
  const int64_t n = static_cast<int64_t>(units.size());
  if (n == 0) return;
  const int64_t nthreads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  at::parallel_for(0, nthreads, 1, [&](int64_t tb, int64_t te) {
    thread_local BrgemmScratch sc;  // kept between calls: fresh buffers would fault their pages in at every layer
    thread_local BrgemmBuffers<T> bb;
    for (int64_t t = tb; t < te; ++t)
      for (int64_t w : share_of(cum, t, nthreads)) {
        const Unit& u = units[w];
        const int64_t* ch = chunks + 5 * u.chunk;
        brgemm_unit<T>(q, q_stride, kc, vc, tables + ch[2] * max_blocks, ch[0], ch[3], u.r0, u.r1, u.h, g, hkv, bs,
                       d, scale, out, out_stride, sc, bb);
      }
    at::native::cpublas::brgemm_release(!std::is_same_v<T, float>);  // AMX: give the tile state back
  });
}
