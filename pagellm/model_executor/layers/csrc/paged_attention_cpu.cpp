// Paged attention for CPU: the KV-cache layout, the cache writer and the decode kernel.
//
// Cache layout of one layer, with x = 4 / sizeof(T) elements per 32-bit word (2 for bf16/fp16, 1 for fp32):
//   k_cache [NB, Hkv, D/x, B, x]  one word row per pair of dims: dims (2j, 2j+1) of the block's B tokens
//   v_cache [NB, Hkv, B/x, D, x]  one word row per pair of tokens: tokens (2i, 2i+1) for all D dims
// With K "pair-major", q.k for 16 tokens is a chain of FMAs into one 16-lane accumulator (token i in lane i),
// so no per-token horizontal sum is needed; splitting a word into its two bf16 halves is a shift and a mask.
// With V "token-pair-major", one load feeds two tokens' weights into 16 output dims. Every (block, kv head)
// is one contiguous run of B*D elements for K and for V, which the hardware prefetcher streams well.
//
// decode: q [R, H, D] (one query per request, rows may be strided), block_tables [R, MB], seq_lens [R]
// (context length including the current token) -> out [R, H, D]. Work is split over (request, kv head);
// each task reads its keys and values once and serves the G = H / Hkv query heads sharing them (GQA).
// Scores and softmax are fp32; the weighted sum of V accumulates in fp32.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "vec.h"

namespace {
using namespace pagellm;

template <typename T>
constexpr int pack_x() { return sizeof(T) == 4 ? 1 : 2; }

// Softmax of s[0..n) in place (unnormalised exp); returns 1 / sum.
inline float softmax_inplace(float* s, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) m = std::max(m, s[i]);
  float sum = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(m), vsum = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), vm));
    _mm512_storeu_ps(s + i, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  sum = _mm512_reduce_add_ps(vsum);
#endif
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  return 1.f / sum;
}

// Scalar element access in the layout above (portable path and odd shapes).
template <typename T>
inline float k_at(const T* kb, int64_t B, int64_t t, int64_t d) {
  constexpr int x = pack_x<T>();
  return to_float(kb[(d / x) * B * x + t * x + d % x]);
}
template <typename T>
inline float v_at(const T* vb, int64_t D, int64_t t, int64_t d) {
  constexpr int x = pack_x<T>();
  return to_float(vb[(t / x) * D * x + d * x + t % x]);
}

#if defined(__AVX512F__)
// The two elements of each 32-bit word as fp32 (x == 2), or the word itself (x == 1).
inline void split(__m512i w, __m512& lo, __m512& hi, const c10::BFloat16*) {
  lo = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  hi = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void split(__m512i w, __m512& lo, __m512& hi, const c10::Half*) {
  lo = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(w));
  hi = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(w, 16)));
}

// Scores of up to 16 tokens (lanes in mask m, starting at token t0 of the block) for G query heads. Four
// independent accumulators per head (two dims x two word rows) hide the FMA latency.
template <int G, typename T>
inline void score_tile(const float* q, int64_t D, const T* kb, int64_t B, int64_t t0, __mmask16 m, float* s,
                       int64_t ns) {
  constexpr int x = pack_x<T>();
  const int32_t* w = reinterpret_cast<const int32_t*>(kb) + t0;
  __m512 acc[4][G];
  for (int a = 0; a < 4; ++a)
    for (int g = 0; g < G; ++g) acc[a][g] = _mm512_setzero_ps();
  for (int64_t j = 0; j < D / x; j += 2) {  // D / x is even for every supported head_dim
    for (int u = 0; u < 2; ++u) {
      __m512i word = _mm512_maskz_loadu_epi32(m, w + (j + u) * B);
      if constexpr (x == 2) {
        __m512 lo, hi;
        split(word, lo, hi, kb);
        for (int g = 0; g < G; ++g) {
          acc[2 * u][g] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * D + 2 * (j + u)]), lo, acc[2 * u][g]);
          acc[2 * u + 1][g] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * D + 2 * (j + u) + 1]), hi, acc[2 * u + 1][g]);
        }
      } else {
        const __m512 kv = _mm512_castsi512_ps(word);
        for (int g = 0; g < G; ++g) acc[2 * u][g] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * D + j + u]), kv, acc[2 * u][g]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m512 r = _mm512_add_ps(_mm512_add_ps(acc[0][g], acc[1][g]), _mm512_add_ps(acc[2][g], acc[3][g]));
    _mm512_mask_storeu_ps(s + g * ns + t0, m, r);
  }
}

// acc[g] += p[g][t] * v_t for one token pair (x == 2; which of the two tokens count is given) or token (x == 1).
template <int G, int C, typename T>
inline void pv_pair(const float* p, int64_t ns, const int32_t* row, bool first, bool second,
                    __m512 (&acc)[G][C]) {
  for (int c = 0; c < C; ++c) {
    __m512 a, b;
    split(_mm512_loadu_si512(row + 16 * c), a, b, static_cast<const T*>(nullptr));
    for (int g = 0; g < G; ++g) {
      if (first) acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * ns]), a, acc[g][c]);
      if (second) acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * ns + 1]), b, acc[g][c]);
    }
  }
}

// acc[g] += sum over tokens lo..hi-1 of the block of p[g][t] * v_t (C = D / 16 vectors per head).
template <int G, int C, typename T>
inline void pv_block(const float* p, int64_t ns, const T* vb, int64_t lo, int64_t hi, __m512 (&acc)[G][C]) {
  constexpr int x = pack_x<T>();
  constexpr int64_t D = 16 * C;
  const int32_t* w = reinterpret_cast<const int32_t*>(vb);
  if constexpr (x == 2) {
    // Tokens outside [lo, hi) are skipped, never multiplied by 0 (a stale NaN must not leak in).
    int64_t i = lo / 2;
    if (lo % 2) pv_pair<G, C, T>(p + 2 * i, ns, w + i * D, false, true, acc), ++i;
    for (; 2 * i + 1 < hi; ++i) pv_pair<G, C, T>(p + 2 * i, ns, w + i * D, true, true, acc);
    if (2 * i < hi) pv_pair<G, C, T>(p + 2 * i, ns, w + i * D, true, false, acc);
  } else {
    for (int64_t t = lo; t < hi; ++t)
      for (int c = 0; c < C; ++c) {
        const __m512 v = _mm512_castsi512_ps(_mm512_loadu_si512(w + t * D + 16 * c));
        for (int g = 0; g < G; ++g) acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * ns + t]), v, acc[g][c]);
      }
  }
}

inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(c + o, _MM_HINT_T0);
}
#endif

struct Task {
  const int64_t* blocks;  // this request's block table row
  int64_t start, L, B;    // attend to tokens [start, L); block size
  int64_t k_sb, k_sh, v_sb, v_sh;  // cache strides (block, head) in elements
  int64_t h;              // kv head
};

// Portable path (any head_dim, no AVX-512): one (request, kv head) for G query heads. qf [G][D] fp32
// pre-scaled; s is scratch of G * ns floats indexed by absolute token position; out [G][D] fp32.
template <typename T>
void attend_generic(int64_t G, int64_t D, const Task& tk, const float* qf, const T* kc, const T* vc, float* s,
                    int64_t ns, float* outf) {
  const int64_t B = tk.B;
  for (int64_t t = tk.start; t < tk.L; ++t) {
    const T* kb = kc + tk.blocks[t / B] * tk.k_sb + tk.h * tk.k_sh;
    for (int64_t g = 0; g < G; ++g) {
      float a = 0.f;
      for (int64_t d = 0; d < D; ++d) a += qf[g * D + d] * k_at(kb, B, t % B, d);
      s[g * ns + t] = a;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = softmax_inplace(s + g * ns + tk.start, tk.L - tk.start);
    float* o = outf + g * D;
    std::fill(o, o + D, 0.f);
    for (int64_t t = tk.start; t < tk.L; ++t) {
      const T* vb = vc + tk.blocks[t / B] * tk.v_sb + tk.h * tk.v_sh;
      const float p = s[g * ns + t];
      for (int64_t d = 0; d < D; ++d) o[d] += p * v_at(vb, D, t % B, d);
    }
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
  }
}

#if defined(__AVX512F__)
// The vectorised path for head_dim = 16 * C and a subgroup of G query heads (same arguments as above).
template <int G, int C, typename T>
void attend(const Task& tk, const float* qf, const T* kc, const T* vc, float* s, int64_t ns, float* outf) {
  constexpr int64_t D = 16 * C;
  const int64_t B = tk.B, b0 = tk.start / B, b1 = (tk.L - 1) / B;
  for (int64_t b = b0; b <= b1; ++b) {
    const T* kb = kc + tk.blocks[b] * tk.k_sb + tk.h * tk.k_sh;
    // Pull the next block's keys and this block's values towards the core while the FMAs run: the values are
    // then in cache for the second pass (a task's values are a few dozen KiB).
    if (b + 1 <= b1) prefetch(kc + tk.blocks[b + 1] * tk.k_sb + tk.h * tk.k_sh, B * D * sizeof(T));
    prefetch(vc + tk.blocks[b] * tk.v_sb + tk.h * tk.v_sh, B * D * sizeof(T));
    for (int64_t t0 = 0; t0 < B; t0 += 16) {
      const int64_t w = std::min<int64_t>(16, B - t0);
      score_tile<G, T>(qf, D, kb, B, t0, static_cast<__mmask16>((1u << w) - 1), s + b * B, ns);
    }
  }
  float inv[G];
  for (int g = 0; g < G; ++g) inv[g] = softmax_inplace(s + g * ns + tk.start, tk.L - tk.start);
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t b = b0; b <= b1; ++b) {
    const T* vb = vc + tk.blocks[b] * tk.v_sb + tk.h * tk.v_sh;
    const int64_t lo = std::max<int64_t>(0, tk.start - b * B), hi = std::min<int64_t>(B, tk.L - b * B);
    pv_block<G, C, T>(s + b * B, ns, vb, lo, hi, acc);
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c)
      _mm512_storeu_ps(outf + g * D + 16 * c, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv[g])));
}

template <int C, typename T>
void attend_g(int G, const Task& tk, const float* qf, const T* kc, const T* vc, float* s, int64_t ns, float* o) {
  switch (G) {
#define PAGELLM_G(GG) case GG: return attend<GG, C, T>(tk, qf, kc, vc, s, ns, o);
    PAGELLM_G(1) PAGELLM_G(2) PAGELLM_G(3) PAGELLM_G(4) PAGELLM_G(5) PAGELLM_G(6) PAGELLM_G(7) PAGELLM_G(8)
#undef PAGELLM_G
    default: TORCH_CHECK(false, "unsupported head group ", G);
  }
}
#endif

// true when the vectorised kernel covers this head_dim (else the portable path runs)
inline bool vectorised(int64_t D) {
#if defined(__AVX512F__)
  return D == 32 || D == 64 || D == 96 || D == 128 || D == 256;
#else
  return false;
#endif
}

template <typename T>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& out, double scale,
            int64_t window) {
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(1), B = v_cache.size(2) * v_cache.size(4), MB = block_tables.size(1);
  const int64_t G = H / Hkv, C = D / 16;
  const bool vec = vectorised(D);
  // Query heads per pass: the accumulators of a subgroup (sub * C vectors) must stay in registers.
  const int64_t sub = vec ? std::min<int64_t>({G, 8, std::max<int64_t>(1, 24 / C)}) : G;
  const T* qp = q.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, R * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(sub * D), of(sub * D), s;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / Hkv, h = task % Hkv, L = sl[r];
      if (L <= 0) continue;
      const int64_t start = window > 0 ? std::max<int64_t>(0, L - window) : 0;
      const Task tk{bt + r * MB, start, L, B, k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
                    v_cache.stride(1), h};
      const int64_t ns = ((L - 1) / B + 1) * B;
      s.resize(sub * ns);
      for (int64_t g0 = 0; g0 < G; g0 += sub) {
        const int64_t gs = std::min(sub, G - g0);
        for (int64_t g = 0; g < gs; ++g) {
          const T* qr = qp + r * q.stride(0) + (h * G + g0 + g) * q.stride(1);
          for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_float(qr[d]) * fscale;
        }
#if defined(__AVX512F__)
        switch (vec ? C : 0) {
          case 2: attend_g<2, T>(gs, tk, qf.data(), kc, vc, s.data(), ns, of.data()); break;
          case 4: attend_g<4, T>(gs, tk, qf.data(), kc, vc, s.data(), ns, of.data()); break;
          case 6: attend_g<6, T>(gs, tk, qf.data(), kc, vc, s.data(), ns, of.data()); break;
          case 8: attend_g<8, T>(gs, tk, qf.data(), kc, vc, s.data(), ns, of.data()); break;
          case 16: attend_g<16, T>(gs, tk, qf.data(), kc, vc, s.data(), ns, of.data()); break;
          default: attend_generic<T>(gs, D, tk, qf.data(), kc, vc, s.data(), ns, of.data());
        }
#else
        attend_generic<T>(gs, D, tk, qf.data(), kc, vc, s.data(), ns, of.data());
#endif
        for (int64_t g = 0; g < gs; ++g) {
          T* o = op + r * out.stride(0) + (h * G + g0 + g) * out.stride(1);
          for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(of[g * D + d]);
        }
      }
    }
  });
}

// Scatter this step's K/V rows into their slots (slot = block * B + offset; negative slots are skipped).
template <typename T>
void write_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                 const at::Tensor& slots) {
  constexpr int x = pack_x<T>();
  const int64_t N = k.size(0), Hkv = k.size(1), D = k.size(2), B = v_cache.size(2) * x;
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = sp[t];
      if (slot < 0) continue;
      const int64_t blk = slot / B, off = slot % B;
      for (int64_t h = 0; h < Hkv; ++h) {
        const T* ks = kp + t * k.stride(0) + h * k.stride(1);
        const T* vs = vp + t * v.stride(0) + h * v.stride(1);
        T* kd = kc + blk * k_cache.stride(0) + h * k_cache.stride(1) + off * x;
        T* vd = vc + blk * v_cache.stride(0) + h * v_cache.stride(1) + (off / x) * D * x + off % x;
        for (int64_t j = 0; j < D / x; ++j)
          for (int e = 0; e < x; ++e) kd[j * B * x + e] = ks[j * x + e];
        for (int64_t d = 0; d < D; ++d) vd[d * x] = vs[d];
      }
    }
  });
}

void check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t D) {
  TORCH_CHECK(k_cache.dim() == 5 && v_cache.dim() == 5, "caches must be 5-d [NB, Hkv, ., ., x]");
  const int64_t x = k_cache.size(4), B = v_cache.size(2) * x;
  TORCH_CHECK(x * k_cache.element_size() == 4 && v_cache.size(4) == x, "x must pack 4 bytes");
  TORCH_CHECK(k_cache.size(2) * x == D && k_cache.size(3) == B && v_cache.size(3) == D, "cache / head_dim mismatch");
  TORCH_CHECK(k_cache.stride(4) == 1 && k_cache.stride(3) == x && k_cache.stride(2) == B * x &&
              v_cache.stride(4) == 1 && v_cache.stride(3) == x && v_cache.stride(2) == D * x,
              "each (block, head) of the cache must be contiguous");
  TORCH_CHECK(B % 2 == 0 && B <= 16 * 1024, "block size must be even");
}

}  // namespace

void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor out,
                            double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && out.stride(2) == 1, "q/out: [R, H, D], last dim contiguous");
  check_cache(k_cache, v_cache, q.size(2));
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && out.scalar_type() == q.scalar_type(), "dtype mismatch");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 indices");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous(), "contiguous indices");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "heads must be a multiple of kv heads");
  pagellm::dispatch_float(q.scalar_type(), "paged_decode_attention", [&](auto tag) {
    decode<decltype(tag)>(q, k_cache, v_cache, block_tables, seq_lens, out, scale, window);
  });
}

void write_kv_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                    const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1, "k/v: [N, Hkv, D]");
  check_cache(k_cache, v_cache, k.size(2));
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k.scalar_type(), "dtype mismatch");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.numel() == k.size(0), "slot_mapping: int64 [N]");
  pagellm::dispatch_float(k.scalar_type(), "write_kv_cache", [&](auto tag) {
    write_cache<decltype(tag)>(k, v, k_cache, v_cache, slot_mapping);
  });
}

// Registered as torch.ops.pagellm.* (no pybind11: the build stays small and fast).
TORCH_LIBRARY(pagellm, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor(a!) out, float scale, int window) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
  m.def("write_kv_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.impl("write_kv_cache", c10::DispatchKey::CPU, &write_kv_cache);
}
