// The paged-attention task (paged_attention_task.h) on 8-lane AVX2 FMAs, for a bf16 cache on CPUs with AVX2 but no
// AVX-512 (AMD Zen 2/3 and the like), where the kernel's AVX-512 loops do not build and the portable loop would run
// (one element at a time, ~1 ms per layer for one decode row over 128 tokens).
//
// The same cache layout and order as the AVX-512 path (paged_attention_cpu.cpp): per block and kv head, 8 tokens'
// scores at a time from K's word rows (dims 2j, 2j+1 of 8 tokens in one 32-byte load, split by a shift and a mask),
// for up to 4 query vectors per pass; the causal softmax (softmax_rows); then each vector's weighted sum of the
// block's values, one token pair per word row (tokens 2i, 2i+1 for 8 dims per load), accumulated in fp32 into of.
#pragma once

#include <algorithm>
#include <cstdint>

#include "paged_attention_task.h"
#include "vec8.h"

#if defined(PAGELLM_HAS_AVX2)
namespace pagellm::paged {

// Scores of NV query vectors q [NV][D] for the 8 tokens whose word rows start at w (row stride B words): s[v * ns].
// Two accumulators per vector (the even and the odd dims) hide the FMA latency.
template <int NV>
PAGELLM_INLINE void score8(const float* q, int64_t D, const int32_t* w, int64_t B, float* s, int64_t ns) {
  __m256 acc[2][NV];
  PAGELLM_UNROLL for (int v = 0; v < NV; ++v) acc[0][v] = acc[1][v] = _mm256_setzero_ps();
  const __m256i odd = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t j = 0; j < D / 2; ++j) {
    const __m256i word = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * B));
    const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(word, 16));
    const __m256 hi = _mm256_castsi256_ps(_mm256_and_si256(word, odd));
    PAGELLM_UNROLL for (int v = 0; v < NV; ++v) {
      acc[0][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(q + v * D + 2 * j), lo, acc[0][v]);
      acc[1][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(q + v * D + 2 * j + 1), hi, acc[1][v]);
    }
  }
  PAGELLM_UNROLL for (int v = 0; v < NV; ++v) _mm256_storeu_ps(s + v * ns, _mm256_add_ps(acc[0][v], acc[1][v]));
}

// o[0 .. 8 CH) += sum over tokens lo..hi-1 of a block of p[t] * v_t, w: the block's V word rows (row stride D
// words) at the first of these dims. Tokens outside [lo, hi) are skipped, never multiplied by 0 (a stale NaN in an
// unused slot must not leak in).
template <int CH>
PAGELLM_INLINE void pv8(const float* p, const int32_t* w, int64_t D, int64_t lo, int64_t hi, float* o) {
  __m256 acc[CH];
  PAGELLM_UNROLL for (int c = 0; c < CH; ++c) acc[c] = _mm256_loadu_ps(o + 8 * c);
  const __m256i odd = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  auto pair = [&](int64_t i, bool first, bool second) {
    const __m256 p0 = _mm256_set1_ps(p[2 * i]), p1 = _mm256_set1_ps(p[2 * i + 1]);
    PAGELLM_UNROLL for (int c = 0; c < CH; ++c) {
      const __m256i word = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i * D + 8 * c));
      if (first) acc[c] = _mm256_fmadd_ps(p0, _mm256_castsi256_ps(_mm256_slli_epi32(word, 16)), acc[c]);
      if (second) acc[c] = _mm256_fmadd_ps(p1, _mm256_castsi256_ps(_mm256_and_si256(word, odd)), acc[c]);
    }
  };
  int64_t i = lo / 2;
  if (lo % 2) pair(i++, false, true);
  for (; 2 * i + 1 < hi; ++i) pair(i, true, true);
  if (2 * i < hi) pair(i, true, false);
  PAGELLM_UNROLL for (int c = 0; c < CH; ++c) _mm256_storeu_ps(o + 8 * c, acc[c]);
}

// One vector's weighted sum over a block, D dims in chunks of 64 (8 registers), then the rest.
inline void pv_dims(const float* p, const int32_t* w, int64_t D, int64_t lo, int64_t hi, float* o) {
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) pv8<8>(p, w + d, D, lo, hi, o + d);
  switch ((D - d) / 8) {
    case 1: pv8<1>(p, w + d, D, lo, hi, o + d); break;
    case 2: pv8<2>(p, w + d, D, lo, hi, o + d); break;
    case 3: pv8<3>(p, w + d, D, lo, hi, o + d); break;
    case 4: pv8<4>(p, w + d, D, lo, hi, o + d); break;
    case 5: pv8<5>(p, w + d, D, lo, hi, o + d); break;
    case 6: pv8<6>(p, w + d, D, lo, hi, o + d); break;
    case 7: pv8<7>(p, w + d, D, lo, hi, o + d); break;
    default: break;
  }
}

// Task t over a bf16 cache (qf, S, of as paged_attention_cpu.cpp's attend); false where the shapes do not suit
// (block size or head_dim not a multiple of 8), for the portable loop to take.
inline bool attend_avx2(const Args& a, const Task& t, const float* qf, const c10::BFloat16* kc,
                        const c10::BFloat16* vc, float* S, float* of) {
  if (a.B % 8 || a.D % 8) return false;
  const Span s = span_of(a, t);
  const int64_t nv = t.nrows * a.G, B = a.B, D = a.D;
  for (int64_t b = s.b0; b <= s.b1; ++b)
    for (int64_t h = t.h; h < t.h + t.nh; ++h) {
      const int64_t j = h - t.h;
      const int32_t* w = reinterpret_cast<const int32_t*>(kc + a.bt[t.r * a.MB + b] * a.k_sb + h * a.k_sh);
      const float* q = qf + j * nv * D;
      float* sb = S + j * nv * s.ns + (b - s.b0) * B;
      for (int64_t t0 = 0; t0 < B; t0 += 8) {
        int64_t v = 0;
        for (; v + 4 <= nv; v += 4) score8<4>(q + v * D, D, w + t0, B, sb + v * s.ns + t0, s.ns);
        switch (nv - v) {
          case 1: score8<1>(q + v * D, D, w + t0, B, sb + v * s.ns + t0, s.ns); break;
          case 2: score8<2>(q + v * D, D, w + t0, B, sb + v * s.ns + t0, s.ns); break;
          case 3: score8<3>(q + v * D, D, w + t0, B, sb + v * s.ns + t0, s.ns); break;
          default: break;
        }
      }
    }
  for (int64_t j = 0; j < t.nh; ++j) {
    const Task th = one_head(t, j);
    float* Sh = S + j * nv * s.ns;
    float* oh = of + j * nv * D;
    softmax_rows(a, th, s, Sh);
    std::fill(oh, oh + nv * D, 0.f);
    for (int64_t b = s.b0; b <= s.b1; ++b) {
      const int32_t* w = reinterpret_cast<const int32_t*>(vc + a.bt[t.r * a.MB + b] * a.v_sb + th.h * a.v_sh);
      const int64_t lo = std::max<int64_t>(0, s.klo - b * B), hi = std::min<int64_t>(B, s.khi - b * B);
      for (int64_t v = 0; v < nv; ++v) pv_dims(Sh + v * s.ns + (b - s.b0) * B, w, D, lo, hi, oh + v * D);
    }
  }
  return true;
}

}  // namespace pagellm::paged
#endif
