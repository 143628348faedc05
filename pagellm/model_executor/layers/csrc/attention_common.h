// Building blocks of the CPU paged-attention kernel: the cache layout's element access, the 16-token score
// tile, the weighted sum of a block's values, softmax. See paged_attention_cpu.cpp for the layout.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "vec.h"
#include "vec8.h"

namespace pagellm {

// Elements per 32-bit word of the cache: 4 for fp8, 2 for bf16/fp16, 1 for fp32.
template <typename T>
constexpr int pack_x() { return 4 / static_cast<int>(sizeof(T)); }

// Element access in the layout (portable path and odd shapes): kb / vb point at one (block, kv head).
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

// s[lo..hi) = exp(s - m) in place; returns their sum.
inline float exp_sum(float* s, int64_t lo, int64_t hi, float m) {
  float sum = 0.f;
  int64_t i = lo;
#if defined(__AVX512F__)
  const __m512 vm = _mm512_set1_ps(m);
  __m512 vsum = _mm512_setzero_ps();
  for (; i + 16 <= hi; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), vm));
    _mm512_storeu_ps(s + i, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  if (i < hi) {  // the last < 16 in masked lanes (a scalar expf call each held ~30% of the softmax's time)
    const __mmask16 k = static_cast<__mmask16>((1u << (hi - i)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), vm));
    _mm512_mask_storeu_ps(s + i, k, e);
    vsum = _mm512_mask_add_ps(vsum, k, vsum, e);
    i = hi;
  }
  sum = _mm512_reduce_add_ps(vsum);
#elif defined(PAGELLM_HAS_AVX2)
  const __m256 vm = _mm256_set1_ps(m);
  __m256 vsum = _mm256_setzero_ps();
  for (; i + 8 <= hi; i += 8) {
    const __m256 e = v8::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm));  // <= 0: in exp8's range
    _mm256_storeu_ps(s + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  alignas(32) float part[8];
  _mm256_store_ps(part, vsum);
  for (float x : part) sum += x;
#endif
  for (; i < hi; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  return sum;
}

// p[lo..hi) = exp(s - max) / sum, in place (normalised probabilities); *lse, if asked for, the log-sum-exp of the
// scores (a scalar log a row: ~0.4% of workload_64's time where nothing reads it).
inline void softmax_range(float* s, int64_t lo, int64_t hi, float* lse = nullptr) {
  const float m = max_of(s + lo, hi - lo), sum = exp_sum(s, lo, hi, m);
  const float inv = 1.f / sum;
  for (int64_t i = lo; i < hi; ++i) s[i] *= inv;
  if (lse) *lse = m + std::log(sum);
}

#if defined(__AVX512F__)
// exp(x) for x <= 0 to ~3e-6 relative (exp16's ~1e-7 takes five more instructions), for values rounded to bf16
// (2^-9) next: ln 2 in one step, a degree-4 polynomial (a minimax fit of exp's relative error on [-ln2/2, ln2/2]).
inline __m512 exp16_coarse(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147180559945f), x);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.0414586067f), r, _mm512_set1_ps(0.167909071f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.500043571f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.999963403f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.999999285f));
  return _mm512_scalef_ps(p, n);
}
#endif

// exp(s - max) on [lo, hi) of one row, each rounded to bf16 (nearest even, denormals to 0: what VDPBF16PS reads)
// into h[t] for token t; returns the sum of the unrounded values, by which the caller divides the weighted sums
// (as flash attention does, and SDPA's CPU kernel, whose bf16 weights are unnormalised too). One sweep after the
// maximum's: normalising and rounding took a third and a fourth (and a store of the rounded values as fp32).
// *lse as softmax_range's.
inline float exp_range_bf16(const float* s, uint16_t* h, int64_t lo, int64_t hi, float* lse = nullptr) {
#if defined(__AVX512BF16__)
  const float m = max_of(s + lo, hi - lo);
  const __m512 vm = _mm512_set1_ps(m);
  __m512 vsum = _mm512_setzero_ps();
  int64_t i = lo;
  for (; i + 16 <= hi; i += 16) {
    const __m512 e = exp16_coarse(_mm512_sub_ps(_mm512_loadu_ps(s + i), vm));
    vsum = _mm512_add_ps(vsum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + i), (__m256i)_mm512_cvtneps_pbh(e));
  }
  if (i < hi) {
    const __mmask16 k = static_cast<__mmask16>((1u << (hi - i)) - 1);
    const __m512 e = exp16_coarse(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), vm));
    vsum = _mm512_mask_add_ps(vsum, k, vsum, e);
    _mm256_mask_storeu_epi16(h + i, k, (__m256i)_mm512_cvtneps_pbh(e));
  }
  const float sum = _mm512_reduce_add_ps(vsum);
  if (lse) *lse = m + std::log(sum);
  return sum;
#else
  (void)s, (void)h, (void)lo, (void)hi, (void)lse;  // never called: kDot needs AVX512-BF16
  return 1.f;
#endif
}

#if defined(__AVX512F__)
// The two elements of each 32-bit word as fp32 (bf16: a shift and a mask; fp16: two conversions).
PAGELLM_INLINE void split(__m512i w, __m512& lo, __m512& hi, const c10::BFloat16*) {
  lo = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  hi = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void split(__m512i w, __m512& lo, __m512& hi, const c10::Half*) {
  lo = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(w));
  hi = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(w, 16)));
}

// acc + the two products of lanes' bf16 pairs in word with the pair whose bits lie at q (score_tile's kDot).
PAGELLM_INLINE __m512 dot_pair(__m512 acc, const float* q, __m512i word) {
#if defined(__AVX512BF16__)
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(q)), (__m512bh)word);
#else
  (void)q, (void)word;
  return acc;  // never called: kDot needs AVX512-BF16 (paged_attention_cpu.cpp: Args::dot)
#endif
}

// Scores of up to 16 tokens (lanes in mask m, from token t0 of the block) for NV query vectors q [NV][D]:
// s[v * ns + t0 + lane]. Four accumulators per vector (independent FMA chains hide the latency) whatever NV is:
// a vector's score must not depend on how many others share its pass, or a prompt's rows would get other bits
// when the scheduler cuts it into other chunks (a chunk's last rows land in a smaller group). With two for
// groups of more than 4, SmolLM2's greedy tokens on a 300-token prompt changed with the token budget (2026-12-04,
// an AVX-512 CPU without AMX or AVX512-FP16, where this kernel also runs prefill chunks).
// pk, pv (optional): cache lines to prefetch alongside, one of each per word row: the next block's keys at the
// same tokens (row stride B words) and this tile's values (contiguous). Spread through the FMAs, the prefetches
// never queue up behind each other (a burst of them stalls the core once the fill buffers are full).
// kDot (bf16 cache, AVX512-BF16): q holds at q[v * D + 2i] the bits of the bf16 pair (q_2i, q_2i+1) of the
// unscaled query, and one VDPBF16PS adds both products of a word row into accumulator 2u (the parity's lo one;
// the hi ones stay 0); the sums are multiplied by dot_scale at the end. Where VDPBF16PS runs at the FMA's rate
// (AMD, fma_linear_dot_default) that is half the multiply-adds and no splitting of the keys.
template <int NV, typename T, bool kDot = false>
inline void score_tile(const float* q, int64_t D, const T* kb, int64_t B, int64_t t0, __mmask16 m, float* s,
                       int64_t ns, const char* pk = nullptr, const char* pv = nullptr, float dot_scale = 1.f) {
  constexpr int x = pack_x<T>();
  static_assert(NV >= 1 && NV <= 6, "4 x NV accumulators and the key words must fit in 32 registers");
  constexpr int A = 4;
  constexpr int R = x == 4 ? 1 : A / 2;  // word rows per step (D / x is a multiple of 2)
  const int32_t* w = reinterpret_cast<const int32_t*>(kb) + t0;
  __m512 acc[A][NV];
  PAGELLM_UNROLL
  for (int a = 0; a < A; ++a)
    PAGELLM_UNROLL
    for (int v = 0; v < NV; ++v) acc[a][v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < D / x; j += R) {
    PAGELLM_UNROLL
    for (int u = 0; u < R; ++u) {
      if (pk) _mm_prefetch(pk + (j + u) * B * 4, _MM_HINT_T0);
      if (pv) _mm_prefetch(pv + (j + u) * 64, _MM_HINT_T0);
      const __m512i word = _mm512_maskz_loadu_epi32(m, w + (j + u) * B);
      if constexpr (x == 4) {  // fp8: dims 4j .. 4j+3, element e into accumulator e % A
        const __m512 e0 = fp8_lane<0>(word, kb), e1 = fp8_lane<1>(word, kb);
        const __m512 e2 = fp8_lane<2>(word, kb), e3 = fp8_lane<3>(word, kb);
        PAGELLM_UNROLL
        for (int v = 0; v < NV; ++v) {
          const float* qv = q + v * D + 4 * j;
          acc[0][v] = _mm512_fmadd_ps(_mm512_set1_ps(qv[0]), e0, acc[0][v]);
          acc[1][v] = _mm512_fmadd_ps(_mm512_set1_ps(qv[1]), e1, acc[1][v]);
          acc[2 % A][v] = _mm512_fmadd_ps(_mm512_set1_ps(qv[2]), e2, acc[2 % A][v]);
          acc[3 % A][v] = _mm512_fmadd_ps(_mm512_set1_ps(qv[3]), e3, acc[3 % A][v]);
        }
      } else if constexpr (x == 2 && kDot) {
        PAGELLM_UNROLL
        for (int v = 0; v < NV; ++v) acc[2 * u][v] = dot_pair(acc[2 * u][v], q + v * D + 2 * (j + u), word);
      } else if constexpr (x == 2) {
        __m512 lo, hi;
        split(word, lo, hi, kb);
        PAGELLM_UNROLL
        for (int v = 0; v < NV; ++v) {
          const float* qv = q + v * D + 2 * (j + u);
          acc[2 * u][v] = _mm512_fmadd_ps(_mm512_set1_ps(qv[0]), lo, acc[2 * u][v]);
          acc[2 * u + 1][v] = _mm512_fmadd_ps(_mm512_set1_ps(qv[1]), hi, acc[2 * u + 1][v]);
        }
      } else {
        const __m512 kv = _mm512_castsi512_ps(word);
        PAGELLM_UNROLL
        for (int v = 0; v < NV; ++v)
          acc[2 * u][v] = _mm512_fmadd_ps(_mm512_set1_ps(q[v * D + j + u]), kv, acc[2 * u][v]);
      }
    }
  }
  PAGELLM_UNROLL
  for (int v = 0; v < NV; ++v) {
    __m512 r = acc[0][v];
    PAGELLM_UNROLL
    for (int a = 1; a < A; ++a) r = _mm512_add_ps(r, acc[a][v]);
    if constexpr (kDot) r = _mm512_mul_ps(r, _mm512_set1_ps(dot_scale));
    _mm512_mask_storeu_ps(s + v * ns + t0, m, r);
  }
}

// Scores of 32 tokens (from token t0 of the block) for NV <= 3 query vectors, 16-bit cache (x == 2): both 16-token
// halves of each word row in one pass, so the block's key lines are read in address order (score_tile reads a
// row's first line for the first half, then comes back for the second). Per half and vector the same four
// accumulators in the same order as score_tile's (A = 4), so the scores are bit for bit score_tile's. pk, pv as
// score_tile's, two lines of each per word row, the values into L2 only (the value pass reads them after all the
// blocks' scores, from L2 anyway; 4 alternating process pairs of workload_64: inter-token p50 49.0-52.3 against
// 49.3-52.8 ms, wall 0.98x). A decode step's attention (30 layers x 64 rows over 362-token contexts, bf16,
// 32-token blocks, two threads; in-process, alternating with score_tile's two passes): 26.1-29.3 against 29.2-32.3
// ms, with the request's blocks consecutive or shuffled; workload_64 end to end (`pagellm bench throughput`, 4
// alternating process pairs): 9.16-9.46 against 9.48-9.91 s, inter-token p50 51 against 54 ms.
// kDot (AMD's cores) brings the next block's keys into L2 only, as the values: on Zen 4 (2026-12-04, the decode case
// above alternating in one process, 6 rounds, min / median) 23.9 / 25.1 against 29.3 / 30.2 ms with the blocks
// shuffled, 22.7 / 24.6 against 23.3 / 25.2 in order: the L1's fill buffers held the stream back.
template <int NV, typename T, bool kDot = false>
inline void score_block32(const float* q, int64_t D, const T* kb, int64_t B, int64_t t0, float* s, int64_t ns,
                          const char* pk, const char* pv, float dot_scale = 1.f) {
  static_assert(pack_x<T>() == 2 && NV >= 1 && NV <= 3, "16-bit caches, up to 3 vectors (24 accumulators)");
  const int32_t* w = reinterpret_cast<const int32_t*>(kb) + t0;
  __m512 acc[2][4][NV];  // [half][row parity * 2 + lo / hi][vector]
  PAGELLM_UNROLL
  for (int h = 0; h < 2; ++h)
    PAGELLM_UNROLL
    for (int a = 0; a < 4; ++a)
      PAGELLM_UNROLL
      for (int v = 0; v < NV; ++v) acc[h][a][v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < D / 2; j += 2) {
    PAGELLM_UNROLL
    for (int u = 0; u < 2; ++u) {
      const int64_t r = j + u;
      if (pk) {
        if constexpr (kDot) _mm_prefetch(pk + r * B * 4, _MM_HINT_T1), _mm_prefetch(pk + r * B * 4 + 64, _MM_HINT_T1);
        else _mm_prefetch(pk + r * B * 4, _MM_HINT_T0), _mm_prefetch(pk + r * B * 4 + 64, _MM_HINT_T0);
      }
      if (pv) _mm_prefetch(pv + r * 128, _MM_HINT_T1), _mm_prefetch(pv + r * 128 + 64, _MM_HINT_T1);
      if constexpr (kDot) {  // as score_tile's kDot: accumulator [half][2u] per word row
        const __m512i k0 = _mm512_loadu_si512(w + r * B), k1 = _mm512_loadu_si512(w + r * B + 16);
        PAGELLM_UNROLL
        for (int v = 0; v < NV; ++v) {
          acc[0][2 * u][v] = dot_pair(acc[0][2 * u][v], q + v * D + 2 * r, k0);
          acc[1][2 * u][v] = dot_pair(acc[1][2 * u][v], q + v * D + 2 * r, k1);
        }
        continue;
      }
      __m512 e[2][2];  // [half][lo / hi]
      split(_mm512_loadu_si512(w + r * B), e[0][0], e[0][1], kb);
      split(_mm512_loadu_si512(w + r * B + 16), e[1][0], e[1][1], kb);
      PAGELLM_UNROLL
      for (int v = 0; v < NV; ++v) {
        const float* qv = q + v * D + 2 * r;
        PAGELLM_UNROLL
        for (int h = 0; h < 2; ++h) {
          acc[h][2 * u][v] = _mm512_fmadd_ps(_mm512_set1_ps(qv[0]), e[h][0], acc[h][2 * u][v]);
          acc[h][2 * u + 1][v] = _mm512_fmadd_ps(_mm512_set1_ps(qv[1]), e[h][1], acc[h][2 * u + 1][v]);
        }
      }
    }
  }
  PAGELLM_UNROLL
  for (int v = 0; v < NV; ++v)
    PAGELLM_UNROLL
    for (int h = 0; h < 2; ++h) {
      __m512 r = acc[h][0][v];
      PAGELLM_UNROLL
      for (int a = 1; a < 4; ++a) r = _mm512_add_ps(r, acc[h][a][v]);
      if constexpr (kDot) r = _mm512_mul_ps(r, _mm512_set1_ps(dot_scale));
      _mm512_storeu_ps(s + v * ns + t0 + 16 * h, r);
    }
}

// acc[v] += p[v][t] * v_t for one token pair (x == 2; flags say which of its two tokens count).
template <int NV, int C, typename T>
PAGELLM_INLINE void pv_pair(const float* p, int64_t ns, const int32_t* row, bool first, bool second,
                            __m512 (&acc)[NV][C]) {
  PAGELLM_UNROLL
  for (int c = 0; c < C; ++c) {
    __m512 a, b;
    split(_mm512_loadu_si512(row + 16 * c), a, b, static_cast<const T*>(nullptr));
    PAGELLM_UNROLL
    for (int v = 0; v < NV; ++v) {
      if (first) acc[v][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[v * ns]), a, acc[v][c]);
      if (second) acc[v][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[v * ns + 1]), b, acc[v][c]);
    }
  }
}

// kDot: acc[v] += p[v][2i] * v_2i + p[v][2i+1] * v_2i+1 for one token pair, one VDPBF16PS per 16 dims and vector:
// pw[v * nsw] holds the pair's weights as bf16 (exp_range_bf16), the value row the tokens' bf16 pairs.
template <int NV, int C>
PAGELLM_INLINE void pv_pair_dot(const int32_t* pw, int64_t nsw, const int32_t* row, __m512 (&acc)[NV][C]) {
#if defined(__AVX512BF16__)
  PAGELLM_UNROLL
  for (int c = 0; c < C; ++c) {
    const __m512bh w = (__m512bh)_mm512_loadu_si512(row + 16 * c);
    PAGELLM_UNROLL
    for (int v = 0; v < NV; ++v) acc[v][c] = _mm512_dpbf16_ps(acc[v][c], (__m512bh)_mm512_set1_epi32(pw[v * nsw]), w);
  }
#else
  (void)pw, (void)nsw, (void)row, (void)acc;  // never called: kDot needs AVX512-BF16
#endif
}

// fp8: acc[v] += p[v][t] * v_t for the four tokens of one word row whose bits are set in valid.
template <int NV, int C, typename T>
PAGELLM_INLINE void pv_quad(const float* p, int64_t ns, const int32_t* row, unsigned valid, __m512 (&acc)[NV][C]) {
  const T* tag = nullptr;
  PAGELLM_UNROLL
  for (int c = 0; c < C; ++c) {
    const __m512i w = _mm512_loadu_si512(row + 16 * c);
    const __m512 e[4] = {fp8_lane<0>(w, tag), fp8_lane<1>(w, tag), fp8_lane<2>(w, tag), fp8_lane<3>(w, tag)};
    PAGELLM_UNROLL
    for (int k = 0; k < 4; ++k)
      if (valid >> k & 1)
        PAGELLM_UNROLL
        for (int v = 0; v < NV; ++v) acc[v][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[v * ns + k]), e[k], acc[v][c]);
  }
}

// acc[v] += sum over tokens lo..hi-1 of one block of p[v][t] * v_t (head_dim = 16 * C). Tokens outside
// [lo, hi) are skipped, never multiplied by 0: a stale NaN in an unused slot must not leak in. kDot (bf16): the
// pairs inside [lo, hi) by pv_pair_dot on pw (the weights' bf16 pairs, row stride ns / 2), a pair cut by lo or hi by
// the FMAs on p (where softmax_rows left the same rounded weights: p is read nowhere else).
// pf (kDot, optional): a region of the cache laid out as vb, its lines of each pair prefetched into L2 alongside
// (ReadAhead).
template <int NV, int C, typename T, bool kDot = false>
PAGELLM_INLINE void pv_block(const float* p, int64_t ns, const T* vb, int64_t lo, int64_t hi,
                             __m512 (&acc)[NV][C], const int32_t* pw = nullptr, const char* pf = nullptr) {
  constexpr int x = pack_x<T>();
  constexpr int64_t D = 16 * C;
  const int32_t* w = reinterpret_cast<const int32_t*>(vb);
  if constexpr (x == 4) {
    int64_t i = lo / 4;
    for (; 4 * i < hi; ++i) {
      const int64_t t = 4 * i;
      if (t >= lo && t + 4 <= hi) {
        pv_quad<NV, C, T>(p + t, ns, w + i * D, 0xFu, acc);
      } else {
        unsigned valid = 0;
        for (int k = 0; k < 4; ++k) valid |= static_cast<unsigned>(t + k >= lo && t + k < hi) << k;
        pv_quad<NV, C, T>(p + t, ns, w + i * D, valid, acc);
      }
    }
  } else if constexpr (x == 2) {
    int64_t i = lo / 2;
    if (lo % 2) pv_pair<NV, C, T>(p + 2 * i, ns, w + i * D, false, true, acc), ++i;
    for (; 2 * i + 1 < hi; ++i)
      if constexpr (kDot) {
        if (pf)
          PAGELLM_UNROLL
          for (int c = 0; c < C; ++c) _mm_prefetch(pf + (i * D + 16 * c) * 4, _MM_HINT_T1);
        pv_pair_dot<NV, C>(pw + i, ns / 2, w + i * D, acc);
      } else {
        pv_pair<NV, C, T>(p + 2 * i, ns, w + i * D, true, true, acc);
      }
    if (2 * i < hi) pv_pair<NV, C, T>(p + 2 * i, ns, w + i * D, true, false, acc);
  } else {
    for (int64_t t = lo; t < hi; ++t)
      PAGELLM_UNROLL
      for (int c = 0; c < C; ++c) {
        const __m512 val = _mm512_castsi512_ps(_mm512_loadu_si512(w + t * D + 16 * c));
        PAGELLM_UNROLL
        for (int v = 0; v < NV; ++v) acc[v][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[v * ns + t]), val, acc[v][c]);
      }
  }
}

#endif

}  // namespace pagellm
