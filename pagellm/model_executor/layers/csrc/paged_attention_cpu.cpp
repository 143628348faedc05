// Paged decode attention for CPU: one query token per request, K/V read in place from the block pool.
//
// q            [R, H, D]            (any float dtype; rows may be strided)
// k/v cache    [NB, B, Hkv, D]      (same dtype as q)
// block_tables [R, MB] int64,  seq_lens [R] int64  (context length including the current token)
// out          [R, H, D]
//
// Work is split over (request, kv head) pairs; each pair reads its keys/values exactly once and serves the G
// query heads that share that kv head (GQA). Two passes over the context: scores (q.k, fp32), softmax, then
// the weighted sum of values. No gathered copy of the cache is ever made.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline float to_float(float x) { return x; }
inline float to_float(double x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline void row_to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

#if defined(__AVX512F__)
// 16 lanes of fp32 from any supported storage type.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const double* p) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(_mm512_loadu_pd(p))),
                            _mm512_cvtpd_ps(_mm512_loadu_pd(p + 8)), 1);
}

// exp(x) for x <= 0 (softmax after subtracting the max): range reduction to 2^n * exp(r), |r| <= ln2/2,
// degree-6 polynomial; relative error ~1e-7, like the vectorised exp of other CPU attention kernels.
inline __m512 exp16(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
  r = _mm512_fnmadd_ps(n, ln2_lo, r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
#endif

// scores[i] = q . k_i for the n tokens of one kv head, then softmax in place; returns 1 / sum.
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

#if defined(__AVX512F__)
// C = head_dim / 16 is a compile-time constant so the accumulators stay in registers.
// Pass 1 for one query head: s[i] = q . k_i over the tokens given by ptr(i).
template <int C, typename T, typename Ptr>
inline void scores_avx512(const float* qg, Ptr ptr, int64_t n, float* s) {
  __m512 qv[C];
  for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(qg + 16 * c);
  for (int64_t i = 0; i < n; ++i) {
    const T* kr = ptr(i);
    __m512 a = _mm512_mul_ps(qv[0], load16(kr));
    for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(qv[c], load16(kr + 16 * c), a);
    s[i] = _mm512_reduce_add_ps(a);
  }
}

// Pass 2 for one query head: acc = sum_i p[i] v_i.
template <int C, typename T, typename Ptr>
inline void weighted_sum_avx512(const float* p, Ptr ptr, int64_t n, float* acc) {
  __m512 a[C];
  for (int c = 0; c < C; ++c) a[c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const T* vr = ptr(i);
    const __m512 w = _mm512_set1_ps(p[i]);
    for (int c = 0; c < C; ++c) a[c] = _mm512_fmadd_ps(w, load16(vr + 16 * c), a[c]);
  }
  for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + 16 * c, a[c]);
}

template <typename T, typename Ptr>
inline bool head_avx512(int64_t D, const float* qg, const float* p, Ptr ptr, int64_t n, float* s, float* acc,
                        bool pass1) {
  switch (D) {
#define PAGELLM_CASE(CC)                                                  \
    case 16 * CC:                                                         \
      if (pass1) scores_avx512<CC, T>(qg, ptr, n, s);                     \
      else weighted_sum_avx512<CC, T>(p, ptr, n, acc);                    \
      return true;
    PAGELLM_CASE(1) PAGELLM_CASE(2) PAGELLM_CASE(4) PAGELLM_CASE(8) PAGELLM_CASE(16)
#undef PAGELLM_CASE
    default:
      return false;
  }
}
#endif

#if defined(__AVX512F__)
// All G query heads of one kv head at once (GQA): each K/V row is loaded and converted once and serves the G
// heads, with G*C accumulators held in registers. G and C are compile-time so nothing spills.
template <int C, int G, typename T>
inline void group_avx512(const float* qf, const int64_t* offs, const T* kp, const T* vp, int64_t n, float* scores,
                         float* acc, float* inv_sum) {
  __m512 q[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) q[g][c] = _mm512_loadu_ps(qf + (g * C + c) * 16);
  for (int64_t i = 0; i < n; ++i) {
    const T* kr = kp + offs[i];
    __m512 k[C];
    for (int c = 0; c < C; ++c) k[c] = load16(kr + 16 * c);
    for (int g = 0; g < G; ++g) {
      __m512 a = _mm512_mul_ps(q[g][0], k[0]);
      for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(q[g][c], k[c], a);
      scores[g * n + i] = _mm512_reduce_add_ps(a);
    }
  }
  for (int g = 0; g < G; ++g) inv_sum[g] = softmax_inplace(scores + g * n, n);
  __m512 a[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) a[g][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const T* vr = vp + offs[i];
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = load16(vr + 16 * c);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(scores[g * n + i]);
      for (int c = 0; c < C; ++c) a[g][c] = _mm512_fmadd_ps(w, v[c], a[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + (g * C + c) * 16, a[g][c]);
}

template <int C, typename T>
inline bool group_dispatch_g(int64_t G, const float* qf, const int64_t* offs, const T* kp, const T* vp, int64_t n,
                             float* scores, float* acc, float* inv_sum) {
  switch (G) {
#define PAGELLM_G(GG) \
    case GG: group_avx512<C, GG, T>(qf, offs, kp, vp, n, scores, acc, inv_sum); return true;
    PAGELLM_G(1) PAGELLM_G(2) PAGELLM_G(3) PAGELLM_G(4) PAGELLM_G(5) PAGELLM_G(6) PAGELLM_G(7) PAGELLM_G(8)
#undef PAGELLM_G
    default: return false;
  }
}

// Returns false when (head_dim, group size) has no specialisation; the caller then goes head by head.
template <typename T>
inline bool group_dispatch(int64_t D, int64_t G, const float* qf, const int64_t* offs, const T* kp, const T* vp,
                           int64_t n, float* scores, float* acc, float* inv_sum) {
  switch (D) {
    case 32: return group_dispatch_g<2, T>(G, qf, offs, kp, vp, n, scores, acc, inv_sum);
    case 64: return group_dispatch_g<4, T>(G, qf, offs, kp, vp, n, scores, acc, inv_sum);
    case 128: return group_dispatch_g<8, T>(G, qf, offs, kp, vp, n, scores, acc, inv_sum);
    default: return false;
  }
}
#endif

template <typename T>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& out, double scale,
            int64_t window) {
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t B = k_cache.size(1), Hkv = k_cache.size(2), MB = block_tables.size(1);
  const int64_t G = H / Hkv;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  const int64_t q_sr = q.stride(0), q_sh = q.stride(1);
  const int64_t o_sr = out.stride(0), o_sh = out.stride(1);
  const int64_t c_sb = k_cache.stride(0), c_st = k_cache.stride(1), c_sh = k_cache.stride(2);
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, R * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), row(D), scores;
    std::vector<float> inv_sum(G);
    std::vector<int64_t> offs;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / Hkv, h = task % Hkv;
      const int64_t L = sl[r];
      const int64_t start = window > 0 ? std::max<int64_t>(0, L - window) : 0;
      const int64_t n = L - start;
      scores.resize(G * n);
      for (int64_t g = 0; g < G; ++g) {
        row_to_float(qp + r * q_sr + (h * G + g) * q_sh, qf.data() + g * D, D);
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] *= fscale;
      }
      // Offsets of this kv head's rows for every context token, walked block by block (no division per token).
      offs.resize(n);
      for (int64_t i = 0, pos = start; i < n;) {
        const int64_t base = bt[r * MB + pos / B] * c_sb + h * c_sh;
        for (int64_t t = pos % B; t < B && i < n; ++t, ++i, ++pos) offs[i] = base + t * c_st;
      }
      auto k_at = [&](int64_t i) { return kp + offs[i]; };
      auto v_at = [&](int64_t i) { return vp + offs[i]; };
      bool grouped = false;
#if defined(__AVX512F__)
      grouped = group_dispatch<T>(D, G, qf.data(), offs.data(), kp, vp, n, scores.data(), acc.data(),
                                  inv_sum.data());
#endif
      for (int64_t g = 0; g < G && !grouped; ++g) {
        const float* qg = qf.data() + g * D;
        float* sg = scores.data() + g * n;
        bool done = false;
#if defined(__AVX512F__)
        done = head_avx512<T>(D, qg, nullptr, k_at, n, sg, nullptr, true);
#endif
        if (!done) {  // Pass 1 (portable): scores = q_g . k_i
          for (int64_t i = 0; i < n; ++i) {
            row_to_float(k_at(i), row.data(), D);
            float s = 0.f;
            for (int64_t d = 0; d < D; ++d) s += qg[d] * row[d];
            sg[i] = s;
          }
        }
        inv_sum[g] = softmax_inplace(sg, n);
        float* ag = acc.data() + g * D;
        done = false;
#if defined(__AVX512F__)
        done = head_avx512<T>(D, nullptr, sg, v_at, n, nullptr, ag, false);
#endif
        if (!done) {  // Pass 2 (portable): acc_g = sum_i p_gi v_i
          std::fill(ag, ag + D, 0.f);
          for (int64_t i = 0; i < n; ++i) {
            row_to_float(v_at(i), row.data(), D);
            for (int64_t d = 0; d < D; ++d) ag[d] += sg[i] * row[d];
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        T* o = op + r * o_sr + (h * G + g) * o_sh;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[g * D + d] * inv_sum[g]);
      }
    }
  });
}

}  // namespace

void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor out,
                            double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1, "last dim must be contiguous");
  TORCH_CHECK(k_cache.strides() == v_cache.strides(), "k and v caches must share strides");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 indices");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous(), "contiguous indices");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "heads must be a multiple of kv heads");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode<scalar_t>(q, k_cache, v_cache, block_tables, seq_lens, out, scale, window);
  });
}

// Registered as torch.ops.pagellm.paged_decode_attention (no pybind11: the build stays small and fast).
TORCH_LIBRARY(pagellm, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor(a!) out, float scale, int window) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
}
