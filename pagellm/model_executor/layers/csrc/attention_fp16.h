// fp16 partial sums in the paged-attention kernel (EngineConfig.reduced_precision_reduction, CPUs with
// AVX512-FP16): prefill chunks of bf16/fp16 queries over a bf16, fp16 or fp8 cache.
//
// Why: without AMX, long prompts spend most of their time here (long_mix_32: 54 of 77 s), in fp32 FMAs. An fp16
// FMA does 32 lanes for the fp32 one's 16 at the same rate, and the fp32 path also spends an instruction or two
// per 16 elements widening bf16.
//
// How: once per call, each staged request's blocks are copied into fp16 in the 16-bit cache layout, pairs in
// 32-bit words: K [D/2, B, 2] (dims 2j, 2j+1 of a token), V [B/2, D, 2] (tokens 2i, 2i+1 of a dim), times a power
// of two per (request, kv head) that puts K's and V's largest |value| in [0.5, 1) (bf16 and fp8 values convert
// exactly; slots past the context are zeroed). A task then:
//   - q.k: each query vector is scaled by a power of two to a largest |value| below 2^(15 - log2(D / 4)), in fp16;
//     one 32-bit broadcast of a q pair (q_2j, q_2j+1) times a K pair row (16 tokens) is one FMA. Two accumulators
//     (even / odd j) each sum D / 4 products per lane, below 2^15: no input overflows fp16. The four sums of a
//     score (two accumulators, two lanes) join in fp32, where the scales are undone (exactly), and the tiles
//     inside every row's range keep the rows' running maximum.
//   - softmax in fp32, left unnormalised: P = exp(s - max) * 2^10 <= 2^10 in fp16, by a degree-4 exp.
//   - p.v: one 32-bit broadcast of (p_2i, p_2i+1) times a V pair row (16 dims) is one FMA. Every 32 pairs the fp16
//     sums (below 32 * 2^10 per lane) join fp32 ones, still a lane per token parity; the parities join at the end,
//     where 1 / the row's sum and V's scale come in.
// Why 32-bit broadcasts: a vpbroadcastw is a load and a shuffle on a port the FMAs need, where a vpbroadcastd is a
// plain load (register loops, bench/fma_broadcast.cpp: 0.63x the FMA rate against 0.9-1.0x).
// `python bench/kernels.py` ("prefill attention sums"), SmolLM2's heads (9 q, 3 kv, 64 dims), 2,048-row chunks
// after 0-4,096 tokens: 1.6-1.8x faster than the fp32 sums (the layout of 16-bit broadcasts before: 1.3-1.6x);
// mean error against fp64 1.35x theirs (both mostly the output's bf16 rounding).
// The staging costs two reads and one write of the context per call; the kernel reads each element once per
// group of query vectors, so only chunks of at least kFp16MinRows rows take this path (decode rows never).
#pragma once

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <limits>
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
// P in fp16 is exp(s - max) * 2^10 (<= 2^10): kFlushPairs of them times a V below 1 stay below 2^15 in a lane.
constexpr float kExpScale = 1024.f;
constexpr int kFlushPairs = 32;  // token pairs per fp16 sum of p.v before it joins the fp32 output
static_assert(kFlushPairs * kExpScale <= 32768.f, "p.v partial sums could overflow fp16");
// The score tile: kScoreGroups groups of 16 tokens, kScoreAccumulators registers of sums in all.
constexpr int kScoreGroups = 4;
constexpr int kScoreAccumulators = 24;
// Query vectors per pass of the value loop: NV x C2 accumulators (C2 = D / 16) of 16 dims x 2 tokens each.
constexpr int values16_per_pass(int64_t C2) { return C2 >= 16 ? 1 : static_cast<int>(std::min<int64_t>(8, 24 / C2)); }

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

// One (block, kv head) of the cache into the staged fp16 layout, times ks / vs: pairs in 32-bit words, K [D/2, B, 2]
// (dims 2j, 2j+1 of a token), V [B/2, D, 2] (tokens 2i, 2i+1 of a dim). That is a 16-bit cache's own layout, so
// bf16 / fp16 convert element for element; fp8 (4 per word) splits each word row into two. Then the slots of
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
  for (int64_t j = 0; j < D / 2; ++j) std::memset(ko + (j * B + n) * 2, 0, (B - n) * 2 * sizeof(uint16_t));
  const int64_t first_empty = (n + 1) / 2;  // V pair rows wholly past the context
  std::memset(vo + first_empty * D * 2, 0, (B / 2 - first_empty) * D * 2 * sizeof(uint16_t));
  if (n % 2)
    for (int64_t d = 0; d < D; ++d) vo[((n / 2) * D + d) * 2 + 1] = 0;
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
  int sum_log2 = 0;  // ceil(log2(products per lane of one fp16 sum))
  while ((int64_t{1} << sum_log2) < D / 4) ++sum_log2;
  __m512 vm = _mm512_setzero_ps();  // D is a multiple of 32 (fp16_dims)
  for (int64_t d = 0; d < D; d += 16) vm = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(f + d)), vm);
  const float m = _mm512_reduce_max_ps(vm);
  const float s = m > 0.f && std::isfinite(m) ? std::ldexp(unit_scale(m), 15 - sum_log2) : 1.f;
  for (int64_t d = 0; d < D; d += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d),
                        _mm512_cvtps_ph(_mm512_mul_ps(_mm512_loadu_ps(f + d), _mm512_set1_ps(s)), _MM_FROUND_TO_NEAREST_INT));
  return 1.f / s;
}

// The 32-bit word at p (an fp16 pair) in every lane: a plain load (vpbroadcastd), where a vpbroadcastw would also
// take a shuffle port, which the FMAs need.
PAGELLM_INLINE __m512h pair_bcast(const void* p) {
  int32_t w;
  std::memcpy(&w, p, sizeof(w));
  return _mm512_castsi512_ph(_mm512_set1_epi32(w));
}

// The sums of lane pairs (2i, 2i + 1): x's 8 pairs, then y's, as 16 floats.
PAGELLM_INLINE __m512 pair_sums(__m512 x, __m512 y) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  return _mm512_add_ps(_mm512_permutex2var_ps(x, even, y), _mm512_permutex2var_ps(x, odd, y));
}

// Scores of NV query vectors (q16: D fp16 each) for T token groups of tw = min(B, 16) tokens (group u: the staged
// keys kp[u], K pair rows B words apart, lanes in m): s[v * ns + tw * u + lane], times inv[v]. A lane pair holds
// dims 2j and 2j + 1, in one of two accumulators (even / odd j), so that each lane sums D / 4 products in fp16
// (below 2^15 by q's scale); the four sums of a score join in fp32. The groups with bit u of cover (inside every
// vector's key range) also go into mx[v] (16 lanes per vector), the running maximum that the softmax would
// otherwise find in a pass of its own.
template <int NV, int T>
PAGELLM_INLINE void score_tile16(const _Float16* q16, int64_t D, const int32_t* const* kp, int64_t B, int64_t tw,
                                 __mmask16 m, float* s, int64_t ns, const float* inv, float* mx, unsigned cover) {
  __m512h acc[2][NV][T];
  PAGELLM_UNROLL
  for (int c = 0; c < 2; ++c)
    PAGELLM_UNROLL
    for (int v = 0; v < NV; ++v)
      PAGELLM_UNROLL
      for (int u = 0; u < T; ++u) acc[c][v][u] = _mm512_setzero_ph();
  for (int64_t j = 0; j < D / 2; j += 2)
    PAGELLM_UNROLL
    for (int c = 0; c < 2; ++c) {
      __m512h k[T];
      PAGELLM_UNROLL
      for (int u = 0; u < T; ++u) k[u] = _mm512_castsi512_ph(_mm512_maskz_loadu_epi32(m, kp[u] + (j + c) * B));
      PAGELLM_UNROLL
      for (int v = 0; v < NV; ++v) {
        const __m512h qv = pair_bcast(q16 + v * D + 2 * (j + c));
        PAGELLM_UNROLL
        for (int u = 0; u < T; ++u) acc[c][v][u] = _mm512_fmadd_ph(qv, k[u], acc[c][v][u]);
      }
    }
  PAGELLM_UNROLL
  for (int v = 0; v < NV; ++v)
    PAGELLM_UNROLL
    for (int u = 0; u < T; ++u) {
      const __m512i x = _mm512_castph_si512(acc[0][v][u]), y = _mm512_castph_si512(acc[1][v][u]);
      // lanes (token, dim parity) of tokens 0-7, then 8-15
      const __m512 lo = _mm512_add_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(x)), _mm512_cvtph_ps(_mm512_castsi512_si256(y)));
      const __m512 hi = _mm512_add_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(x, 1)),
                                      _mm512_cvtph_ps(_mm512_extracti64x4_epi64(y, 1)));
      const __m512 r = _mm512_mul_ps(pair_sums(lo, hi), _mm512_set1_ps(inv[v]));
      _mm512_mask_storeu_ps(s + v * ns + tw * u, m, r);
      if (cover >> u & 1) _mm512_mask_storeu_ps(mx + 16 * v, m, _mm512_max_ps(r, _mm512_loadu_ps(mx + 16 * v)));
    }
}

// score_tile16 for nv vectors: groups of NV, then the rest.
template <int T, int NV>
inline void scores16_for(const _Float16* q16, int64_t D, const int32_t* const* kp, int64_t B, int64_t tw,
                         __mmask16 m, float* S, int64_t ns, int64_t nv, const float* inv, float* mx, unsigned cover) {
  if constexpr (NV > 0) {
    int64_t v = 0;
    for (; v + NV <= nv; v += NV)
      score_tile16<NV, T>(q16 + v * D, D, kp, B, tw, m, S + v * ns, ns, inv + v, mx + 16 * v, cover);
    if (v < nv)
      scores16_for<T, NV - 1>(q16 + v * D, D, kp, B, tw, m, S + v * ns, ns, nv - v, inv + v, mx + 16 * v, cover);
  }
}

// exp(x) * kExpScale for x <= 0, to a relative 2.7e-6 (fp16 keeps 2^-11): 2^n times a degree-4 fit of 2^f on
// [-0.5, 0.5] (weighted least squares), its coefficients times kExpScale. (exp16's degree 6 serves fp32 results.)
PAGELLM_INLINE __m512 scaled_exp16(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.009569944813847542f * kExpScale), f,
                             _mm512_set1_ps(0.055917445570230484f * kExpScale));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402474582195282f * kExpScale));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931218504905701f * kExpScale));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9999992847442627f * kExpScale));
  return _mm512_scalef_ps(p, n);
}

// Causal softmax of each vector's scores, as softmax_rows but left unnormalised: P (fp16) gets exp(s - max) *
// kExpScale over each row's range and zeros elsewhere in [klo, khi) rounded out to whole token pairs; inv_sum[v]
// gets 1 / the row's sum of P, which the value loop applies once per output. The maximum over keys [c0, c1) is
// mx's (from the score tiles); only the keys outside it are searched here.
inline void softmax_rows16(const Args& a, const Task& t, const Span& s, const float* S, uint16_t* P, float* inv_sum,
                           const float* mx, int64_t c0, int64_t c1) {
  const int64_t base = s.b0 * a.B;
  const int64_t lo2 = s.klo & ~int64_t{1}, hi2 = (s.khi + 1) & ~int64_t{1};
  for (int64_t i = 0; i < t.nrows; ++i) {
    const int64_t p = s.p0 + i, lo = key_lo(a, t.r, p);
    for (int64_t g = 0; g < a.G; ++g) {
      const int64_t v = i * a.G + g;
      const float* row = S + v * s.ns - base;  // row[token]
      uint16_t* prow = P + v * s.ns - base;
      const float m = c0 < c1 ? std::max({_mm512_reduce_max_ps(_mm512_loadu_ps(mx + 16 * v)), max_of(row + lo, c0 - lo),
                                          max_of(row + c1, p + 1 - c1)})
                              : max_of(row + lo, p + 1 - lo);
      const __m512 vm = _mm512_set1_ps(m);
      __m512 vsum = _mm512_setzero_ps();
      int64_t k = lo;
      for (; k + 16 <= p + 1; k += 16) {
        const __m512 e = scaled_exp16(_mm512_sub_ps(_mm512_loadu_ps(row + k), vm));
        vsum = _mm512_add_ps(vsum, e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + k), _mm512_cvtps_ph(e, _MM_FROUND_TO_NEAREST_INT));
      }
      if (k <= p) {  // the last < 16 keys, masked
        const __mmask16 mk = static_cast<__mmask16>((1u << (p + 1 - k)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(mk, scaled_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, row + k), vm)));
        vsum = _mm512_add_ps(vsum, e);
        _mm256_mask_storeu_epi16(prow + k, mk, _mm512_cvtps_ph(e, _MM_FROUND_TO_NEAREST_INT));
      }
      const float sum = _mm512_reduce_add_ps(vsum);
      inv_sum[v] = 1.f / sum;
      if (a.lse) a.lse[(a.qs[t.r] + t.i0 + i) * a.lse_s0 + t.h * a.G + g] = m + std::log(sum / kExpScale);
      std::fill(prow + lo2, prow + lo, uint16_t{0});
      std::fill(prow + p + 1, prow + hi2, uint16_t{0});
    }
  }
}

// oi[v] (fp32, 2D: dim d's token-pair lanes at 2d and 2d + 1) += the fp16 sums acc[v]; the sums restart at 0.
template <int NV, int C2>
PAGELLM_INLINE void flush16(__m512h (&acc)[NV][C2], float* oi) {
  constexpr int64_t D = 16 * C2;
  PAGELLM_UNROLL
  for (int v = 0; v < NV; ++v)
    PAGELLM_UNROLL
    for (int c = 0; c < C2; ++c) {
      const __m512i w = _mm512_castph_si512(acc[v][c]);
      float* o = oi + v * 2 * D + 32 * c;
      _mm512_storeu_ps(o, _mm512_add_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(w)), _mm512_loadu_ps(o)));
      _mm512_storeu_ps(o + 16, _mm512_add_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(w, 1)), _mm512_loadu_ps(o + 16)));
      acc[v][c] = _mm512_setzero_ph();
    }
}

// Weighted sums of vectors [v0, v0 + NV) over their keys, block by block, from the staged values (token pairs of
// 16 dims per vector) -> of. One 32-bit broadcast of (p_2i, p_2i+1) times a V pair row feeds C2 FMAs; each lane
// pair sums its two tokens' products apart until the end, in fp32 (oi).
template <int NV, int C2>
inline void values16_for(const Staged16& st, const Task& t, const Span& s, const uint16_t* P, const float* inv_sum,
                         int64_t v0, float* of) {
  const Args& a = st.a;
  constexpr int64_t D = 16 * C2;
  alignas(64) float oi[NV * 2 * D];
  std::fill(oi, oi + NV * 2 * D, 0.f);
  __m512h acc[NV][C2];
  PAGELLM_UNROLL
  for (int v = 0; v < NV; ++v)
    PAGELLM_UNROLL
    for (int c = 0; c < C2; ++c) acc[v][c] = _mm512_setzero_ph();
  int steps = 0;
  const int64_t base = s.b0 * a.B;
  for (int64_t b = s.b0; b <= s.b1; ++b) {
    const int32_t* vw = reinterpret_cast<const int32_t*>(st.v + a.bt[t.r * a.MB + b] * a.v_sb + t.h * a.v_sh);
    const int64_t lo = std::max<int64_t>(0, s.klo - b * a.B), hi = std::min<int64_t>(a.B, s.khi - b * a.B);
    const uint16_t* pb = P + v0 * s.ns + b * a.B - base;
    for (int64_t i = lo / 2; 2 * i < hi; ++i) {
      __m512h val[C2];
      PAGELLM_UNROLL
      for (int c = 0; c < C2; ++c) val[c] = _mm512_castsi512_ph(_mm512_loadu_si512(vw + i * D + 16 * c));
      PAGELLM_UNROLL
      for (int v = 0; v < NV; ++v) {
        const __m512h pv = pair_bcast(pb + v * s.ns + 2 * i);
        PAGELLM_UNROLL
        for (int c = 0; c < C2; ++c) acc[v][c] = _mm512_fmadd_ph(pv, val[c], acc[v][c]);
      }
      if (++steps == kFlushPairs) flush16<NV, C2>(acc, oi), steps = 0;
    }
  }
  flush16<NV, C2>(acc, oi);
  // Each dim's two lanes (even / odd tokens) join; 1 / the row's sum and V's scale come in.
  for (int v = 0; v < NV; ++v) {
    const __m512 f = _mm512_set1_ps(st.vinv[t.r * a.Hkv + t.h] * inv_sum[v0 + v]);
    for (int c = 0; c < C2; ++c) {
      const __m512 x = _mm512_load_ps(oi + v * 2 * D + 32 * c), y = _mm512_load_ps(oi + v * 2 * D + 32 * c + 16);
      _mm512_storeu_ps(of + (v0 + v) * D + 16 * c, _mm512_mul_ps(pair_sums(x, y), f));
    }
  }
}

template <int C2, int K>
inline void values16_tail(const Staged16& st, const Task& t, const Span& s, const uint16_t* P,
                          const float* inv_sum, int64_t v0, int64_t rem, float* of) {
  if constexpr (K > 0) {
    if (rem == K) values16_for<K, C2>(st, t, s, P, inv_sum, v0, of);
    else values16_tail<C2, K - 1>(st, t, s, P, inv_sum, v0, rem, of);
  }
}

// One task on the staged copy: qf [nh * nv, D] (fp32, times the softmax scale) -> of (fp32). S, P: nh * nv * ns
// scores and probabilities; q16, qinv: nh * nv * D fp16 and nh * nv floats of scratch.
template <int C2>
void attend16(const Staged16& st, const Task& t, const float* qf, float* S, uint16_t* P, _Float16* q16, float* qinv,
              float* of) {
  const Args& a = st.a;
  const Span s = span_of(a, t);
  const int64_t nv = t.nrows * a.G, B = a.B;
  constexpr int64_t D = 16 * C2;
  for (int64_t j = 0; j < t.nh; ++j)
    for (int64_t v = 0; v < nv; ++v) {
      const int64_t i = j * nv + v;
      qinv[i] = query_to_fp16(qf + i * D, D, q16 + i * D) * st.kinv[t.r * a.Hkv + t.h + j];
    }
  // The span's keys in groups of tw tokens (16, or a whole block of 8): kp[u] for group u.
  const int64_t tw = std::min<int64_t>(B, 16), groups = s.ns / tw;
  const __mmask16 m = static_cast<__mmask16>((1u << tw) - 1);
  // Groups [g0, g1) lie inside every row's keys, [L, p0]: their scores feed the maximum as they are made.
  const int64_t L = key_lo(a, t.r, s.p0 + t.nrows - 1), base = s.b0 * B;
  const int64_t g0 = (std::max(L, base) - base + tw - 1) / tw, g1 = std::max(g0, (s.p0 + 1 - base) / tw);
  thread_local std::vector<const int32_t*> kp;
  thread_local std::vector<float> mx;
  kp.resize(groups);
  mx.assign(t.nh * nv * 16, -std::numeric_limits<float>::infinity());
  auto cover = [&](int64_t u, int n) {  // bits of groups u .. u + n - 1 inside [g0, g1)
    unsigned c = 0;
    for (int i = 0; i < n; ++i) c |= (u + i >= g0 && u + i < g1 ? 1u : 0u) << i;
    return c;
  };
  for (int64_t j = 0; j < t.nh; ++j) {
    for (int64_t u = 0; u < groups; ++u) {
      const int64_t b = s.b0 + u * tw / B;
      kp[u] = reinterpret_cast<const int32_t*>(st.k + a.bt[t.r * a.MB + b] * a.k_sb + (t.h + j) * a.k_sh) +
              u * tw % B;
    }
    constexpr int T = kScoreGroups, NV = kScoreAccumulators / (2 * T);
    float* Sj = S + j * nv * s.ns;
    float* mxj = mx.data() + j * nv * 16;
    int64_t u = 0;
    for (; u + T <= groups; u += T)
      scores16_for<T, NV>(q16 + j * nv * D, D, kp.data() + u, B, tw, m, Sj + u * tw, s.ns, nv, qinv + j * nv, mxj,
                          cover(u, T));
    for (; u < groups; ++u)
      scores16_for<1, NV>(q16 + j * nv * D, D, kp.data() + u, B, tw, m, Sj + u * tw, s.ns, nv, qinv + j * nv, mxj,
                          cover(u, 1));
  }
  constexpr int NV = values16_per_pass(C2);
  for (int64_t j = 0; j < t.nh; ++j) {
    const Task th = one_head(t, j);
    float* Sh = S + j * nv * s.ns;
    uint16_t* Ph = P + j * nv * s.ns;
    float* oh = of + j * nv * D;
    float* inv_sum = qinv;  // free once the scores are done
    softmax_rows16(a, th, s, Sh, Ph, inv_sum, mx.data() + j * nv * 16, base + g0 * tw, base + g1 * tw);
    int64_t v = 0;
    for (; v + NV <= nv; v += NV) values16_for<NV, C2>(st, th, s, Ph, inv_sum, v, oh);
    if (v < nv) values16_tail<C2, NV - 1>(st, th, s, Ph, inv_sum, v, nv - v, oh);
  }
}

// Whether a head_dim has the fp16 kernel (a multiple of 32: a V pair row is D / 16 vectors, q converts 16 at a time).
constexpr bool fp16_dims(int64_t D) { return D == 32 || D == 64 || D == 96 || D == 128 || D == 256; }

// attend16<D / 16>; false where the head_dim has no fp16 kernel.
inline bool attend16_dims(const Staged16& st, const Task& t, const float* qf, float* S, uint16_t* P, _Float16* q16,
                          float* qinv, float* of) {
  switch (st.a.D) {
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
