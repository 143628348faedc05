// fp16 partial sums in the paged-attention kernel (EngineConfig.reduced_precision_reduction, CPUs with
// AVX512-FP16): prefill chunks of bf16/fp16 queries over a bf16, fp16 or fp8 cache.
//
// Why: without AMX, long prompts spend most of their time here (long_mix_32: 54 of 77 s), in fp32 FMAs. An fp16
// FMA does 32 lanes for the fp32 one's 16 at the same rate, and the fp32 path also spends an instruction or two
// per 16 elements widening bf16.
//
// How: once per call, each staged request's blocks are copied into fp16 in the 16-bit layout (K [D/2, B, 2],
// V [B/2, D, 2]), times a power of two per (request, kv head) that puts K's and V's largest |value| in [0.5, 1)
// (bf16 and fp8 values convert exactly; slots past the context are zeroed). A task then:
//   - q.k: each query vector is scaled by a power of two to a largest |value| below 2^(15 - log2(D/4)), as fp16
//     pairs; one 32-bit broadcast of (q_2j, q_2j+1) times one K word row (16 tokens x dims 2j, 2j+1) is one FMA.
//     Two accumulators (even / odd j) each sum D/4 products per lane, below 2^15: no input overflows fp16. The
//     sums join in fp32, and the scales are undone there (exactly).
//   - softmax in fp32 as before; the normalised p (<= 1) go into fp16 times 2^14.
//   - p.v: one 32-bit broadcast of (p_2i, p_2i+1) times a V word row (tokens 2i, 2i+1 x 16 dims) per 16 dims.
//     Every 16 pair steps the fp16 sums join the fp32 output. Since the p sum to at most 1, no partial sum
//     exceeds 2^14, however many tokens.
// The staging costs two reads and one write of the context per call; the kernel reads each element once per
// group of query vectors, so only chunks of at least kFp16MinRows rows take this path (decode rows never).
#pragma once

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "attention_common.h"
#include "paged_attention_task.h"

namespace pagellm::paged {

#ifndef PAGELLM_SCORE_SUMS
#define PAGELLM_SCORE_SUMS 2
#endif
#if defined(__AVX512FP16__)
constexpr bool kHasFp16Attention = true;
#else
constexpr bool kHasFp16Attention = false;
#endif

// Rows a request's chunk needs for its tasks to take the fp16 path over a 16-bit cache.
constexpr int64_t kFp16MinRows = 16;
constexpr float kPScale = 16384.f;  // p in fp16 is p * 2^14
constexpr int kScoreSums = PAGELLM_SCORE_SUMS;

struct Staged16 {
  Args a;                           // addresses the copy: block table [R, MB] into it, its strides
  const uint16_t *k = nullptr, *v = nullptr;  // fp16 bits
  std::vector<float> kinv, vinv;    // [R * Hkv]: what undoes each (request, kv head)'s scale
  std::vector<char> on;             // per request: its tasks run here
};

// 2^-e for a largest |value| m = f * 2^e, f in [0.5, 1): m * scale in [0.5, 1). 1 when m is 0 or not finite.
inline float unit_scale(float m) {
  if (!(m > 0.f) || !std::isfinite(m)) return 1.f;
  int e;
  std::frexp(m, &e);
  return std::ldexp(1.f, -e);
}

#if defined(__AVX512FP16__)

// Largest |value| of n consecutive elements of the cache (n a multiple of the elements per word), NaN ignored
// (an element's NaN still reaches the copy and the result).
template <typename KV>
inline float absmax_run(const KV* p, int64_t n) {
  constexpr int x = pack_x<KV>();
  __m512 m = _mm512_setzero_ps();
  int64_t i = 0;
  if constexpr (x == 2) {
    for (; i + 16 <= n; i += 16) m = _mm512_max_ps(_mm512_abs_ps(load16(p + i)), m);
  } else {
    const KV* tag = nullptr;
    const int32_t* w = reinterpret_cast<const int32_t*>(p);
    for (; i + 64 <= n; i += 64) {
      const __m512i v = _mm512_loadu_si512(w + i / 4);
      m = _mm512_max_ps(_mm512_abs_ps(fp8_lane<0>(v, tag)), m);
      m = _mm512_max_ps(_mm512_abs_ps(fp8_lane<1>(v, tag)), m);
      m = _mm512_max_ps(_mm512_abs_ps(fp8_lane<2>(v, tag)), m);
      m = _mm512_max_ps(_mm512_abs_ps(fp8_lane<3>(v, tag)), m);
    }
    m = _mm512_mul_ps(m, _mm512_set1_ps(fp8_read_scale<KV>()));
  }
  float r = _mm512_reduce_max_ps(m);
  for (; i < n; ++i) r = std::max(r, std::fabs(to_float(p[i])));
  return r;
}

// Largest |value| of the first n tokens of one (block, kv head); kb / vb in the cache's layout (x per word).
template <typename KV>
float block_absmax(const KV* kb, const KV* vb, int64_t n, int64_t B, int64_t D, bool of_v) {
  constexpr int x = pack_x<KV>();
  float m = 0.f;
  if (!of_v) {
    for (int64_t j = 0; j < D / x; ++j) m = std::max(m, absmax_run(kb + j * B * x, n * x));
    return m;
  }
  const int64_t full = n / x;  // word rows of V with all x tokens inside the context
  m = absmax_run(vb, full * D * x);
  for (int64_t t = full * x; t < n; ++t)
    for (int64_t d = 0; d < D; ++d) m = std::max(m, std::fabs(v_at(vb, D, t, d)));
  return m;
}

// 16 floats times s as fp16 bits, each in the low half of a 32-bit lane.
PAGELLM_INLINE __m512i half_lanes(__m512 v, __m512 s) {
  return _mm512_cvtepu16_epi32(_mm512_cvtps_ph(_mm512_mul_ps(v, s), _MM_FROUND_TO_NEAREST_INT));
}
// Two vectors of 16 floats times s as 16 words of fp16 pairs (lo in the low half).
PAGELLM_INLINE __m512i half_pairs(__m512 lo, __m512 hi, __m512 s) {
  return _mm512_or_si512(half_lanes(lo, s), _mm512_slli_epi32(half_lanes(hi, s), 16));
}

// One (block, kv head) of the cache into the fp16 layout times ks / vs. 16-bit sources keep their layout (element
// for element); fp8 ones (4 per word) are split into two word rows, as fp8_block_to_bf16 does. Then the slots of
// tokens n .. B-1 are zeroed: they may hold anything, and a p of 0 times a NaN there would be NaN.
template <typename KV>
void block_to_fp16(const KV* kb, const KV* vb, uint16_t* ko, uint16_t* vo, int64_t n, int64_t B, int64_t D,
                   float ks, float vs) {
  if constexpr (pack_x<KV>() == 2) {
    const __m512 sk = _mm512_set1_ps(ks), sv = _mm512_set1_ps(vs);
    for (int64_t i = 0; i < B * D; i += 16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(ko + i),
                          _mm512_cvtps_ph(_mm512_mul_ps(load16(kb + i), sk), _MM_FROUND_TO_NEAREST_INT));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(vo + i),
                          _mm512_cvtps_ph(_mm512_mul_ps(load16(vb + i), sv), _MM_FROUND_TO_NEAREST_INT));
    }
  } else {
    const KV* tag = nullptr;
    const __m512 sk = _mm512_set1_ps(ks * fp8_read_scale<KV>()), sv = _mm512_set1_ps(vs * fp8_read_scale<KV>());
    const int32_t* kw = reinterpret_cast<const int32_t*>(kb);
    const int32_t* vw = reinterpret_cast<const int32_t*>(vb);
    int32_t* kout = reinterpret_cast<int32_t*>(ko);
    int32_t* vout = reinterpret_cast<int32_t*>(vo);
    for (int64_t j = 0; j < D / 4; ++j)
      for (int64_t t0 = 0; t0 < B; t0 += 16) {
        const __mmask16 m = static_cast<__mmask16>((1u << std::min<int64_t>(16, B - t0)) - 1);
        const __m512i w = _mm512_maskz_loadu_epi32(m, kw + j * B + t0);
        _mm512_mask_storeu_epi32(kout + 2 * j * B + t0, m, half_pairs(fp8_lane<0>(w, tag), fp8_lane<1>(w, tag), sk));
        _mm512_mask_storeu_epi32(kout + (2 * j + 1) * B + t0, m,
                                 half_pairs(fp8_lane<2>(w, tag), fp8_lane<3>(w, tag), sk));
      }
    for (int64_t i = 0; i < B / 4; ++i)
      for (int64_t d = 0; d < D; d += 16) {
        const __m512i w = _mm512_loadu_si512(vw + i * D + d);
        _mm512_storeu_si512(vout + 2 * i * D + d, half_pairs(fp8_lane<0>(w, tag), fp8_lane<1>(w, tag), sv));
        _mm512_storeu_si512(vout + (2 * i + 1) * D + d, half_pairs(fp8_lane<2>(w, tag), fp8_lane<3>(w, tag), sv));
      }
  }
  if (n == B) return;
  for (int64_t j = 0; j < D / 2; ++j) std::memset(ko + j * B * 2 + 2 * n, 0, (B - n) * 2 * sizeof(uint16_t));
  const int64_t first_empty = (n + 1) / 2;  // V word rows past the context
  std::memset(vo + first_empty * D * 2, 0, (B / 2 - first_empty) * D * 2 * sizeof(uint16_t));
  if (n % 2)
    for (int64_t d = 0; d < D; ++d) vo[(n / 2) * D * 2 + 2 * d + 1] = 0;
}

// Fills st for the requests with want[r] (st.on stays empty when none has). The copy lives in per-thread buffers
// that keep their size between calls, so a step's layers do not each map and fault in fresh pages. The copy is
// head-major: one kv head's blocks of a request lie one after another, one stream for a task to read.
template <typename KV>
void stage_fp16(const Args& a, const std::vector<char>& want, const KV* kc, const KV* vc, Staged16& st) {
  thread_local std::vector<uint16_t> kbuf, vbuf;
  thread_local std::vector<int64_t> table;
  const int64_t R = static_cast<int64_t>(want.size());
  std::vector<std::pair<int64_t, int64_t>> blocks;  // (request, block index in its table)
  table.assign(R * a.MB, 0);
  for (int64_t r = 0; r < R; ++r)
    if (want[r])
      for (int64_t b = 0; b * a.B < a.seq[r]; ++b) {
        table[r * a.MB + b] = static_cast<int64_t>(blocks.size());
        blocks.emplace_back(r, b);
      }
  const int64_t nb = static_cast<int64_t>(blocks.size()), per = a.B * a.D, items = nb * a.Hkv;
  if (static_cast<int64_t>(kbuf.size()) < items * per) kbuf.resize(items * per), vbuf.resize(items * per);
  // Pass 1: each (block, kv head)'s largest |K| and |V| over its tokens inside the context.
  std::vector<float> kmax(items), vmax(items);
  auto source = [&](int64_t i, const KV*& kb, const KV*& vb, int64_t& n) {
    const auto [r, b] = blocks[i % nb];
    const int64_t h = i / nb, src = a.bt[r * a.MB + b];
    kb = kc + src * a.k_sb + h * a.k_sh, vb = vc + src * a.v_sb + h * a.v_sh;
    n = std::min(a.B, a.seq[r] - b * a.B);
  };
  at::parallel_for(0, items, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const KV *kb, *vb;
      int64_t n;
      source(i, kb, vb, n);
      kmax[i] = block_absmax(kb, vb, n, a.B, a.D, false);
      vmax[i] = block_absmax(kb, vb, n, a.B, a.D, true);
    }
  });
  // The scales of each (request, kv head).
  std::vector<float> km(R * a.Hkv, 0.f), vm(R * a.Hkv, 0.f);
  for (int64_t i = 0; i < items; ++i) {
    const int64_t rh = blocks[i % nb].first * a.Hkv + i / nb;
    km[rh] = std::max(km[rh], kmax[i]), vm[rh] = std::max(vm[rh], vmax[i]);
  }
  st.kinv.assign(R * a.Hkv, 1.f), st.vinv.assign(R * a.Hkv, 1.f);
  for (int64_t rh = 0; rh < R * a.Hkv; ++rh)
    st.kinv[rh] = 1.f / unit_scale(km[rh]), st.vinv[rh] = 1.f / unit_scale(vm[rh]);
  // Pass 2: the copy. (The workers must not name the thread_locals: each would see its own, empty.)
  uint16_t* kout = kbuf.data();
  uint16_t* vout = vbuf.data();
  at::parallel_for(0, items, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const KV *kb, *vb;
      int64_t n;
      source(i, kb, vb, n);
      const int64_t rh = blocks[i % nb].first * a.Hkv + i / nb;
      block_to_fp16<KV>(kb, vb, kout + i * per, vout + i * per, n, a.B, a.D, 1.f / st.kinv[rh],
                        1.f / st.vinv[rh]);
    }
  });
  st.on = want;
  st.a = a;
  st.a.bt = table.data();
  st.a.k_sb = st.a.v_sb = per, st.a.k_sh = st.a.v_sh = nb * per;
  st.k = kout, st.v = vout;
}

// Query vector f [D] (fp32) as D/2 words of fp16 pairs, times a power of two that bounds the score sums (see the
// file's comment); returns what undoes it.
inline float query_to_fp16(const float* f, int64_t D, int32_t* out) {
  int lanes_log2 = 0;  // ceil(log2(D / 2)): products per lane of one accumulator
  while ((int64_t{1} << lanes_log2) < D / 2 / kScoreSums) ++lanes_log2;
  float m = 0.f;
  for (int64_t d = 0; d < D; ++d) m = std::max(m, std::fabs(f[d]));
  float s = 1.f;
  if (m > 0.f && std::isfinite(m)) {
    int e;
    std::frexp(m, &e);  // m < 2^e
    s = std::ldexp(1.f, 15 - lanes_log2 - e);
  }
  for (int64_t j = 0; j < D / 2; ++j) {
    const c10::Half lo(f[2 * j] * s), hi(f[2 * j + 1] * s);
    out[j] = static_cast<int32_t>(static_cast<uint32_t>(lo.x) | static_cast<uint32_t>(hi.x) << 16);
  }
  return 1.f / s;
}

// Scores of NV query vectors (q16: D/2 words each) for NT tiles of up to 16 tokens (tile u: lanes in m[u], from
// token t0 + 16u) of a block's keys kw (word rows B apart): s[v * ns + t0 + 16u + lane], times inv[v]. One
// broadcast of a q pair feeds NT FMAs.
template <int NV, int NT>
PAGELLM_INLINE void score_tile16(const int32_t* q16, int64_t D, const int32_t* kw, int64_t B, int64_t t0,
                                 const __mmask16 (&m)[2], float* s, int64_t ns, const float* inv) {
  constexpr int A = kScoreSums;
  __m512h acc[NT][A][NV];
  PAGELLM_UNROLL
  for (int u = 0; u < NT; ++u)
    PAGELLM_UNROLL
    for (int c = 0; c < A; ++c)
      PAGELLM_UNROLL
      for (int v = 0; v < NV; ++v) acc[u][c][v] = _mm512_setzero_ph();
  const int32_t* w = kw + t0;
  const int64_t W = D / 2;
  for (int64_t j = 0; j < W; j += A)
    PAGELLM_UNROLL
    for (int c = 0; c < A; ++c) {
      __m512h k[NT];
      PAGELLM_UNROLL
      for (int u = 0; u < NT; ++u)
        k[u] = _mm512_castsi512_ph(_mm512_maskz_loadu_epi32(m[u], w + (j + c) * B + 16 * u));
      PAGELLM_UNROLL
      for (int v = 0; v < NV; ++v) {
        const __m512h qv = _mm512_castsi512_ph(_mm512_set1_epi32(q16[v * W + j + c]));
        PAGELLM_UNROLL
        for (int u = 0; u < NT; ++u) acc[u][c][v] = _mm512_fmadd_ph(qv, k[u], acc[u][c][v]);
      }
    }
  const c10::Half* tag = nullptr;
  PAGELLM_UNROLL
  for (int v = 0; v < NV; ++v) {
    const __m512 f = _mm512_set1_ps(inv[v]);
    PAGELLM_UNROLL
    for (int u = 0; u < NT; ++u) {
      __m512 r = _mm512_setzero_ps();
      PAGELLM_UNROLL
      for (int c = 0; c < A; ++c) {
        __m512 lo, hi;
        split(_mm512_castph_si512(acc[u][c][v]), lo, hi, tag);
        r = _mm512_add_ps(r, _mm512_add_ps(lo, hi));
      }
      _mm512_mask_storeu_ps(s + v * ns + t0 + 16 * u, m[u], _mm512_mul_ps(r, f));
    }
  }
}

// score_tile16 for nv vectors: groups of NV (16 accumulators), then the rest.
template <int NT, int NV = 16 / NT / kScoreSums>
inline void scores16_for(const int32_t* q16, int64_t D, const int32_t* kw, int64_t B, int64_t t0,
                         const __mmask16 (&m)[2], float* S, int64_t ns, int64_t nv, const float* inv) {
  if constexpr (NV > 0) {
    int64_t v = 0;
    for (; v + NV <= nv; v += NV) score_tile16<NV, NT>(q16 + v * D / 2, D, kw, B, t0, m, S + v * ns, ns, inv + v);
    if (v < nv) scores16_for<NT, NV - 1>(q16 + v * D / 2, D, kw, B, t0, m, S + v * ns, ns, nv - v, inv + v);
  }
}

// Causal softmax of each vector's scores (fp32, as softmax_rows), written as fp16 p * 2^14 into P over
// [klo, khi) rounded out to whole token pairs (zeros outside each row's range).
inline void softmax_rows16(const Args& a, const Task& t, const Span& s, float* S, uint16_t* P) {
  const int64_t base = s.b0 * a.B;
  const int64_t lo2 = s.klo & ~int64_t{1}, hi2 = std::min(base + s.ns, (s.khi + 1) & ~int64_t{1});
  const __m512 scale = _mm512_set1_ps(kPScale);
  for (int64_t i = 0; i < t.nrows; ++i) {
    const int64_t p = s.p0 + i, lo = key_lo(a, t.r, p);
    for (int64_t g = 0; g < a.G; ++g) {
      float* row = S + (i * a.G + g) * s.ns - base;  // row[token]
      uint16_t* prow = P + (i * a.G + g) * s.ns - base;
      const float lse = softmax_range(row, lo, p + 1);
      if (a.lse) a.lse[(a.qs[t.r] + t.i0 + i) * a.lse_s0 + t.h * a.G + g] = lse;
      std::fill(prow + lo2, prow + lo, uint16_t{0});
      std::fill(prow + p + 1, prow + hi2, uint16_t{0});
      int64_t k = lo;
      for (; k + 16 <= p + 1; k += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + k),
                            _mm512_cvtps_ph(_mm512_mul_ps(_mm512_loadu_ps(row + k), scale), _MM_FROUND_TO_NEAREST_INT));
      for (; k <= p; ++k) prow[k] = c10::Half(row[k] * kPScale).x;
    }
  }
}

// out[v] (fp32, D = 16 * C) += the fp16 sums acc[v] times f; the sums restart at 0.
template <int NV, int C>
PAGELLM_INLINE void flush16(__m512h (&acc)[NV][C], float* out, int64_t D, __m512 f) {
  const c10::Half* tag = nullptr;
  PAGELLM_UNROLL
  for (int v = 0; v < NV; ++v)
    PAGELLM_UNROLL
    for (int c = 0; c < C; ++c) {
      __m512 lo, hi;
      split(_mm512_castph_si512(acc[v][c]), lo, hi, tag);
      float* o = out + v * D + 16 * c;
      _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_add_ps(lo, hi), f, _mm512_loadu_ps(o)));
      acc[v][c] = _mm512_setzero_ph();
    }
}

// Weighted sums of vectors [v0, v0 + NV) over their keys, block by block, from the staged fp16 values -> of.
template <int NV, int C>
inline void values16_for(const Staged16& st, const Task& t, const Span& s, const uint16_t* P, int64_t v0,
                         float* of) {
  const Args& a = st.a;
  constexpr int64_t D = 16 * C;
  constexpr int kFlushSteps = 32;  // token pairs per lane between flushes
  const __m512 f = _mm512_set1_ps(st.vinv[t.r * a.Hkv + t.h] / kPScale);
  std::fill(of + v0 * D, of + (v0 + NV) * D, 0.f);
  __m512h acc[NV][C];
  PAGELLM_UNROLL
  for (int v = 0; v < NV; ++v)
    PAGELLM_UNROLL
    for (int c = 0; c < C; ++c) acc[v][c] = _mm512_setzero_ph();
  int steps = 0;
  const int64_t base = s.b0 * a.B;
  for (int64_t b = s.b0; b <= s.b1; ++b) {
    const int32_t* vw = reinterpret_cast<const int32_t*>(st.v + a.bt[t.r * a.MB + b] * a.v_sb + t.h * a.v_sh);
    const int64_t lo = std::max<int64_t>(0, s.klo - b * a.B), hi = std::min<int64_t>(a.B, s.khi - b * a.B);
    const uint16_t* pb = P + v0 * s.ns + b * a.B - base;
    for (int64_t i = lo / 2; 2 * i < hi; ++i) {
      __m512h val[C];
      PAGELLM_UNROLL
      for (int c = 0; c < C; ++c) val[c] = _mm512_castsi512_ph(_mm512_loadu_si512(vw + i * D + 16 * c));
      PAGELLM_UNROLL
      for (int v = 0; v < NV; ++v) {
        int32_t pp;
        std::memcpy(&pp, pb + v * s.ns + 2 * i, sizeof(pp));
        const __m512h pv = _mm512_castsi512_ph(_mm512_set1_epi32(pp));
        PAGELLM_UNROLL
        for (int c = 0; c < C; ++c) acc[v][c] = _mm512_fmadd_ph(pv, val[c], acc[v][c]);
      }
      if (++steps == kFlushSteps) flush16<NV, C>(acc, of + v0 * D, D, f), steps = 0;
    }
  }
  flush16<NV, C>(acc, of + v0 * D, D, f);
}

template <int C, int K>
inline void values16_tail(const Staged16& st, const Task& t, const Span& s, const uint16_t* P, int64_t v0,
                          int64_t rem, float* of) {
  if constexpr (K > 0) {
    if (rem == K) values16_for<K, C>(st, t, s, P, v0, of);
    else values16_tail<C, K - 1>(st, t, s, P, v0, rem, of);
  }
}

// One task on the staged copy: qf [nh * nv, D] (fp32, times the softmax scale) -> of (fp32). S, P: nh * nv * ns
// scores and probabilities; q16, qinv: nh * nv * D / 2 words and nh * nv floats of scratch.
template <int C>
void attend16(const Staged16& st, const Task& t, const float* qf, float* S, uint16_t* P, int32_t* q16, float* qinv,
              float* of) {
  const Args& a = st.a;
  const Span s = span_of(a, t);
  const int64_t nv = t.nrows * a.G, B = a.B;
  constexpr int64_t D = 16 * C;
  for (int64_t j = 0; j < t.nh; ++j)
    for (int64_t v = 0; v < nv; ++v) {
      const int64_t i = j * nv + v;
      qinv[i] = query_to_fp16(qf + i * D, D, q16 + i * D / 2) * st.kinv[t.r * a.Hkv + t.h + j];
    }
  for (int64_t b = s.b0; b <= s.b1; ++b)
    for (int64_t j = 0; j < t.nh; ++j) {
      const int32_t* kw = reinterpret_cast<const int32_t*>(st.k + a.bt[t.r * a.MB + b] * a.k_sb + (t.h + j) * a.k_sh);
      float* Sb = S + j * nv * s.ns + (b - s.b0) * B;
      for (int64_t t0 = 0; t0 < B; t0 += 32) {  // two tiles of 16 tokens at a time, or what the block has
        const __mmask16 m[2] = {static_cast<__mmask16>((1u << std::min<int64_t>(16, B - t0)) - 1),
                                static_cast<__mmask16>((1u << std::clamp<int64_t>(B - t0 - 16, 0, 16)) - 1)};
        if (B - t0 > 16) scores16_for<2>(q16 + j * nv * D / 2, D, kw, B, t0, m, Sb, s.ns, nv, qinv + j * nv);
        else scores16_for<1>(q16 + j * nv * D / 2, D, kw, B, t0, m, Sb, s.ns, nv, qinv + j * nv);
      }
    }
  constexpr int NV = values_per_pass(C);
  for (int64_t j = 0; j < t.nh; ++j) {
    const Task th = one_head(t, j);
    float* Sh = S + j * nv * s.ns;
    uint16_t* Ph = P + j * nv * s.ns;
    float* oh = of + j * nv * D;
    softmax_rows16(a, th, s, Sh, Ph);
    int64_t v = 0;
    for (; v + NV <= nv; v += NV) values16_for<NV, C>(st, th, s, Ph, v, oh);
    if (v < nv) values16_tail<C, NV - 1>(st, th, s, Ph, v, nv - v, oh);
  }
}

// attend16<D / 16>, or false where the head_dim has no vectorised kernel.
inline bool attend16_dims(const Staged16& st, const Task& t, const float* qf, float* S, uint16_t* P, int32_t* q16,
                          float* qinv, float* of) {
  switch (st.a.D) {
    case 16: attend16<1>(st, t, qf, S, P, q16, qinv, of); return true;
    case 32: attend16<2>(st, t, qf, S, P, q16, qinv, of); return true;
    case 64: attend16<4>(st, t, qf, S, P, q16, qinv, of); return true;
    case 96: attend16<6>(st, t, qf, S, P, q16, qinv, of); return true;
    case 128: attend16<8>(st, t, qf, S, P, q16, qinv, of); return true;
    case 256: attend16<16>(st, t, qf, S, P, q16, qinv, of); return true;
    default: return false;
  }
}

#endif

}  // namespace pagellm::paged
