// The paged-attention task (paged_attention_task.h) on AVX-512, the kernel's main path (paged_attention_cpu.cpp):
// per block and kv head, the scores of a task's query vectors 16 tokens at a time (score_tile; decode rows 32 at a
// time, score_block32), the causal softmax (softmax_rows), then each group of vectors' weighted sum of the values
// over the span, accumulated in fp32. With Args::dot (bf16 cache, AMD's AVX512-BF16) the scores and the weighted
// sums take VDPBF16PS, the softmax's weights rounded to bf16 for it (unnormalised, the sums divided at the end).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "attention_common.h"
#include "paged_attention_task.h"

#if defined(__AVX512F__)
namespace pagellm::paged {


// Scores of nv vectors for one 16-token tile, in groups of NV (6: 24 accumulators), then the rest; the first pass
// over the keys also prefetches pk / pv (score_tile).
template <int C, typename T, bool kDot, int NV = 6>
inline void scores_for(const Args& a, const float* qf, const T* kb, int64_t t0, __mmask16 m, float* S, int64_t ns,
                       int64_t nv, const char* pk, const char* pv) {
  if constexpr (NV > 0) {
    if (nv >= NV) {
      for (int64_t v = 0; v + NV <= nv; v += NV)
        score_tile<NV, T, kDot>(qf + v * 16 * C, 16 * C, kb, a.B, t0, m, S + v * ns, ns, v ? nullptr : pk,
                                v ? nullptr : pv, a.scale);
      const int64_t done = nv - nv % NV;
      if (nv % NV)
        scores_for<C, T, kDot, NV - 1>(a, qf + done * 16 * C, kb, t0, m, S + done * ns, ns, nv % NV, nullptr,
                                       nullptr);
    } else {
      scores_for<C, T, kDot, NV - 1>(a, qf, kb, t0, m, S, ns, nv, pk, pv);
    }
  }
}

// score_block32 for nv <= 4 vectors (three, then the rest; the first group also prefetches); 16-bit caches only.
template <typename T, bool kDot>
inline void scores_block32_for(const float* qf, int64_t D, const T* kb, int64_t B, int64_t t0, float* S, int64_t ns,
                               int64_t nv, const char* pk, const char* pv, float dot_scale) {
  if constexpr (pack_x<T>() == 2) {
    for (int64_t v = 0; v < nv; v += 3) {
      const char* k = v ? nullptr : pk;
      const char* p = v ? nullptr : pv;
      switch (std::min<int64_t>(3, nv - v)) {
        case 3: score_block32<3, T, kDot>(qf + v * D, D, kb, B, t0, S + v * ns, ns, k, p, dot_scale); break;
        case 2: score_block32<2, T, kDot>(qf + v * D, D, kb, B, t0, S + v * ns, ns, k, p, dot_scale); break;
        default: score_block32<1, T, kDot>(qf + v * D, D, kb, B, t0, S + v * ns, ns, k, p, dot_scale);
      }
    }
  }
}

// Weighted sums for vectors [v0, v0 + NV) over keys [klo, khi), block by block -> of (fp32). kDot: P holds the
// unnormalised weights' bf16 pairs (softmax_rows' P16), each vector's sum scaled by its inv at the end.
template <int NV, int C, typename T, bool kDot>
inline void values_for(const Args& a, const Task& t, const Span& s, const float* S, const int32_t* P, const T* vc,
                       int64_t v0, float* of, NextBlocks& ahead, int64_t per_block, const float* inv) {
  __m512 acc[NV][C];
  PAGELLM_UNROLL
  for (int v = 0; v < NV; ++v)
    PAGELLM_UNROLL
    for (int c = 0; c < C; ++c) acc[v][c] = _mm512_setzero_ps();
  for (int64_t b = s.b0; b <= s.b1; ++b) {
    const T* vb = vc + a.bt[t.r * a.MB + b] * a.v_sb + t.h * a.v_sh;
    const int64_t lo = std::max<int64_t>(0, s.klo - b * a.B), hi = std::min<int64_t>(a.B, s.khi - b * a.B);
    const int64_t at = v0 * s.ns + (b - s.b0) * a.B;
    // the read-ahead in step with the first pass over the values (its list holds one)
    const char* pf = ahead.stream && v0 == 0 ? ahead.stream->take() : nullptr;
    pv_block<NV, C, T, kDot>(S + at, s.ns, vb, lo, hi, acc, kDot ? P + at / 2 : nullptr, pf);
    if (!ahead.stream) ahead.issue(per_block);
  }
  // kDot: the weights were exp(s - max) (softmax_rows' P16), inv their sums' inverses; fp8 e4m3: the values were
  // read scaled down
  PAGELLM_UNROLL
  for (int v = 0; v < NV; ++v) {
    const __m512 f = _mm512_set1_ps(kDot ? inv[v0 + v] : fp8_read_scale<T>());
    PAGELLM_UNROLL
    for (int c = 0; c < C; ++c)
      _mm512_storeu_ps(of + (v0 + v) * 16 * C + 16 * c,
                       kDot || fp8_read_scale<T>() != 1.f ? _mm512_mul_ps(acc[v][c], f) : acc[v][c]);
  }
}

// The last rem (< NV) vectors in one pass.
template <int C, typename T, bool kDot, int K>
inline void values_tail(const Args& a, const Task& t, const Span& s, const float* S, const int32_t* P, const T* vc,
                        int64_t v0, int64_t rem, float* of, NextBlocks& ahead, int64_t per_block,
                        const float* inv) {
  if constexpr (K > 0) {
    if (rem == K) values_for<K, C, T, kDot>(a, t, s, S, P, vc, v0, of, ahead, per_block, inv);
    else values_tail<C, T, kDot, K - 1>(a, t, s, S, P, vc, v0, rem, of, ahead, per_block, inv);
  }
}

// kDot: qf holds q's bf16 pairs, unscaled (run_task; score_tile's kDot), and S has room after the task's scores
// for one head's weights as bf16 pairs (nv * ns / 2 words) and the inverses of their sums (nv floats): the value
// pass runs on VDPBF16PS too, on the unnormalised weights rounded to bf16 as SDPA's CPU flash kernel rounds them
// (pv_pair_dot), and divides by the sums at the end. ahead: the first
// blocks of the thread's next task, prefetched during the value pass; for decode rows with kDot, ahead.stream (the
// thread's ReadAhead, paged_attention_task.h) streams this task's blocks and the next one's instead.
template <int C, typename T, bool kDot>
void attend(const Args& a, const Task& t, const float* qf, const T* kc, const T* vc, float* S, float* of,
            NextBlocks& ahead) {
  const Span s = span_of(a, t);
  const int64_t nv = t.nrows * a.G, B = a.B, D = a.D;
  const bool decode = pack_x<T>() == 2 && B % 32 == 0 && nv <= 4;  // decode rows (up to 4 query heads per kv head)
  ReadAhead* stream = kDot && decode ? ahead.stream : nullptr;  // the read-ahead, where the caller gives one
  if (stream) stream->begin(a, t, ahead.task, kc, vc);
  else ahead.stream = nullptr;  // values_for then spreads NextBlocks' lines over the value pass
  // Block by block, and within a block head by head: a block's kv heads lie next to each other, so a task over
  // all of them reads each block's keys as one run (and a request's consecutive blocks as one stream).
  for (int64_t b = s.b0; b <= s.b1; ++b)
    for (int64_t h = t.h; h < t.h + t.nh; ++h) {
      const int64_t j = h - t.h;
      const T* kb = kc + a.bt[t.r * a.MB + b] * a.k_sb + h * a.k_sh;
      if (stream) {  // pk: the region ReadAhead is at (it holds the values too; pv then unused)
        const char* p = stream->take();
        for (int64_t t0 = 0; t0 < B; t0 += 32)
          scores_block32_for<T, kDot>(qf + j * nv * D, D, kb, B, t0, S + j * nv * s.ns + (b - s.b0) * B, s.ns, nv,
                                      p ? p + t0 * 4 : nullptr, nullptr, a.scale);
        continue;
      }
      // Pull the next block's keys and this block's values towards the core while the FMAs run.
      const char* kn = b < s.b1 ? reinterpret_cast<const char*>(kc + a.bt[t.r * a.MB + b + 1] * a.k_sb + h * a.k_sh)
                                : nullptr;
      const char* vb = reinterpret_cast<const char*>(vc + a.bt[t.r * a.MB + b] * a.v_sb + h * a.v_sh);
      float* Sb = S + j * nv * s.ns + (b - s.b0) * B;
      if (decode) {
        for (int64_t t0 = 0; t0 < B; t0 += 32)
          scores_block32_for<T, kDot>(qf + j * nv * D, D, kb, B, t0, Sb, s.ns, nv, kn ? kn + t0 * 4 : nullptr,
                                      vb + t0 * 16 * C * sizeof(T), a.scale);
        continue;
      }
      // only the tiles holding keys of the span: the softmax and the value pass read no score outside it (the
      // last block of a causal span is on average half past its end)
      const int64_t t_hi = std::min<int64_t>(B, s.khi - b * B);
      for (int64_t t0 = std::max<int64_t>(0, s.klo - b * B) / 16 * 16; t0 < t_hi; t0 += 16) {
        const int64_t w = std::min<int64_t>(16, B - t0);
        scores_for<C, T, kDot>(a, qf + j * nv * D, kb, t0, static_cast<__mmask16>((1u << w) - 1), Sb, s.ns, nv,
                               kn ? kn + t0 * 4 : nullptr, vb + t0 * 16 * C * sizeof(T));
      }
    }
  constexpr int NV = values_per_pass(C);
  const int64_t passes = t.nh * (s.b1 - s.b0 + 1) * ((nv + NV - 1) / NV);  // values_for's block iterations
  const int64_t per_block = (ahead.total() + passes - 1) / passes;
  for (int64_t j = 0; j < t.nh; ++j) {
    const Task th = one_head(t, j);
    float* Sh = S + j * nv * s.ns;
    float* oh = of + j * nv * D;
    int32_t* P = kDot ? reinterpret_cast<int32_t*>(S + t.nh * nv * s.ns) : nullptr;
    float* inv = kDot ? S + t.nh * nv * s.ns + nv * s.ns / 2 : nullptr;
    softmax_rows(a, th, s, Sh, reinterpret_cast<uint16_t*>(P), inv);
    int64_t v = 0;
    for (; v + NV <= nv; v += NV) values_for<NV, C, T, kDot>(a, th, s, Sh, P, vc, v, oh, ahead, per_block, inv);
    if (v < nv) values_tail<C, T, kDot, NV - 1>(a, th, s, Sh, P, vc, v, nv - v, oh, ahead, per_block, inv);
  }
  if (stream) stream->end();
}

// attend<D / 16, T, kDot>, or false where the head_dim has no vectorised kernel.
template <typename T, bool kDot>
bool attend_dims_as(const Args& a, const Task& t, const float* qf, const T* kc, const T* vc, float* S, float* of,
                    NextBlocks& ahead) {
  switch (a.D) {
    case 16: attend<1, T, kDot>(a, t, qf, kc, vc, S, of, ahead); return true;
    case 32: attend<2, T, kDot>(a, t, qf, kc, vc, S, of, ahead); return true;
    case 64: attend<4, T, kDot>(a, t, qf, kc, vc, S, of, ahead); return true;
    case 96: attend<6, T, kDot>(a, t, qf, kc, vc, S, of, ahead); return true;
    case 128: attend<8, T, kDot>(a, t, qf, kc, vc, S, of, ahead); return true;
    case 256: attend<16, T, kDot>(a, t, qf, kc, vc, S, of, ahead); return true;
    default: return false;
  }
}

// The kernel for cache type T (a.dot: the dot products, bf16 only).
template <typename T>
bool attend_dims(const Args& a, const Task& t, const float* qf, const T* kc, const T* vc, float* S, float* of,
                 NextBlocks& ahead) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    if (a.dot) return attend_dims_as<T, true>(a, t, qf, kc, vc, S, of, ahead);
#endif
  return attend_dims_as<T, false>(a, t, qf, kc, vc, S, of, ahead);
}

}  // namespace pagellm::paged
#endif
