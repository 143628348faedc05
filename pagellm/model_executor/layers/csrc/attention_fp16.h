// fp16 partial sums in the paged-attention kernel (EngineConfig.reduced_precision_reduction, CPUs with
// AVX512-FP16): prefill chunks of bf16/fp16 queries over a bf16, fp16 or fp8 cache.
//
// Why: without AMX, long prompts spend most of their time here (long_mix_32: 54 of 77 s), in fp32 FMAs. An fp16
// FMA does 32 lanes for the fp32 one's 16 at the same rate, and the fp32 path also spends an instruction or two
// per 16 elements widening bf16.
//
// How: once per call, each staged request's blocks are copied into fp16, K dim-major [D, B] and V token-major
// [B, D] per (block, kv head), times a power of two per (request, kv head) that puts K's and V's largest |value|
// in [0.5, 1) (bf16 and fp8 values convert exactly; slots past the context are zeroed). A task then:
//   - q.k: each query vector is scaled by a power of two to a largest |value| below 2^(15 - log2(D / 4)), in fp16;
//     one FMA multiplies a dim of 32 tokens' keys by that dim of q (an embedded broadcast). Four accumulators
//     per vector (dims d mod 4) each sum D / 4 products per lane, below 2^15: no input overflows fp16. The sums
//     join in fp32, where the scales are undone (exactly).
//   - softmax in fp32 as before, left unnormalised: P = exp(s - max) <= 1 goes into fp16 times 2^10.
//   - p.v: one FMA multiplies a token's 32 dims by its p (an embedded broadcast). Every 32 tokens the fp16 sums
//     (below 32 * 2^10) join the fp32 output, which takes 1 / the row's sum and V's scale at the end.
// `python bench/kernels.py` ("prefill attention sums"), SmolLM2's heads (9 q, 3 kv, 64 dims), 2,048-row chunks
// after 0-6,144 tokens: 1.2-1.6x faster than the fp32 sums; mean error against fp64 1.35x theirs (both mostly the
// output's bf16 rounding).
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

#if defined(__AVX512FP16__)
constexpr bool kHasFp16Attention = true;
#else
constexpr bool kHasFp16Attention = false;
#endif

// Rows a request's chunk needs for its tasks to take the fp16 path over a 16-bit cache.
constexpr int64_t kFp16MinRows = 16;
// P in fp16 is exp(s - max) * 2^10 (<= 2^10): kFlushTokens of them times a V below 1 stay below 2^15.
constexpr float kExpScale = 1024.f;
// Accumulators per query vector in q.k (2: 1.55x the fp32 path's error against fp64 in the case above, 4: 1.35x,
// at the same speed).
constexpr int kScoreSums = 4;
constexpr int kFlushTokens = 32;  // tokens per fp16 sum of p.v before it joins the fp32 output
static_assert(kFlushTokens * kExpScale <= 32768.f, "p.v partial sums could overflow fp16");
// Query vectors per pass of the value loop: NV x C accumulators (C = D / 32) of 32 dims each.
constexpr int values16_per_pass(int64_t C) { return C >= 4 ? (C >= 8 ? 2 : 4) : 8; }

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

// 16 floats times s into fp16 at p (lanes in m).
PAGELLM_INLINE void store_half(uint16_t* p, __m512 v, __m512 s, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtps_ph(_mm512_mul_ps(v, s), _MM_FROUND_TO_NEAREST_INT));
}

// One (block, kv head) of the cache (x elements per word) into the staged fp16 layout, times ks / vs: K dim-major
// [D, B] (a dim of 32 tokens is one vector), V token-major [B, D] (a token's dims are D / 32 vectors). A cache
// word row holds x dims of B tokens (K) or x tokens of D dims (V); split / fp8_lane take it apart. Then the slots
// of tokens n .. B-1 are zeroed: they may hold anything, and a p of 0 times a NaN there would be NaN.
template <typename KV>
void block_to_fp16(const KV* kb, const KV* vb, uint16_t* ko, uint16_t* vo, int64_t n, int64_t B, int64_t D,
                   float ks, float vs) {
  constexpr int x = pack_x<KV>();
  const KV* tag = nullptr;
  const __m512 sk = _mm512_set1_ps(ks * fp8_read_scale<KV>()), sv = _mm512_set1_ps(vs * fp8_read_scale<KV>());
  const int32_t* kw = reinterpret_cast<const int32_t*>(kb);
  const int32_t* vw = reinterpret_cast<const int32_t*>(vb);
  auto parts = [&](__m512i w, __m512 (&e)[x]) {
    if constexpr (x == 2) {
      split(w, e[0], e[1], tag);
    } else {
      e[0] = fp8_lane<0>(w, tag), e[1] = fp8_lane<1>(w, tag), e[2] = fp8_lane<2>(w, tag), e[3] = fp8_lane<3>(w, tag);
    }
  };
  __m512 e[x];
  for (int64_t j = 0; j < D / x; ++j)
    for (int64_t t0 = 0; t0 < B; t0 += 16) {
      const __mmask16 m = static_cast<__mmask16>((1u << std::min<int64_t>(16, B - t0)) - 1);
      parts(_mm512_maskz_loadu_epi32(m, kw + j * B + t0), e);
      PAGELLM_UNROLL
      for (int u = 0; u < x; ++u) store_half(ko + (x * j + u) * B + t0, e[u], sk, m);
    }
  for (int64_t i = 0; i < B / x; ++i)
    for (int64_t d = 0; d < D; d += 16) {
      parts(_mm512_loadu_si512(vw + i * D + d), e);
      PAGELLM_UNROLL
      for (int u = 0; u < x; ++u) store_half(vo + (x * i + u) * D + d, e[u], sv, 0xFFFF);
    }
  if (n == B) return;
  for (int64_t d = 0; d < D; ++d) std::memset(ko + d * B + n, 0, (B - n) * sizeof(uint16_t));
  std::memset(vo + n * D, 0, (B - n) * D * sizeof(uint16_t));
}

// Fills st for the requests with want[r] (st.on stays empty when none has). The copy lives in per-thread buffers
// that keep their size between calls, so a step's layers do not each map and fault in fresh pages. The copy is
// head-major: one kv head's blocks of a request lie one after another, one stream for a task to read.
template <typename KV>
void stage_fp16(const Args& a, const std::vector<char>& want, const KV* kc, const KV* vc, Staged16& st) {
  thread_local std::vector<uint16_t> kbuf, vbuf;
  thread_local std::vector<int64_t> table;
  const int64_t R = static_cast<int64_t>(want.size());
  const auto blocks = staged_blocks(a, want, table);
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
  st.kinv.resize(R * a.Hkv), st.vinv.resize(R * a.Hkv);
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

// Query vector f [D] (fp32) as D fp16, times a power of two that bounds the score sums (see the file's comment);
// returns what undoes it.
inline float query_to_fp16(const float* f, int64_t D, _Float16* out) {
  int lanes_log2 = 0;  // ceil(log2(D / kScoreSums)): products per lane of one accumulator
  while ((int64_t{1} << lanes_log2) < D / kScoreSums) ++lanes_log2;
  float m = 0.f;
  for (int64_t d = 0; d < D; ++d) m = std::max(m, std::fabs(f[d]));
  const float s = m > 0.f && std::isfinite(m) ? std::ldexp(unit_scale(m), 15 - lanes_log2) : 1.f;
  for (int64_t d = 0; d < D; ++d) out[d] = static_cast<_Float16>(f[d] * s);
  return 1.f / s;
}

// Scores of NV query vectors (q16: D fp16 each) for up to 32 tokens (lanes in m) from token t0 of a block's
// dim-major keys kd: s[v * ns + t0 + lane], times inv[v]. Each FMA takes its q element by an embedded broadcast;
// A accumulators per vector (dims d = c mod A) keep D / A products per lane.
template <int NV>
PAGELLM_INLINE void score_tile16(const _Float16* q16, int64_t D, const uint16_t* kd, int64_t B, int64_t t0,
                                 __mmask32 m, float* s, int64_t ns, const float* inv) {
  constexpr int A = kScoreSums;
  __m512h acc[A][NV];
  PAGELLM_UNROLL
  for (int c = 0; c < A; ++c)
    PAGELLM_UNROLL
    for (int v = 0; v < NV; ++v) acc[c][v] = _mm512_setzero_ph();
  const uint16_t* k0 = kd + t0;
  for (int64_t d = 0; d < D; d += A)
    PAGELLM_UNROLL
    for (int c = 0; c < A; ++c) {
      const __m512h k = _mm512_castsi512_ph(_mm512_maskz_loadu_epi16(m, k0 + (d + c) * B));
      PAGELLM_UNROLL
      for (int v = 0; v < NV; ++v) acc[c][v] = _mm512_fmadd_ph(_mm512_set1_ph(q16[v * D + d + c]), k, acc[c][v]);
    }
  PAGELLM_UNROLL
  for (int v = 0; v < NV; ++v) {
    __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
    PAGELLM_UNROLL
    for (int c = 0; c < A; ++c) {
      const __m512i w = _mm512_castph_si512(acc[c][v]);
      lo = _mm512_add_ps(lo, _mm512_cvtph_ps(_mm512_castsi512_si256(w)));
      hi = _mm512_add_ps(hi, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(w, 1)));
    }
    const __m512 f = _mm512_set1_ps(inv[v]);
    _mm512_mask_storeu_ps(s + v * ns + t0, static_cast<__mmask16>(m), _mm512_mul_ps(lo, f));
    _mm512_mask_storeu_ps(s + v * ns + t0 + 16, static_cast<__mmask16>(m >> 16), _mm512_mul_ps(hi, f));
  }
}

// score_tile16 for nv vectors: groups of NV (16 accumulators), then the rest.
template <int NV = 16 / kScoreSums>
inline void scores16_for(const _Float16* q16, int64_t D, const uint16_t* kd, int64_t B, int64_t t0, __mmask32 m,
                         float* S, int64_t ns, int64_t nv, const float* inv) {
  if constexpr (NV > 0) {
    int64_t v = 0;
    for (; v + NV <= nv; v += NV) score_tile16<NV>(q16 + v * D, D, kd, B, t0, m, S + v * ns, ns, inv + v);
    if (v < nv) scores16_for<NV - 1>(q16 + v * D, D, kd, B, t0, m, S + v * ns, ns, nv - v, inv + v);
  }
}

// Causal softmax of each vector's scores, as softmax_rows but left unnormalised: P (fp16) gets exp(s - max) *
// kExpScale over each row's range and zeros elsewhere in [klo, khi); inv_sum[v] gets 1 / the row's sum, which
// the value loop applies once per output. (Two passes over the scores instead of four.)
inline void softmax_rows16(const Args& a, const Task& t, const Span& s, const float* S, uint16_t* P, float* inv_sum) {
  const int64_t base = s.b0 * a.B;
  for (int64_t i = 0; i < t.nrows; ++i) {
    const int64_t p = s.p0 + i, lo = key_lo(a, t.r, p);
    for (int64_t g = 0; g < a.G; ++g) {
      const int64_t v = i * a.G + g;
      const float* row = S + v * s.ns - base;  // row[token]
      uint16_t* prow = P + v * s.ns - base;
      const float m = max_of(row + lo, p + 1 - lo);
      const __m512 vm = _mm512_set1_ps(m), scale = _mm512_set1_ps(kExpScale);
      __m512 vsum = _mm512_setzero_ps();
      int64_t k = lo;
      for (; k + 16 <= p + 1; k += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + k), vm));
        vsum = _mm512_add_ps(vsum, e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + k),
                            _mm512_cvtps_ph(_mm512_mul_ps(e, scale), _MM_FROUND_TO_NEAREST_INT));
      }
      float sum = _mm512_reduce_add_ps(vsum);
      for (; k <= p; ++k) {
        const float e = std::exp(row[k] - m);
        sum += e;
        prow[k] = c10::Half(e * kExpScale).x;
      }
      inv_sum[v] = 1.f / sum;
      if (a.lse) a.lse[(a.qs[t.r] + t.i0 + i) * a.lse_s0 + t.h * a.G + g] = m + std::log(sum);
      std::fill(prow + s.klo, prow + lo, uint16_t{0});
      std::fill(prow + p + 1, prow + s.khi, uint16_t{0});
    }
  }
}

// out[v] (fp32, D = 32 * C) += the fp16 sums acc[v] times fs[v]; the sums restart at 0.
template <int NV, int C>
PAGELLM_INLINE void flush16(__m512h (&acc)[NV][C], float* out, int64_t D, const __m512 (&fs)[NV]) {
  PAGELLM_UNROLL
  for (int v = 0; v < NV; ++v)
    PAGELLM_UNROLL
    for (int c = 0; c < C; ++c) {
      const __m512 f = fs[v];
      const __m512i w = _mm512_castph_si512(acc[v][c]);
      float* o = out + v * D + 32 * c;
      _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(w)), f, _mm512_loadu_ps(o)));
      _mm512_storeu_ps(o + 16,
                       _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(w, 1)), f, _mm512_loadu_ps(o + 16)));
      acc[v][c] = _mm512_setzero_ph();
    }
}

// Weighted sums of vectors [v0, v0 + NV) over their keys, block by block, from the staged token-major fp16
// values -> of. Each token's p (fp16) comes by an embedded broadcast.
template <int NV, int C>
inline void values16_for(const Staged16& st, const Task& t, const Span& s, const uint16_t* P, const float* inv_sum,
                         int64_t v0, float* of) {
  const Args& a = st.a;
  constexpr int64_t D = 32 * C;
  __m512 f[NV];
  PAGELLM_UNROLL
  for (int v = 0; v < NV; ++v) f[v] = _mm512_set1_ps(st.vinv[t.r * a.Hkv + t.h] / kExpScale * inv_sum[v0 + v]);
  std::fill(of + v0 * D, of + (v0 + NV) * D, 0.f);
  __m512h acc[NV][C];
  PAGELLM_UNROLL
  for (int v = 0; v < NV; ++v)
    PAGELLM_UNROLL
    for (int c = 0; c < C; ++c) acc[v][c] = _mm512_setzero_ph();
  int steps = 0;
  const int64_t base = s.b0 * a.B;
  for (int64_t b = s.b0; b <= s.b1; ++b) {
    const uint16_t* vt = st.v + a.bt[t.r * a.MB + b] * a.v_sb + t.h * a.v_sh;
    const int64_t lo = std::max<int64_t>(0, s.klo - b * a.B), hi = std::min<int64_t>(a.B, s.khi - b * a.B);
    const _Float16* pb = reinterpret_cast<const _Float16*>(P + v0 * s.ns + b * a.B - base);
    for (int64_t i = lo; i < hi; ++i) {
      __m512h val[C];
      PAGELLM_UNROLL
      for (int c = 0; c < C; ++c) val[c] = _mm512_castsi512_ph(_mm512_loadu_si512(vt + i * D + 32 * c));
      PAGELLM_UNROLL
      for (int v = 0; v < NV; ++v) {
        const __m512h pv = _mm512_set1_ph(pb[v * s.ns + i]);
        PAGELLM_UNROLL
        for (int c = 0; c < C; ++c) acc[v][c] = _mm512_fmadd_ph(pv, val[c], acc[v][c]);
      }
      if (++steps == kFlushTokens) flush16<NV, C>(acc, of + v0 * D, D, f), steps = 0;
    }
  }
  flush16<NV, C>(acc, of + v0 * D, D, f);
}

template <int C, int K>
inline void values16_tail(const Staged16& st, const Task& t, const Span& s, const uint16_t* P,
                          const float* inv_sum, int64_t v0, int64_t rem, float* of) {
  if constexpr (K > 0) {
    if (rem == K) values16_for<K, C>(st, t, s, P, inv_sum, v0, of);
    else values16_tail<C, K - 1>(st, t, s, P, inv_sum, v0, rem, of);
  }
}

// One task on the staged copy: qf [nh * nv, D] (fp32, times the softmax scale) -> of (fp32). S, P: nh * nv * ns
// scores and probabilities; q16, qinv: nh * nv * D fp16 and nh * nv floats of scratch.
template <int C>
void attend16(const Staged16& st, const Task& t, const float* qf, float* S, uint16_t* P, _Float16* q16, float* qinv,
              float* of) {
  const Args& a = st.a;
  const Span s = span_of(a, t);
  const int64_t nv = t.nrows * a.G, B = a.B;
  constexpr int64_t D = 32 * C;
  for (int64_t j = 0; j < t.nh; ++j)
    for (int64_t v = 0; v < nv; ++v) {
      const int64_t i = j * nv + v;
      qinv[i] = query_to_fp16(qf + i * D, D, q16 + i * D) * st.kinv[t.r * a.Hkv + t.h + j];
    }
  for (int64_t b = s.b0; b <= s.b1; ++b)
    for (int64_t j = 0; j < t.nh; ++j) {
      const uint16_t* kd = st.k + a.bt[t.r * a.MB + b] * a.k_sb + (t.h + j) * a.k_sh;
      float* Sb = S + j * nv * s.ns + (b - s.b0) * B;
      for (int64_t t0 = 0; t0 < B; t0 += 32) {
        const int64_t w = std::min<int64_t>(32, B - t0);
        const __mmask32 m = w == 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1u << w) - 1);
        scores16_for(q16 + j * nv * D, D, kd, B, t0, m, Sb, s.ns, nv, qinv + j * nv);
      }
    }
  constexpr int NV = values16_per_pass(C);
  for (int64_t j = 0; j < t.nh; ++j) {
    const Task th = one_head(t, j);
    float* Sh = S + j * nv * s.ns;
    uint16_t* Ph = P + j * nv * s.ns;
    float* oh = of + j * nv * D;
    float* inv_sum = qinv;  // free once the scores are done
    softmax_rows16(a, th, s, Sh, Ph, inv_sum);
    int64_t v = 0;
    for (; v + NV <= nv; v += NV) values16_for<NV, C>(st, th, s, Ph, inv_sum, v, oh);
    if (v < nv) values16_tail<C, NV - 1>(st, th, s, Ph, inv_sum, v, nv - v, oh);
  }
}

// Whether a head_dim has the fp16 kernel (a multiple of 32: a K row of 32 tokens, a V row of 32 dims per vector).
constexpr bool fp16_dims(int64_t D) { return D == 32 || D == 64 || D == 96 || D == 128 || D == 256; }

// attend16<D / 32>; false where the head_dim has no fp16 kernel.
inline bool attend16_dims(const Staged16& st, const Task& t, const float* qf, float* S, uint16_t* P, _Float16* q16,
                          float* qinv, float* of) {
  switch (st.a.D) {
    case 32: attend16<1>(st, t, qf, S, P, q16, qinv, of); return true;
    case 64: attend16<2>(st, t, qf, S, P, q16, qinv, of); return true;
    case 96: attend16<3>(st, t, qf, S, P, q16, qinv, of); return true;
    case 128: attend16<4>(st, t, qf, S, P, q16, qinv, of); return true;
    case 256: attend16<8>(st, t, qf, S, P, q16, qinv, of); return true;
    default: return false;
  }
}

#endif

}  // namespace pagellm::paged
