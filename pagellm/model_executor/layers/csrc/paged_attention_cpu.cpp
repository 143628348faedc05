// Paged attention for CPU: the KV-cache layout, the cache writer and one attention kernel for a whole step
// (prefill chunks and decode rows mixed), reading K/V in place from the blocks.
//
// Cache layout of one layer, with x = 4 / sizeof(T) elements per 32-bit word (2 for bf16/fp16, 1 for fp32):
//   k_cache [NB, Hkv, D/x, B, x]  one word row per pair of dims: dims (2j, 2j+1) of the block's B tokens
//   v_cache [NB, Hkv, B/x, D, x]  one word row per pair of tokens: tokens (2i, 2i+1) for all D dims
// With K "pair-major", q.k for 16 tokens is a chain of FMAs into one 16-lane accumulator (token i in lane i),
// so no per-token horizontal sum is needed; splitting a word into its two bf16 halves is a shift and a mask.
// With V "token-pair-major", one load feeds two tokens' weights into 16 output dims. Every (block, kv head)
// is one contiguous run of B*D elements for K and for V, which the hardware prefetcher streams well.
//
// paged_attention: q [T, H, D] (rows may be strided); request r owns rows query_start[r] .. query_start[r+1]-1,
// the last positions of its context of seq_lens[r] tokens held in block_tables[r]. A task is (request, kv
// head, up to 16 consecutive query rows), or with many requests (request, all kv heads, rows): it reads the
// keys and values once for all its rows and the G = H/Hkv query heads sharing each kv head (GQA), block by
// block, computes every score (fp32), a causal (and sliding-window) softmax
// per row, then the weighted sum of values (fp32). A decode row is simply a task of one row. Threads take
// tasks, largest first, from a shared counter. Requests with more than max_query_len rows are skipped: for long
// prefill chunks the caller's AMX-backed flash attention is faster than these FMA loops (measured crossover
// ~32 rows per request on this machine), so they are left to it.
// Cascade attention's suffix part: with kv_start, request r attends only to keys kv_start[r] onwards (the shared
// prefix before it is attended once for all requests, by prefix_attention_amx), and lse receives each row's
// log-sum-exp so the caller can merge the two parts.
// Tasks of at most 8 query vectors (decode rows) over a bf16 cache run on AMX tiles where the CPU has them
// (decode_attention_amx.h). With k_new / v_new / slot_mapping the call first writes this step's K/V rows into the
// cache, a decode row's inside its own tasks just before they read its blocks (kv_cache_write.h).
// fp16_sums (bf16/fp16 queries, CPUs with AVX512-FP16): prefill chunks run on an fp16 copy of their blocks with
// fp16 partial sums, attention_fp16.h. CPUs with AVX2 and FMA but no AVX-512: tasks over a bf16 cache take the
// same loops on 8-lane vectors, attention_avx2.h (other caches the portable loop). On AMD CPUs with AVX512-BF16
// (Args::dot) a bf16 cache's scores and weighted sums take VDPBF16PS, the probabilities rounded to bf16 for it.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <numeric>
#include <utility>
#include <vector>

#include "attention_avx2.h"
#include "attention_common.h"
#include "attention_fp16.h"
#include "decode_attention_amx.h"
#include "kv_cache_write.h"
#include "ops.h"
#include "paged_attention_task.h"
#include "split_work.h"

namespace {
using namespace pagellm;
using namespace pagellm::paged;

// fp8 requests whose tasks have more query vectors than one pass of the value loop takes (prefill chunks): the
// kernel reads every element once per group of vectors, and converting fp8 each time costs more than the
// multiply-adds it feeds. So their blocks are first converted once per call into bf16 (which holds every e4m3
// and e5m2 value exactly) in the bf16 layout, and their tasks run the bf16 kernel on that copy.
struct Staged {
  Args a;                            // addresses the copy: block table [R, MB] into it, its strides
  const c10::BFloat16 *k = nullptr, *v = nullptr;
  std::vector<char> on;              // per request: its tasks read the copy
};

inline bool wants_staging(const Args& a, int64_t qlen, int64_t max_query_len) {
  return qlen <= max_query_len && std::min(qlen, kTileRows) * a.G > values_per_pass(a.D / 16);
}

template <typename T>
void attend_generic(const Args& a, const Task& t, const float* qf, const T* kc, const T* vc, float* S,
                    float* of) {
  const Span s = span_of(a, t);
  const int64_t nv = t.nrows * a.G, D = a.D, B = a.B, base = s.b0 * B;
  for (int64_t tok = s.klo; tok < s.khi; ++tok) {
    const T* kb = kc + a.bt[t.r * a.MB + tok / B] * a.k_sb + t.h * a.k_sh;
    for (int64_t v = 0; v < nv; ++v) {
      float acc = 0.f;
      for (int64_t d = 0; d < D; ++d) acc += qf[v * D + d] * k_at(kb, B, tok % B, d);
      S[v * s.ns + tok - base] = acc;
    }
  }
  softmax_rows(a, t, s, S);
  std::fill(of, of + nv * D, 0.f);
  for (int64_t tok = s.klo; tok < s.khi; ++tok) {
    const T* vb = vc + a.bt[t.r * a.MB + tok / B] * a.v_sb + t.h * a.v_sh;
    for (int64_t v = 0; v < nv; ++v) {
      const float p = S[v * s.ns + tok - base];
      if (p == 0.f) continue;
      for (int64_t d = 0; d < D; ++d) of[v * D + d] += p * v_at(vb, D, tok % B, d);
    }
  }
}

#if defined(__AVX512F__)
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

// Weighted sums for vectors [v0, v0 + NV) over keys [klo, khi), block by block -> of (fp32). kDot: P holds S's
// bf16 pairs (softmax_rows' P16).
template <int NV, int C, typename T, bool kDot>
inline void values_for(const Args& a, const Task& t, const Span& s, const float* S, const int32_t* P, const T* vc,
                       int64_t v0, float* of, NextBlocks& ahead, int64_t per_block) {
  __m512 acc[NV][C];
  PAGELLM_UNROLL
  for (int v = 0; v < NV; ++v)
    PAGELLM_UNROLL
    for (int c = 0; c < C; ++c) acc[v][c] = _mm512_setzero_ps();
  for (int64_t b = s.b0; b <= s.b1; ++b) {
    const T* vb = vc + a.bt[t.r * a.MB + b] * a.v_sb + t.h * a.v_sh;
    const int64_t lo = std::max<int64_t>(0, s.klo - b * a.B), hi = std::min<int64_t>(a.B, s.khi - b * a.B);
    const int64_t at = v0 * s.ns + (b - s.b0) * a.B;
    pv_block<NV, C, T, kDot>(S + at, s.ns, vb, lo, hi, acc, kDot ? P + at / 2 : nullptr);
    ahead.issue(per_block);
  }
  const __m512 undo = _mm512_set1_ps(fp8_read_scale<T>());  // the values were read scaled down (fp8 e4m3)
  PAGELLM_UNROLL
  for (int v = 0; v < NV; ++v)
    PAGELLM_UNROLL
    for (int c = 0; c < C; ++c)
      _mm512_storeu_ps(of + (v0 + v) * 16 * C + 16 * c,
                       fp8_read_scale<T>() == 1.f ? acc[v][c] : _mm512_mul_ps(acc[v][c], undo));
}

// The last rem (< NV) vectors in one pass.
template <int C, typename T, bool kDot, int K>
inline void values_tail(const Args& a, const Task& t, const Span& s, const float* S, const int32_t* P, const T* vc,
                        int64_t v0, int64_t rem, float* of, NextBlocks& ahead, int64_t per_block) {
  if constexpr (K > 0) {
    if (rem == K) values_for<K, C, T, kDot>(a, t, s, S, P, vc, v0, of, ahead, per_block);
    else values_tail<C, T, kDot, K - 1>(a, t, s, S, P, vc, v0, rem, of, ahead, per_block);
  }
}

// kDot: qf holds q's bf16 pairs, unscaled (run_task; score_tile's kDot), and S has room after the task's scores
// for one head's probabilities as bf16 pairs (nv * ns / 2 words): the value pass runs on VDPBF16PS too, on the
// probabilities rounded to bf16 as SDPA's CPU flash kernel rounds them in bf16 (pv_pair_dot). ahead: the first
// blocks of the thread's next task, prefetched during the value pass.
template <int C, typename T, bool kDot>
void attend(const Args& a, const Task& t, const float* qf, const T* kc, const T* vc, float* S, float* of,
            NextBlocks& ahead) {
  const Span s = span_of(a, t);
  const int64_t nv = t.nrows * a.G, B = a.B, D = a.D;
  // Block by block, and within a block head by head: a block's kv heads lie next to each other, so a task over
  // all of them reads each block's keys as one run (and a request's consecutive blocks as one stream).
  for (int64_t b = s.b0; b <= s.b1; ++b)
    for (int64_t h = t.h; h < t.h + t.nh; ++h) {
      const int64_t j = h - t.h;
      const T* kb = kc + a.bt[t.r * a.MB + b] * a.k_sb + h * a.k_sh;
      // Pull the next block's keys and this block's values towards the core while the FMAs run.
      const char* kn = b < s.b1 ? reinterpret_cast<const char*>(kc + a.bt[t.r * a.MB + b + 1] * a.k_sb + h * a.k_sh)
                                : nullptr;
      const char* vb = reinterpret_cast<const char*>(vc + a.bt[t.r * a.MB + b] * a.v_sb + h * a.v_sh);
      float* Sb = S + j * nv * s.ns + (b - s.b0) * B;
      if (pack_x<T>() == 2 && B % 32 == 0 && nv <= 4) {  // decode rows (up to 4 query heads per kv head)
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
    softmax_rows(a, th, s, Sh, reinterpret_cast<uint16_t*>(P));
    int64_t v = 0;
    for (; v + NV <= nv; v += NV) values_for<NV, C, T, kDot>(a, th, s, Sh, P, vc, v, oh, ahead, per_block);
    if (v < nv) values_tail<C, T, kDot, NV - 1>(a, th, s, Sh, P, vc, v, nv - v, oh, ahead, per_block);
  }
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

// (bits of a) >> 16 | (bits of b) & 0xffff0000: two fp32 values that bf16 holds exactly, as one word of bf16.
inline __m512i pack_bf16(__m512 lo, __m512 hi) {
  return _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(lo), 16),
                         _mm512_and_si512(_mm512_castps_si512(hi), _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// One (block, kv head) of fp8 into bf16: K word row j (dims 4j .. 4j+3 of B tokens) -> rows 2j, 2j + 1; V word
// row i (tokens 4i .. 4i+3, D dims) -> rows 2i, 2i + 1.
template <typename KV>
void fp8_block_to_bf16(const int32_t* kw, const int32_t* vw, int32_t* ko, int32_t* vo, int64_t B, int64_t D) {
  const KV* tag = nullptr;
  const __m512 undo = _mm512_set1_ps(fp8_read_scale<KV>());
  auto lanes = [&](__m512i w, __m512 (&e)[4]) {
    e[0] = _mm512_mul_ps(fp8_lane<0>(w, tag), undo), e[1] = _mm512_mul_ps(fp8_lane<1>(w, tag), undo);
    e[2] = _mm512_mul_ps(fp8_lane<2>(w, tag), undo), e[3] = _mm512_mul_ps(fp8_lane<3>(w, tag), undo);
  };
  __m512 e[4];
  for (int64_t j = 0; j < D / 4; ++j)
    for (int64_t t0 = 0; t0 < B; t0 += 16) {
      const __mmask16 m = static_cast<__mmask16>((1u << std::min<int64_t>(16, B - t0)) - 1);
      lanes(_mm512_maskz_loadu_epi32(m, kw + j * B + t0), e);
      _mm512_mask_storeu_epi32(ko + 2 * j * B + t0, m, pack_bf16(e[0], e[1]));
      _mm512_mask_storeu_epi32(ko + (2 * j + 1) * B + t0, m, pack_bf16(e[2], e[3]));
    }
  for (int64_t i = 0; i < B / 4; ++i)
    for (int64_t d = 0; d < D; d += 16) {
      lanes(_mm512_loadu_si512(vw + i * D + d), e);
      _mm512_storeu_si512(vo + 2 * i * D + d, pack_bf16(e[0], e[1]));
      _mm512_storeu_si512(vo + (2 * i + 1) * D + d, pack_bf16(e[2], e[3]));
    }
}

// Fills st for the requests with want[r] (called when at least one has). The copy lives in per-thread buffers
// that keep their size between calls, so a step's 30 layers do not each map and fault in fresh pages.
template <typename KV>
void stage_requests(const Args& a, const std::vector<char>& want, const KV* kc, const KV* vc, Staged& st) {
  thread_local std::vector<c10::BFloat16> kbuf, vbuf;
  thread_local std::vector<int64_t> table;
  const auto blocks = staged_blocks(a, want, table);
  st.on = want;
  const int64_t per = a.B * a.D, n = static_cast<int64_t>(blocks.size()) * a.Hkv * per;
  if (static_cast<int64_t>(kbuf.size()) < n) kbuf.resize(n), vbuf.resize(n);
  // (the workers must not name the thread_locals: each would see its own, empty)
  c10::BFloat16* kout = kbuf.data();
  c10::BFloat16* vout = vbuf.data();
  at::parallel_for(0, static_cast<int64_t>(blocks.size()) * a.Hkv, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto [r, b] = blocks[i / a.Hkv];
      const int64_t h = i % a.Hkv, src = a.bt[r * a.MB + b];
      fp8_block_to_bf16<KV>(reinterpret_cast<const int32_t*>(kc + src * a.k_sb + h * a.k_sh),
                            reinterpret_cast<const int32_t*>(vc + src * a.v_sb + h * a.v_sh),
                            reinterpret_cast<int32_t*>(kout + i * per), reinterpret_cast<int32_t*>(vout + i * per),
                            a.B, a.D);
    }
  });
  st.a = a;
  st.a.bt = table.data();
  st.a.k_sb = st.a.v_sb = a.Hkv * per, st.a.k_sh = st.a.v_sh = per;
  st.k = kout, st.v = vout;
}
#endif

// true when the vectorised kernel covers this head_dim (else the portable path runs)
inline bool vectorised(int64_t D) {
#if defined(__AVX512F__)
  return D == 16 || D == 32 || D == 64 || D == 96 || D == 128 || D == 256;
#else
  return false;
#endif
}

// A worker's buffers, kept between its tasks.
struct Scratch {
  std::vector<float> qf, S, of, qinv;
  std::vector<uint16_t> P;
  std::vector<uint16_t> q16;  // fp16 bits
#if defined(PAGELLM_AMX_DECODE)
  AmxDecode amx;
#endif
};

// q, out: T; the cache: KV (T itself, or fp8). st: the requests read from a bf16 copy (see Staged); st16: the
// requests on the fp16 path, from its fp16 copy (attention_fp16.h). next: the thread's next task, or null.
template <typename T, typename KV>
void run_task(const Args& a, const Task& t, const T* qp, const KV* kc, const KV* vc, T* op, const Staged& st,
              const Staged16& st16, Scratch& w, const Task* next) {
  const Span s = span_of(a, t);
  const int64_t nv = t.nrows * a.G, D = a.D;
  w.of.resize(t.nh * nv * D);
  const int64_t row0 = a.qs[t.r] + t.i0;
  bool done = false;
#if defined(PAGELLM_AMX_DECODE)
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<KV, c10::BFloat16>)
    if (amx_decode_fits(a, nv)) {
      if (D == 64) attend_amx<2>(a, t, qp, kc, vc, w.of.data(), w.amx);
      else attend_amx<4>(a, t, qp, kc, vc, w.of.data(), w.amx);
      done = true;
    }
#endif
  w.qf.resize(t.nh * nv * D);
  w.S.resize(t.nh * nv * s.ns + nv * s.ns / 2);  // the scores, and with Args::dot one head's bf16 probabilities
  // fp8: a staged request's tasks run on the bf16 copy of its blocks; otherwise the vectorised kernel reads e4m3
  // keys scaled down (fp8_read_scale) and q takes the factor, exactly.
  const bool half = !st16.on.empty() && st16.on[t.r];
  const bool stage = !st.on.empty() && st.on[t.r];
  const float q_scale = a.scale * (vectorised(D) && !stage && !half ? fp8_read_scale<KV>() : 1.f);
  // the score dot products (Args::dot): qf then holds q's bf16 pairs as they are, at its even floats
  const bool dot = a.dot && !half && !stage && vectorised(D);
  // Head j of the task's kv heads holds its vectors j * nv .. j * nv + nv - 1 in qf, S and of.
  for (int64_t j = 0; j < t.nh && !done; ++j)
    for (int64_t i = 0; i < t.nrows; ++i)
      for (int64_t g = 0; g < a.G; ++g) {
        const T* q = qp + (row0 + i) * a.q_s0 + ((t.h + j) * a.G + g) * a.q_s1;
        float* f = w.qf.data() + ((j * t.nrows + i) * a.G + g) * D;
        if constexpr (sizeof(T) == 2)
          if (dot) {
            for (int64_t d = 0; d < D; d += 2) std::memcpy(f + d, q + d, 4);
            continue;
          }
        for (int64_t d = 0; d < D; ++d) f[d] = to_float(q[d]) * q_scale;
      }
#if defined(__AVX512FP16__)
  if (half && !done) {
    w.P.resize(t.nh * nv * s.ns), w.q16.resize(t.nh * nv * D), w.qinv.resize(t.nh * nv);
    done = attend16_dims(st16, t, w.qf.data(), w.S.data(), w.P.data(), reinterpret_cast<_Float16*>(w.q16.data()),
                         w.qinv.data(), w.of.data());
  }
#endif
#if defined(__AVX512F__)
  NextBlocks none(a, nullptr, kc, vc);
  if (!done && stage)
    done = attend_dims<c10::BFloat16>(st.a, t, w.qf.data(), st.k, st.v, w.S.data(), w.of.data(), none);
  if (!done && vectorised(D)) {
    Args ad = a;
    ad.dot = dot;
    // the next task's blocks only where it reads the cache itself (not a staged copy)
    const bool direct = next && !(!st.on.empty() && st.on[next->r]) && !(!st16.on.empty() && st16.on[next->r]);
    NextBlocks ahead(a, direct ? next : nullptr, kc, vc, qp);
    done = attend_dims<KV>(ad, t, w.qf.data(), kc, vc, w.S.data(), w.of.data(), ahead);
  }
#elif defined(PAGELLM_HAS_AVX2)
  if constexpr (std::is_same_v<KV, c10::BFloat16>)
    if (!done && !stage) done = attend_avx2(a, t, w.qf.data(), kc, vc, w.S.data(), w.of.data());
#endif
  if (!done)
    for (int64_t j = 0; j < t.nh; ++j)
      attend_generic<KV>(a, one_head(t, j), w.qf.data() + j * nv * D, kc, vc, w.S.data() + j * nv * s.ns,
                        w.of.data() + j * nv * D);
  for (int64_t j = 0; j < t.nh; ++j)
    for (int64_t i = 0; i < t.nrows; ++i)
      for (int64_t g = 0; g < a.G; ++g) {
        T* o = op + (row0 + i) * a.o_s0 + ((t.h + j) * a.G + g) * a.o_s1;
        const float* f = w.of.data() + ((j * t.nrows + i) * a.G + g) * D;
        int64_t d = 0;
#if defined(__AVX512F__)
        if constexpr (!std::is_same_v<T, c10::Half>)  // store16: c10's rounding, bit for bit
          for (; d + 16 <= D; d += 16) store16(o + d, _mm512_loadu_ps(f + d));
#endif
        for (; d < D; ++d) o[d] = static_cast<T>(f[d]);
      }
}

template <typename T, typename KV>
void attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& bt,
               const at::Tensor& seq_lens, const at::Tensor& query_start, at::Tensor& out, double scale,
               int64_t window, int64_t max_query_len, const int64_t* kv_start, float* lse, int64_t lse_s0,
               bool fp16_sums, const KVRows<T, KV>* kw) {
  Args a;
  a.H = q.size(1), a.Hkv = k_cache.size(1), a.G = a.H / a.Hkv, a.D = q.size(2);
  a.B = v_cache.size(2) * v_cache.size(4), a.MB = bt.size(1);
  a.q_s0 = q.stride(0), a.q_s1 = q.stride(1), a.o_s0 = out.stride(0), a.o_s1 = out.stride(1);
  a.k_sb = k_cache.stride(0), a.k_sh = k_cache.stride(1), a.v_sb = v_cache.stride(0), a.v_sh = v_cache.stride(1);
  a.bt = bt.data_ptr<int64_t>(), a.seq = seq_lens.data_ptr<int64_t>(), a.qs = query_start.data_ptr<int64_t>();
  a.scale = static_cast<float>(scale), a.window = window;
  // bf16 scores and weighted sums by VDPBF16PS where the linears take it (AMD: at the FMA's rate, fma_linear_cpu.cpp)
  a.dot = std::is_same_v<T, c10::BFloat16> && std::is_same_v<KV, c10::BFloat16> && fma_linear_dot_default();
  a.kv_start = kv_start, a.lse = lse, a.lse_s0 = lse_s0;
  const int64_t R = seq_lens.size(0);
  // One task per request and kv head, or per request over all its kv heads when there are requests enough to
  // keep every thread busy: then each block's keys are read as one run of Hkv heads. 64 decodes x 30 layers,
  // ~360-token contexts, alternating in one process: 0.97-0.98x the time (blocks in order or shuffled).
  const int64_t heads_per_task = R >= 4 * at::get_num_threads() ? a.Hkv : 1;

  std::vector<Task> tasks;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t qlen = a.qs[r + 1] - a.qs[r];
    TORCH_CHECK(qlen >= 0 && qlen <= a.seq[r], "request ", r, ": ", qlen, " query rows for a context of ", a.seq[r]);
    TORCH_CHECK(!a.kv_start || (a.kv_start[r] >= 0 && a.kv_start[r] <= a.seq[r] - qlen), "request ", r,
                ": kv_start ", a.kv_start ? a.kv_start[r] : 0, " past its first query position ", a.seq[r] - qlen);
    if (qlen > max_query_len) continue;  // left to the caller
    for (int64_t i0 = 0; i0 < qlen; i0 += kTileRows)
      for (int64_t h = 0; h < a.Hkv; h += heads_per_task) {
        Task t{r, h, i0, std::min(kTileRows, qlen - i0), 0, heads_per_task};
        const Span s = span_of(a, t);
        t.cost = heads_per_task * t.nrows * (s.khi - s.klo) + 64;
        tasks.push_back(t);
      }
  }
  const T* qp = q.data_ptr<T>();
  const KV* kc = static_cast<const KV*>(k_cache.data_ptr());
  const KV* vc = static_cast<const KV*>(v_cache.data_ptr());
  T* op = out.data_ptr<T>();
  // Requests whose blocks are copied once per call: with fp16 sums (bf16/fp16 queries; fp32 keeps fp32 sums,
  // HF-exact) chunks of kFp16MinRows rows or more into fp16, else over an fp8 cache long chunks into bf16.
  Staged st;
  Staged16 st16;
  bool half = false;
#if defined(__AVX512FP16__)
  if constexpr (!std::is_same_v<T, float>) half = fp16_sums && fp16_dims(a.D);
#endif
  std::vector<char> want(R, 0);
  bool any = false;
  if (half || (is_fp8<KV>() && vectorised(a.D)))
    for (int64_t r = 0; r < R; ++r) {
      const int64_t qlen = a.qs[r + 1] - a.qs[r];
      want[r] = is_fp8<KV>() ? wants_staging(a, qlen, max_query_len) : qlen >= kFp16MinRows && qlen <= max_query_len;
      any = any || want[r];
    }
  // This step's K/V rows (kw): a request whose rows all fall in one row tile has them written by its own tasks,
  // each for its kv heads, right before it reads the same blocks (a decode row's key lands in its last block's
  // word rows, the lines its scores read next), so the writes' misses are the reads' misses; a separate pass over
  // all rows missed on every line twice a step. The other rows (longer chunks, staged requests, rows left to the
  // caller) are written first, in one pass, and so are a request's rows when another request of this call reads
  // a block they go to (a prefix-cache hit on a block filled in this very step).
  std::vector<char> fused;
  if (kw) {
    fused.assign(R, 0);
    std::vector<int32_t> writer(k_cache.size(0), -1);  // per block: the fused request writing it, -1: none
    for (int64_t r = 0; r < R; ++r) {
      const int64_t qlen = a.qs[r + 1] - a.qs[r];
      fused[r] = qlen > 0 && qlen <= kTileRows && qlen <= max_query_len && !want[r];
      for (int64_t i = a.qs[r]; i < a.qs[r + 1] && fused[r]; ++i) {
        if (kw->slots[i] < 0) continue;
        int32_t& w = writer[kw->slots[i] / a.B];
        if (w >= 0 && w != r) fused[w] = fused[r] = 0;  // two writers of one block: both first (the caller's odd
        w = static_cast<int32_t>(r);                      // batch; the engine's requests never share a block's tail)
      }
    }
    for (int64_t r = 0; r < R; ++r)
      if (a.qs[r + 1] - a.qs[r] <= max_query_len)  // read by this call's tasks
        for (int64_t b = 0; b * a.B < a.seq[r]; ++b) {
          const int32_t w = writer[a.bt[r * a.MB + b]];
          if (w >= 0 && w != r) fused[w] = 0;
        }
    std::vector<int64_t> rest;
    for (int64_t r = 0; r < R; ++r)
      if (!fused[r])
        for (int64_t i = a.qs[r]; i < a.qs[r + 1]; ++i) rest.push_back(i);
    for (int64_t i = a.qs[R]; i < q.size(0); ++i) rest.push_back(i);
    if (!rest.empty()) write_rows(*kw, static_cast<int64_t>(rest.size()), rest.data(), a.Hkv);
  }
  if (any) {
#if defined(__AVX512FP16__)
    if constexpr (!std::is_same_v<T, float>)
      if (half) stage_fp16<KV>(a, want, kc, vc, st16);
#endif
#if defined(__AVX512F__)
    if constexpr (is_fp8<KV>())
      if (!half) stage_requests<KV>(a, want, kc, vc, st);
#endif
  }
  run_largest_first(tasks, [&](auto next) {
    Scratch w;
    const Task* t = next();
    while (t) {
      const Task* ahead = next(true);  // claimed now, so that its first blocks come in during t's value pass
      if (kw && fused[t->r])
        for (int64_t i = a.qs[t->r]; i < a.qs[t->r + 1]; ++i) kw->write(i, t->h, t->h + t->nh);
      run_task<T, KV>(a, *t, qp, kc, vc, op, st, st16, w, ahead);
      t = ahead ? ahead : next();
    }
  });
}

// Copy the first ctx tokens of a block table out of the cache (KV) as T: k, v [Hkv, ctx, D] contiguous.
template <typename T, typename KV>
void gather_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& blocks, at::Tensor& k,
                  at::Tensor& v) {
  constexpr int x = pack_x<KV>();
  const int64_t Hkv = k.size(0), L = k.size(1), D = k.size(2), B = v_cache.size(2) * x;
  const KV* kc = static_cast<const KV*>(k_cache.data_ptr());
  const KV* vc = static_cast<const KV*>(v_cache.data_ptr());
  const int64_t* bt = blocks.data_ptr<int64_t>();
  T* kp = k.data_ptr<T>();
  T* vp = v.data_ptr<T>();
  at::parallel_for(0, Hkv * ((L + B - 1) / B), 8, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t nb = (L + B - 1) / B, h = task / nb, b = task % nb, n = std::min(B, L - b * B);
      const KV* kb = kc + bt[b] * k_cache.stride(0) + h * k_cache.stride(1);
      const KV* vb = vc + bt[b] * v_cache.stride(0) + h * v_cache.stride(1);
      T* kd = kp + (h * L + b * B) * D;
      T* vd = vp + (h * L + b * B) * D;
      for (int64_t t = 0; t < n; ++t)
        for (int64_t j = 0; j < D / x; ++j)
          for (int e = 0; e < x; ++e) kd[t * D + j * x + e] = static_cast<T>(to_float(kb[j * B * x + t * x + e]));
      for (int64_t i = 0; i < (n + x - 1) / x; ++i)
        for (int64_t d = 0; d < D; ++d)
          for (int e = 0; e < x && i * x + e < n; ++e)
            vd[(i * x + e) * D + d] = static_cast<T>(to_float(vb[(i * D + d) * x + e]));
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
  TORCH_CHECK(B % x == 0, "block size must be a multiple of ", x);
}

// This step's K/V rows for the cache: k, v [N, Hkv, D], slot_mapping int64 [N] (negative: skipped, else a slot
// of the cache).
void check_new_rows(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1, "k/v: [N, Hkv, D]");
  check_cache(k_cache, v_cache, k.size(2));
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k.scalar_type(), "dtype mismatch");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.numel() == k.size(0), "slot_mapping: int64 [N]");
  const int64_t slots = k_cache.size(0) * k_cache.size(3);
  const int64_t* sp = slot_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < k.size(0); ++i)
    TORCH_CHECK(sp[i] < slots, "slot_mapping[", i, "] = ", sp[i], " is past the cache's ", slots, " slots");
}

// Calls f(KV{}) for a cache of dtype t holding K/V for queries of type T: T itself, or fp8 (e4m3fn, e5m2).
template <typename T, typename F>
void dispatch_cache(c10::ScalarType t, c10::ScalarType q, const char* name, F&& f) {
  if (t == q) return f(T{});
  switch (t) {
    case c10::ScalarType::Float8_e4m3fn: return f(c10::Float8_e4m3fn{});
    case c10::ScalarType::Float8_e5m2: return f(c10::Float8_e5m2{});
    default: TORCH_CHECK(false, name, ": a ", t, " cache does not go with ", q, " (the same dtype, or fp8)");
  }
}

}  // namespace

void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start,
                     at::Tensor out, double scale, int64_t window, int64_t max_query_len,
                     const c10::optional<at::Tensor>& kv_start, c10::optional<at::Tensor> lse, bool fp16_sums,
                     const c10::optional<at::Tensor>& k_new, const c10::optional<at::Tensor>& v_new,
                     const c10::optional<at::Tensor>& slot_mapping) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && out.sizes() == q.sizes() && out.stride(2) == 1,
              "q/out: [T, H, D], last dim contiguous");
  const bool has_start = kv_start.has_value() && kv_start->defined(), has_lse = lse.has_value() && lse->defined();
  if (has_start)
    TORCH_CHECK(kv_start->scalar_type() == at::kLong && kv_start->is_contiguous() &&
                kv_start->numel() == seq_lens.numel(), "kv_start: contiguous int64 [R]");
  if (has_lse)
    TORCH_CHECK(lse->scalar_type() == at::kFloat && lse->dim() == 2 && lse->size(0) == q.size(0) &&
                lse->size(1) == q.size(1) && lse->stride(1) == 1, "lse: float32 [T, H]");
  check_cache(k_cache, v_cache, q.size(2));
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && out.scalar_type() == q.scalar_type(), "dtype mismatch");
  for (const at::Tensor* t : {&block_tables, &seq_lens, &query_start})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "indices must be contiguous int64");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == seq_lens.size(0) &&
              query_start.numel() == seq_lens.numel() + 1, "block_tables [R, MB], seq_lens [R], query_start [R+1]");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "heads must be a multiple of kv heads");
  const bool write = k_new.has_value() && k_new->defined();
  TORCH_CHECK(write == (v_new.has_value() && v_new->defined()) &&
              write == (slot_mapping.has_value() && slot_mapping->defined()),
              "k_new, v_new and slot_mapping go together");
  if (write) {
    check_new_rows(*k_new, *v_new, k_cache, v_cache, *slot_mapping);
    TORCH_CHECK(k_new->size(0) == q.size(0) && k_new->size(1) == k_cache.size(1) && k_new->scalar_type() == q.scalar_type(),
                "k_new/v_new: [T, Hkv, D] of q's rows and dtype");
  }
  // the cache is written in place (k_new); the tensors' handles stay const for the reading call sites
  at::Tensor kc = k_cache, vc = v_cache;
  pagellm::dispatch_float(q.scalar_type(), "paged_attention", [&](auto tag) {
    using T = decltype(tag);
    dispatch_cache<T>(k_cache.scalar_type(), q.scalar_type(), "paged_attention", [&](auto kv) {
      using KV = decltype(kv);
      const KVRows<T, KV> rows = write ? KVRows<T, KV>(*k_new, *v_new, kc, vc, *slot_mapping) : KVRows<T, KV>();
      attention<T, KV>(q, k_cache, v_cache, block_tables, seq_lens, query_start, out, scale, window, max_query_len,
                       has_start ? kv_start->data_ptr<int64_t>() : nullptr, has_lse ? lse->data_ptr<float>() : nullptr,
                       has_lse ? lse->stride(0) : 0, fp16_sums && kHasFp16Attention, write ? &rows : nullptr);
    });
  });
}

bool paged_attention_fp16_supported() { return kHasFp16Attention; }

void write_kv_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                    const at::Tensor& slot_mapping) {
  check_new_rows(k, v, k_cache, v_cache, slot_mapping);
  pagellm::dispatch_float(k.scalar_type(), "write_kv_cache", [&](auto tag) {
    using T = decltype(tag);
    dispatch_cache<T>(k_cache.scalar_type(), k.scalar_type(), "write_kv_cache", [&](auto kv) {
      using KV = decltype(kv);
      write_rows(KVRows<T, KV>(k, v, k_cache, v_cache, slot_mapping), k.size(0), nullptr, k.size(1));
    });
  });
}

void gather_kv_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& blocks, at::Tensor k,
                     at::Tensor v) {
  TORCH_CHECK(k.dim() == 3 && k.is_contiguous() && v.is_contiguous() && v.sizes() == k.sizes(), "k/v: [Hkv, L, D]");
  check_cache(k_cache, v_cache, k.size(2));
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k.scalar_type(), "dtype mismatch");
  const int64_t B = v_cache.size(2) * v_cache.size(4);
  TORCH_CHECK(blocks.scalar_type() == at::kLong && blocks.is_contiguous() && blocks.numel() * B >= k.size(1),
              "blocks: int64, enough for the context");
  pagellm::dispatch_float(k.scalar_type(), "gather_kv_cache", [&](auto tag) {
    using T = decltype(tag);
    dispatch_cache<T>(k_cache.scalar_type(), k.scalar_type(), "gather_kv_cache", [&](auto kv) {
      gather_cache<T, decltype(kv)>(k_cache, v_cache, blocks, k, v);
    });
  });
}

// Registered as torch.ops.pagellm.* (no pybind11: the build stays small and fast).
TORCH_LIBRARY(pagellm, m) {
  m.def("paged_attention(Tensor q, Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start, Tensor(a!) out, float scale, int window, int max_query_len, Tensor? kv_start=None, "
        "Tensor(b!)? lse=None, bool fp16_sums=False, Tensor? k_new=None, Tensor? v_new=None, "
        "Tensor? slot_mapping=None) -> ()");
  m.impl("paged_attention", c10::DispatchKey::CPU, &paged_attention);
  m.def("paged_attention_fp16_supported() -> bool", [] { return paged_attention_fp16_supported(); });
  m.def("write_kv_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.impl("write_kv_cache", c10::DispatchKey::CPU, &write_kv_cache);
  m.def("gather_kv_cache(Tensor k_cache, Tensor v_cache, Tensor blocks, Tensor(a!) k, Tensor(b!) v) -> ()");
  m.impl("gather_kv_cache", c10::DispatchKey::CPU, &gather_kv_cache);
}
