// Row-wise kernels of the decoder layer (residual add + RMSNorm, SiLU * up, RoPE), written once
// against simd.h's vocabulary and included by layers.cpp once per instruction set (see
// attention_kernels.h).  Each replaces a chain of small torch ops (each of which wakes the thread
// pool and streams the activations through memory again) with one parallel pass.
//
// The math is fp32 and rounds to T where Hugging Face's Llama rounds (after every torch op in the
// model dtype), so bf16 results match transformers' instead of being merely close.

// Rows per thread chunk for rows of n values: a pass over at most g_row_grain_values values runs on
// the calling thread alone (at::parallel_for then never wakes the pool), a larger one splits
// between the threads.  Where the split starts paying depends on the machine: waking a passive
// thread cost ~25 us on a 2-core Zen 4 and ~4 us on a Zen 5, so at 64 rows residual add + RMSNorm
// ran 83 us on 2 threads vs 24 on 1 on the first and 16 vs 11.6 on the second.  The engine plan
// times both ways on the model's widths at its first start and sets the limits (set_row_grains);
// layers.cpp holds them.
inline int64_t row_grain(int64_t n) {
  return std::max<int64_t>(8, g_row_grain_values.load(std::memory_order_relaxed) / std::max<int64_t>(n, 1));
}

// SiLU * up (an exp and a division a value) costs several light passes, so it has its own limit.
inline int64_t silu_row_grain(int64_t n) {
  return std::max<int64_t>(8, g_silu_grain_values.load(std::memory_order_relaxed) / std::max<int64_t>(n, 1));
}

// x rounded to T and back: what torch stores after one op in dtype T.  In registers: going
// through a stack buffer (store, load) made the int8 SiLU * up, which rounds four times a
// vector, ~1.7x slower than this.
template <typename T>
inline Vf round_as(Vf x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return round_bf16(x);
  } else {
    static_assert(std::is_same_v<T, c10::Half>, "round_as: float, bf16 or fp16");
    return round_half(x);
  }
}

template <typename T>
inline float round_as_scalar(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// v rounded to T, stored in O: T itself, or fp32 holding T's values (a row about to be quantized,
// read back without widening bf16 again: measured, a bf16 buffer made SiLU * up + quantize 46 -> 49 us).
template <typename T, typename O>
inline void store_as(O* p, Vf v) {
  if constexpr (std::is_same_v<O, T>) {
    store(p, v);
  } else {
    store(p, round_as<T>(v));
  }
}

// One row: xi [n] (+= ri in place when ri is given, rounded to T as torch's add); oi = w * T(xi /
// rms(xi)) (in O: see store_as).
template <typename T, typename O = T>
inline void add_rms_norm_row(T* xi, const T* ri, const T* w, O* oi, int64_t n, float eps) {
  const int64_t nv = n / W * W;
  Vf ss = zero();
  float ss_tail = 0.f;
  if (ri) {
    for (int64_t k = 0; k < nv; k += W) {
      const Vf v = round_as<T>(add(load(xi + k), load(ri + k)));
      store(xi + k, v);
      ss = fmadd(v, v, ss);
    }
    for (int64_t k = nv; k < n; ++k) {
      const float v = round_as_scalar<T>(static_cast<float>(xi[k]) + static_cast<float>(ri[k]));
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
  for (int64_t k = 0; k < nv; k += W) store_as<T>(oi + k, mul(load(w + k), round_as<T>(mul(load(xi + k), iv))));
  for (int64_t k = nv; k < n; ++k)
    oi[k] = static_cast<O>(round_as_scalar<T>(static_cast<float>(w[k]) * round_as_scalar<T>(static_cast<float>(xi[k]) * inv)));
}

// x [rows, n] (x += r in place when r is given, rounded to T as torch's add); out = w * T(x / rms(x)).
template <typename T>
void add_rms_norm(T* x, const T* r, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) add_rms_norm_row(x + i * n, r ? r + i * n : nullptr, w, out + i * n, n, eps);
  });
}

// One row: g, u [n] -> o = T(T(silu(g)) * u) (in O: see store_as).
template <typename T, typename O = T>
inline void silu_mul_row(const T* g, const T* u, O* o, int64_t n) {
  const int64_t nv = n / W * W;
  for (int64_t k = 0; k < nv; k += W) {
    const Vf a = load(g + k);
    const Vf s = round_as<T>(div(a, add(set1(1.f), exp(sub(zero(), a)))));
    store_as<T>(o + k, mul(s, load(u + k)));
  }
  for (int64_t k = nv; k < n; ++k) {
    const float a = static_cast<float>(g[k]);
    o[k] = static_cast<O>(round_as_scalar<T>(round_as_scalar<T>(a / (1.f + std::exp(-a))) * static_cast<float>(u[k])));
  }
}

// gu [rows, 2n] = [gate | up] -> T(T(silu(gate)) * up) [rows, n]
template <typename T>
void silu_mul(const T* gu, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, silu_row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) silu_mul_row(gu + i * 2 * n, gu + i * 2 * n + n, out + i * n, n);
  });
}

// In place on the first `heads` heads of one row x of qkv (q then k heads; v is untouched):
// rotate-half RoPE, x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, each product rounded to T as
// HF's `q * cos + rotate_half(q) * sin` in the model dtype.  c/s: the position's cos/sin [D/2] in T.
template <typename T>
inline void rope_row(T* row, const T* c, const T* s, int64_t heads, int64_t d) {
  const int64_t half = d / 2, nv = half / W * W;
  for (int64_t h = 0; h < heads; ++h) {
    T* x = row + h * d;
    for (int64_t i = 0; i < nv; i += W) {
      const Vf x1 = load(x + i), x2 = load(x + half + i), cv = load(c + i), sv = load(s + i);
      const Vf a = sub(round_as<T>(mul(x1, cv)), round_as<T>(mul(x2, sv)));
      const Vf b = add(round_as<T>(mul(x2, cv)), round_as<T>(mul(x1, sv)));
      store(x + i, a);
      store(x + half + i, b);
    }
    for (int64_t i = nv; i < half; ++i) {
      const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[half + i]);
      const float cv = static_cast<float>(c[i]), sv = static_cast<float>(s[i]);
      x[i] = static_cast<T>(round_as_scalar<T>(x1 * cv) - round_as_scalar<T>(x2 * sv));
      x[half + i] = static_cast<T>(round_as_scalar<T>(x2 * cv) + round_as_scalar<T>(x1 * sv));
    }
  }
}

// rope_row on every row of qkv [tokens, stride]; cos/sin [max_pos, D/2] in T.
template <typename T>
void rope(T* qkv, int64_t stride, const int64_t* pos, const T* cos, const T* sin, int64_t tokens, int64_t heads,
          int64_t d) {
  const int64_t half = d / 2;
  at::parallel_for(0, tokens, row_grain(heads * d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rope_row(qkv + t * stride, cos + pos[t] * half, sin + pos[t] * half, heads, d);
  });
}

// Each row of x [rows, n]: the columns of its k largest values, largest first, into out [rows, k]
// (ties: the lower column first; NaN and -inf never rank; a row with fewer than k finite values
// repeats its best column).  One pass: a value is compared with the k-th best so far, a vector
// at a time, and only the few that beat it are inserted into the row's short sorted list.  The
// int8 head's candidates (model.py _head); torch.topk took 1.8 ms on 64 x 49152 bf16 logits,
// the int8 head's whole saving.
template <typename T>
void top_k_rows(const T* x, int64_t* out, int64_t rows, int64_t n, int64_t k) {
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    std::vector<float> val(k);
    std::vector<int64_t> col(k);
    for (int64_t i = begin; i < end; ++i) {
      const T* r = x + i * n;
      int64_t filled = 0;
      float thr = -INFINITY;  // the k-th best so far once k are in, else -inf (anything finite enters)
      auto offer = [&](float v, int64_t j) {
        if (!(v > thr)) return;
        int64_t p = filled < k ? filled++ : k - 1;  // full: the smallest drops out
        while (p > 0 && val[p - 1] < v) {
          val[p] = val[p - 1];
          col[p] = col[p - 1];
          --p;
        }
        val[p] = v;
        col[p] = j;
        if (filled == k) thr = val[k - 1];
      };
      const int64_t nv = n / W * W;
      for (int64_t j = 0; j < nv; j += W) {
        for (unsigned m = gt_mask(load(r + j), set1(thr)); m != 0; m &= m - 1)
          offer(static_cast<float>(r[j + __builtin_ctz(m)]), j + __builtin_ctz(m));
      }
      for (int64_t j = nv; j < n; ++j) offer(static_cast<float>(r[j]), j);
      for (int64_t p = 0; p < k; ++p) out[i * k + p] = p < filled ? col[p] : (filled ? col[0] : 0);
    }
  });
}
