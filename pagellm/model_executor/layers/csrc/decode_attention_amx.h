// Decode attention on AMX tiles: the paged-attention kernel's tasks of at most 8 query vectors (a decode row's G
// query heads of one kv head, G <= 8) over a bf16 cache, on CPUs with AMX-bf16 (paged_attention_cpu.cpp).
//
// Why: with 64 decode rows the FMA loops (score_block32, pv_block) spent ~11 ms of a 30-layer step on arithmetic
// alone (every block in L2), and the core did not overlap it with the ~18 ms of streaming the blocks from memory:
// the two added up. On tiles a 32-key chunk of one kv head is 4 tile multiplies for the scores and 4 for the
// weighted values whatever the number of vectors, the cache layout being what the tiles read in place:
//   keys   [D/2 word rows][B tokens] words: 16 dim pairs x 16 tokens is one B tile, row stride 4B bytes;
//   values [B/2 token pairs][D dims] words: 16 token pairs x 16 dims is one B tile, row stride 4D bytes.
// Two passes per kv head, as the FMA kernel: every score (fp32, the tiles' sums), the softmax of each row over its
// keys (exp16, fp32 sum), then sum_t p_t v_t. The probabilities meet the values as bf16 pairs: p = hi + lo with
// hi = bf16(p), lo = bf16(p - hi), ~16 significant bits, as rows 0..nv-1 and nv..2nv-1 of one A tile (nv <= 8),
// so the weighted sum is as close to fp32's as the FMA kernel's at no extra multiply; the two output halves are
// added at the end. q and the cache are bf16 already, so the scores' products are exact.
// Slots past a request's context were never written (they may hold NaN, and 0 x NaN poisons a tile product), so
// the values of the 32-key chunk holding the context's end are copied with those slots zeroed; the keys' stale
// slots only give scores that the softmax never reads.
#pragma once

#include "amx.h"
#include "paged_attention_task.h"

#if defined(PAGELLM_AMX) && defined(__AVX512BF16__)
#define PAGELLM_AMX_DECODE 1

#include <c10/util/BFloat16.h>

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace pagellm::paged {

constexpr int64_t kAmxDecodeVectors = 8;  // P's high and low rows share one 16-row tile

// A worker's tile state and buffers, kept between its tasks within one call.
struct AmxDecode {
  std::vector<c10::BFloat16> q;  // [2 nv][D], rows nv.. zero
  std::vector<float> S;          // [nh][2 nv][ns] scores (rows nv.. are the zero rows' scores, unused)
  std::vector<c10::BFloat16> P;  // [2 nv][ns]: hi rows, then lo rows
  std::vector<float> inv;        // [nv] 1 / the row's sum
  alignas(64) c10::BFloat16 vtail[16 * 128 * 2];  // the 32 keys' values holding the context's end, D <= 128
  alignas(64) float o[16 * 128];                  // [2 nv][D]
  int64_t rows = 0;  // the A/C tiles' row count configured on this thread (2 nv); 0: not configured
  ~AmxDecode() {
    if (rows) _tile_release();
  }
};

// Tiles: 0-3 the query's D/32 dim groups (scores) or the output's 4 x 16 dims (values), 4 and 7 the scores of a
// chunk's two 16-key halves (4 also P), 5-6 the keys / values (16 rows). A/C tiles have `rows` rows.
inline void configure_decode_tiles(int64_t rows) {
  static const std::array<TileConfig, 17> configs = [] {
    std::array<TileConfig, 17> c{};
    for (int r = 1; r <= 16; ++r)
      for (int t = 0; t < 8; ++t) c[r].rows[t] = (t == 5 || t == 6) ? 16 : r, c[r].colsb[t] = 64;
    return c;
  }();
  _tile_loadconfig(&configs[rows]);
}

inline bool amx_decode_fits(const Args& a, int64_t nv) {
  return nv <= kAmxDecodeVectors && (a.D == 64 || a.D == 128) && a.B % 32 == 0 && request_amx();
}

// Scores of the 32 keys at t0 of one (block, kv head) for the query in tiles 0 .. QT-1: S[.][t0 .. t0+31].
template <int QT>
inline void amx_score_chunk(const char* kb, int64_t B, int64_t t0, float* s, int64_t ns) {
  const int64_t ks = 4 * B;  // bytes per word row (dim pair)
  const char* k = kb + t0 * 4;
  _tile_zero(4);
  _tile_zero(7);
  _tile_loadd(5, k, ks);
  _tile_loadd(6, k + 64, ks);
  _tile_dpbf16ps(4, 0, 5);
  _tile_dpbf16ps(7, 0, 6);
  _tile_loadd(5, k + 16 * ks, ks);
  _tile_loadd(6, k + 16 * ks + 64, ks);
  _tile_dpbf16ps(4, 1, 5);
  _tile_dpbf16ps(7, 1, 6);
  if constexpr (QT == 4) {
    _tile_loadd(5, k + 32 * ks, ks);
    _tile_loadd(6, k + 32 * ks + 64, ks);
    _tile_dpbf16ps(4, 2, 5);
    _tile_dpbf16ps(7, 2, 6);
    _tile_loadd(5, k + 48 * ks, ks);
    _tile_loadd(6, k + 48 * ks + 64, ks);
    _tile_dpbf16ps(4, 3, 5);
    _tile_dpbf16ps(7, 3, 6);
  }
  _tile_stored(4, s + t0, ns * 4);
  _tile_stored(7, s + t0 + 16, ns * 4);
}

// O (tiles 0-3: dims d0 .. d0+63) += P (tile 4, loaded from p) . V for the 32 keys whose values start at v
// (16 token-pair rows of D words).
inline void amx_value_chunk(const c10::BFloat16* p, int64_t ns, const char* v, int64_t D) {
  const int64_t vs = 4 * D;
  _tile_loadd(4, p, ns * 2);
  _tile_loadd(5, v, vs);
  _tile_loadd(6, v + 64, vs);
  _tile_dpbf16ps(0, 4, 5);
  _tile_dpbf16ps(1, 4, 6);
  _tile_loadd(5, v + 128, vs);
  _tile_loadd(6, v + 192, vs);
  _tile_dpbf16ps(2, 4, 5);
  _tile_dpbf16ps(3, 4, 6);
}

// Row v's softmax over keys [lo, hi) (relative to the span's first key) of its scores s (unscaled): P's hi and
// lo rows over [0, np), zero outside [lo, hi); returns the row's sum and sets m to its scaled maximum.
inline float amx_softmax_row(const float* s, int64_t lo, int64_t hi, int64_t np, float scale, c10::BFloat16* ph,
                             c10::BFloat16* pl, float& m) {
  m = max_of(s + lo, hi - lo) * scale;  // scale > 0
  const __m512 vs = _mm512_set1_ps(scale), vm = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < np; j += 16) {
    const int64_t a = std::max<int64_t>(lo - j, 0), b = std::min<int64_t>(hi - j, 16);
    const __mmask16 in = a < b ? static_cast<__mmask16>(((1u << b) - 1) & ~((1u << a) - 1)) : 0;
    __m512 e = _mm512_setzero_ps();
    if (in) e = _mm512_maskz_mov_ps(in, exp16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(in, s + j), vs, vm)));
    sum = _mm512_add_ps(sum, e);
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(e);
    const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(ph + j), h);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pl + j), (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(e, hf)));
  }
  return _mm512_reduce_add_ps(sum);
}

// Task t (rows * G <= 8 vectors, bf16 q and cache) on tiles: of [nh][nv][D] the normalised outputs (fp32), as
// attend() leaves them.
template <int QT>
void attend_amx(const Args& a, const Task& t, const c10::BFloat16* qp, const c10::BFloat16* kc,
                const c10::BFloat16* vc, float* of, AmxDecode& w) {
  using bf16 = c10::BFloat16;
  const Span s = span_of(a, t);
  const int64_t nv = t.nrows * a.G, rows = 2 * nv, D = a.D, B = a.B, base = s.b0 * B, L = a.seq[t.r];
  const int64_t np = (s.khi - base + 31) / 32 * 32;  // keys from base in whole 32-key chunks
  const int64_t row0 = a.qs[t.r] + t.i0;
  if (w.rows != rows) {
    configure_decode_tiles(rows);
    w.rows = rows;
  }
  // Every head's query first: a tile load right after stores to its lines waits for them to drain (a 14% stall
  // when each (block, head) copied its query just before loading it).
  // (memset: a vector's fill of 2-byte elements runs element by element; 64 decode rows x 30 layers over 362
  // tokens, alternating in one process: 24.4-24.9 against 24.6-25.4 ms)
  w.q.resize(t.nh * rows * D);
  std::memset(w.q.data(), 0, w.q.size() * sizeof(bf16));
  for (int64_t j = 0; j < t.nh; ++j)
    for (int64_t v = 0; v < nv; ++v)
      std::memcpy(w.q.data() + (j * rows + v) * D, qp + (row0 + v / a.G) * a.q_s0 + ((t.h + j) * a.G + v % a.G) * a.q_s1,
                  D * sizeof(bf16));
  w.S.resize(t.nh * rows * s.ns);
  w.P.resize(rows * s.ns);
  w.inv.resize(nv);
  for (int64_t b = s.b0; b <= s.b1; ++b)
    for (int64_t j = 0; j < t.nh; ++j) {
      const int64_t h = t.h + j;
      const bf16* qh = w.q.data() + j * rows * D;
      _tile_loadd(0, qh, D * 2);
      _tile_loadd(1, qh + 32, D * 2);
      if constexpr (QT == 4) {
        _tile_loadd(2, qh + 64, D * 2);
        _tile_loadd(3, qh + 96, D * 2);
      }
      const char* kb = reinterpret_cast<const char*>(kc + a.bt[t.r * a.MB + b] * a.k_sb + h * a.k_sh);
      const char* vb = reinterpret_cast<const char*>(vc + a.bt[t.r * a.MB + b] * a.v_sb + h * a.v_sh);
      const char* kn = b < s.b1 ? reinterpret_cast<const char*>(kc + a.bt[t.r * a.MB + b + 1] * a.k_sb + h * a.k_sh)
                                : nullptr;
      // Pull the next block's keys and this block's values (read after every score) towards the core: every line
      // (every other line: 1.2x the time), the keys into L1 (into L2: 1.07x), the values into L2.
      for (int64_t l = 0; l < B * D * 2; l += 64) {
        if (kn) _mm_prefetch(kn + l, _MM_HINT_T0);
        _mm_prefetch(vb + l, _MM_HINT_T1);
      }
      float* Sb = w.S.data() + j * rows * s.ns + (b - s.b0) * B;
      for (int64_t t0 = 0; t0 < B && b * B + t0 < s.khi; t0 += 32) amx_score_chunk<QT>(kb, B, t0, Sb, s.ns);
    }
  for (int64_t j = 0; j < t.nh; ++j) {
    const int64_t h = t.h + j;
    const float* Sh = w.S.data() + j * rows * s.ns;
    for (int64_t v = 0; v < nv; ++v) {
      const int64_t p = s.p0 + v / a.G, lo = key_lo(a, t.r, p);
      float m;
      const float sum = amx_softmax_row(Sh + v * s.ns, lo - base, p + 1 - base, np, a.scale,
                                        w.P.data() + v * s.ns, w.P.data() + (nv + v) * s.ns, m);
      w.inv[v] = 1.f / sum;
      if (a.lse) a.lse[(row0 + v / a.G) * a.lse_s0 + h * a.G + v % a.G] = m + std::log(sum);
    }
    // The chunk holding the context's end, with its slots past the end zeroed (when it has any in use).
    const int64_t tail0 = L / 32 * 32;
    const bool tail = L % 32 != 0 && tail0 < s.khi;
    if (tail) {
      const bf16* src = vc + a.bt[t.r * a.MB + tail0 / B] * a.v_sb + h * a.v_sh + (tail0 % B) * D;
      const int64_t n = L - tail0;  // tokens in use, 1 .. 31
      for (int64_t i = 0; i < 16; ++i) {  // token pair i: both, the first (low halves) or neither in use
        const __m512i keep = _mm512_set1_epi32(2 * i + 1 < n ? -1 : 2 * i < n ? 0xffff : 0);
        for (int64_t d = 0; d < D; d += 16)
          _mm512_store_si512(w.vtail + (i * D + d) * 2,
                             _mm512_and_si512(keep, _mm512_loadu_si512(src + (i * D + d) * 2)));
      }
    }
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t c = 0; c < np; c += 32) {
        const int64_t tok = base + c;
        const char* v = tail && tok == tail0
                            ? reinterpret_cast<const char*>(w.vtail)
                            : reinterpret_cast<const char*>(vc + a.bt[t.r * a.MB + tok / B] * a.v_sb + h * a.v_sh +
                                                            (tok % B) * D);
        amx_value_chunk(w.P.data() + c, s.ns, v + d0 * 4, D);
      }
      for (int c = 0; c < 4; ++c) {
        float* o = w.o + d0 + 16 * c;
        switch (c) {
          case 0: _tile_stored(0, o, D * 4); break;
          case 1: _tile_stored(1, o, D * 4); break;
          case 2: _tile_stored(2, o, D * 4); break;
          default: _tile_stored(3, o, D * 4); break;
        }
      }
    }
    float* oh = of + j * nv * D;
    for (int64_t v = 0; v < nv; ++v) {
      const __m512 inv = _mm512_set1_ps(w.inv[v]);
      for (int64_t d = 0; d < D; d += 16)
        _mm512_storeu_ps(oh + v * D + d, _mm512_mul_ps(_mm512_add_ps(_mm512_loadu_ps(w.o + v * D + d),
                                                                     _mm512_loadu_ps(w.o + (nv + v) * D + d)),
                                                       inv));
    }
  }
}

}  // namespace pagellm::paged
#endif
