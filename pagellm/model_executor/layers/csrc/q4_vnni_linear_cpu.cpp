// y = x W^T (+ bias) for a 4-bit GGUF weight (the q4_1 layout of layers/quantized.py: Q4_0, Q4_1, Q4_K) on
// AVX512-VNNI's int8 dot product, with x quantized to int8 per row and 32-deep block, as llama.cpp's Q4 x Q8_1
// dot products do; for CPUs without AMX (layers/linear.py: CPULinear.vnni_q4; EngineConfig.gguf_int8_activations).
//
// Why: without AMX the bf16 linears run on VDPBF16PS (Zen 4) or fp32 FMAs, and there they are bound by the
// multiply-adds, not by memory: on Zen 4 the 120 layer linears ran at 93-98% of VDPBF16PS's peak, ~75% of
// workload_64's time. VPDPBUSD retires at the same rate there (3.65 G/s a core) with twice the products (64 a
// zmm), and at twice the fp32 FMA's rate on Intel (6.8 G/s a core here) with four times its products. A 4-bit
// weight's quants are exact small integers, so the only rounding added is x's: at most max|x| / 254 per value of a
// 32-deep block, about bf16's own rounding for the block's largest values, coarser for its small ones (hence the
// outlier channels below). Teacher-forced agreement with fp32 on workload_16 (`pagellm bench
// agreement`'s measure, this path forced on the AMX kind): 99.46-99.56% against 99.71% on the bf16 weights.
//
// The math, per row r, output column n and block b (32 k): x's block is dx * xq with dx = max|x| / 127 and xq =
// round_half_even(x * (1 / dx)) in [-127, 127]; the weight's is d * q + m (q in 0..15, d and m fp32). Then
//   y[r][n] = sum_b ( dx[r,b] * d[n,b] * I_b[r][n] + sx[r,b] * m[n,b] ),  I_b = sum_k xq q (int32, exact),
// sx = dx * sum_k xq (x's block sum as quantized), accumulated in fp32 block by block with fused multiply-adds:
// f = fma(float(I_b) * d, dx, f); f = fma(m, sx, f). A row whose block holds a NaN or an infinity gets NaN.
//
// Outlier channels: a few input channels of a model's activations run ~20x the rest (SmolLM2's norm outputs), and
// a block holding one gets a scale that leaves its other values a few int8 steps: teacher-forced agreement on the
// tests' text prompts fell from 97.4% (bf16 x, the same weights) to 95.8%. So each weight keeps P channels
// (layers/linear.py: INT8_OUTLIER_CHANNELS, 8) out of the int8 blocks: chosen once, on its first call, as the
// channels of largest |x| over that call's rows (ties: the lower index), they are zeroed before x is quantized and
// added exactly instead, x[r][c] (bf16) times the weight's fp32 value, after the blocks: 97.4% again on the text
// prompts, 2-4% more multiply-adds. The choice lives in the caller's tensors (channels, wc), so every later
// call, in either layer loop, takes the same one and a row's output does not depend on the other rows of its call;
// the engine makes the first call a fixed prompt's (LLMEngine.choose_int8_outliers), so it is the same in every
// engine of a model.
//
// Layout (layers/quantized.py: pack_vnni_q4): q8 uint8 [N/16][K/32][8][64]: row j of a block holds, at byte
// 4 n + e, column n's quant at depth 4 j + e (one VPDPBUSD operand: 16 columns x 4 depths); scales fp32
// [N/16][K/32][2][16]: the 16 columns' d, then their m (the AMX nibbles' scales, amx_q4_panels.h). Columns past
// N (N % 16) have q = d = m = 0.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "split_work.h"
#include "tile_linear.h"
#include "vec.h"

namespace {
using namespace pagellm;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PAGELLM_Q4_VNNI 1
using bf16 = c10::BFloat16;

constexpr int64_t kRowChunk = 256;  // rows of x whose int8 copy (K bytes each) stays in L2 across column blocks
// Rows per micro-kernel call: 2 x kMR int32 and as many fp32 accumulators, 24 of the 32 registers. 6 against 4:
// SmolLM2's 120 layer linears at 2,048 rows took 0.94-0.99x the time on Zen 4 in four of five alternating runs
// (1.05x in one); 8 rows spill. With NextPanels below, 64 rows (decode) took 0.94-0.96x (three runs).
constexpr int kMR = 6;

struct Gemm {
  const bf16* x;
  int64_t ldx, M, K, N;  // N: out's columns (silu: the intermediate size; the weight has 2N)
  const uint8_t* q8;
  const float* scales;
  const bf16* bias;
  bf16* y;
  int64_t ldy;
  bool silu;
  int8_t* xq;
  float *dx, *sx;
  int64_t P;            // outlier channels
  const int32_t* chan;  // [P], ascending
  const float* wc;      // [P][tiles * 16]: the weight's values at those channels
  int64_t ldwc;
  float* xo;            // [M][P]: x at those channels
};

// The weight lines of the column block a thread runs next (its quants' and scales' rows, tile by tile), brought into
// L2 one line per 4-deep step of the current block's micro-kernel calls, so that the next block's first call finds
// its panels there rather than in memory (decode-sized calls read every panel from memory once). next() is null
// once all are issued, and from the start where the thread has no next block in hand.
struct NextPanels {
  const char* base[8];  // up to 4 tiles (silu_mul: 2 of gate, 2 of up), quants then scales of each
  int64_t lines[8];
  int parts = 0, part = 0;
  int64_t line = 0;
  void add(const void* p, int64_t bytes) {
    base[parts] = static_cast<const char*>(p), lines[parts++] = (bytes + 63) / 64;
  }
  const char* next() {
    while (part < parts && line >= lines[part]) ++part, line = 0;
    return part < parts ? base[part] + 64 * line++ : nullptr;
  }
};

// The outlier channels, once per weight (chan[0] < 0: not chosen yet): the P channels of largest |x| over the
// call's rows (NaN counting as infinite), ascending, and wc, the weight's exact values there (d q + m; d q is exact
// in fp32).
void choose_outliers(const Gemm& g, int32_t* chan, float* wc) {
  std::vector<float> top(g.K, 0.f);
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  for (int64_t r = 0; r < g.M; ++r)
    for (int64_t k = 0; k < g.K; k += 16) {  // K is a multiple of 32
      const __m512 v = load16(g.x + r * g.ldx + k);
      const __m512 a = _mm512_mask_mov_ps(_mm512_abs_ps(v), _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), inf);
      _mm512_storeu_ps(top.data() + k, _mm512_max_ps(_mm512_loadu_ps(top.data() + k), a));
    }
  std::vector<int32_t> order(g.K);
  for (int64_t k = 0; k < g.K; ++k) order[k] = static_cast<int32_t>(k);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return top[a] > top[b]; });
  std::sort(order.begin(), order.begin() + g.P);
  const int64_t KB = g.K / 32, tiles = g.ldwc / 16;
  for (int64_t p = 0; p < g.P; ++p) {
    const int64_t c = order[p], b = c / 32, j = c % 32 / 4, e = c % 4;
    chan[p] = static_cast<int32_t>(c);
    for (int64_t t = 0; t < tiles; ++t)
      for (int64_t n = 0; n < 16; ++n) {
        const float* sc = g.scales + (t * KB + b) * 32;
        wc[p * g.ldwc + t * 16 + n] = sc[n] * g.q8[((t * KB + b) * 8 + j) * 64 + 4 * n + e] + sc[16 + n];
      }
  }
}

// Lane i of the result: op over the 16 lanes of v[i] (a transposing tree: 45 shuffles and ops for 16 vectors,
// where one vector's reduction alone takes ~7).
template <typename Op>
inline __m512 reduce16(const __m512* v, Op op) {
  __m512 x[8], y[4], z[2];
  for (int j = 0; j < 8; ++j)  // per 128-bit lane: v[2j]'s two partials in lanes 0 and 2, v[2j+1]'s in 1 and 3
    x[j] = op(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int j = 0; j < 4; ++j)  // per 128-bit lane: v[4j .. 4j+3]'s partials
    y[j] = op(_mm512_shuffle_ps(x[2 * j], x[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
              _mm512_shuffle_ps(x[2 * j], x[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int j = 0; j < 2; ++j)  // across the 128-bit lanes, pairwise
    z[j] = op(_mm512_shuffle_f32x4(y[2 * j], y[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
              _mm512_shuffle_f32x4(y[2 * j], y[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return op(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
            _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// x's rows [r0, r1) as int8 blocks: q [M][K], dx and sx [M][K/32], the outlier channels zeroed (keep: per block,
// the lanes not zeroed, low 16 and high 16) and copied into xo. 16 blocks at a time, so that their maxima, scales
// and sums are vector operations.
void quantize_rows(const Gemm& g, const uint32_t* keep, int64_t r0, int64_t r1) {
  const int64_t K = g.K, KB = K / 32;
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  const auto fmax = [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); };
  const auto iadd = [](__m512 a, __m512 b) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  };
  for (int64_t r = r0; r < r1; ++r) {
    const bf16* x = g.x + r * g.ldx;
    for (int64_t p = 0; p < g.P; ++p) g.xo[r * g.P + p] = static_cast<float>(x[g.chan[p]]);
    for (int64_t b0 = 0; b0 < KB; b0 += 16) {
      const int G = static_cast<int>(std::min<int64_t>(16, KB - b0));
      const __mmask16 lanes = static_cast<__mmask16>((1u << G) - 1);
      auto block = [&](int i, __m512& v0, __m512& v1) {
        const int64_t b = b0 + i;
        v0 = _mm512_maskz_mov_ps(static_cast<__mmask16>(keep[b]), load16(x + b * 32));
        v1 = _mm512_maskz_mov_ps(static_cast<__mmask16>(keep[b] >> 16), load16(x + b * 32 + 16));
      };
      __m512 a[16], s[16];  // per block: max |x| and the quants' sums by lane (zero past the G blocks)
      std::fill(a, a + 16, _mm512_setzero_ps());
      std::fill(s, s + 16, _mm512_setzero_ps());
      __mmask16 bad = 0;
      for (int i = 0; i < G; ++i) {
        __m512 v0, v1;
        block(i, v0, v1);
        a[i] = _mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1));
        if (_mm512_cmp_ps_mask(v0, v1, _CMP_UNORD_Q)) bad |= static_cast<__mmask16>(1u << i);
      }
      // d = max|x| / 127, NaN where a block holds a NaN or an infinity; 1 / d, 0 for an all-zero block and where
      // d is below 2^-128 (1 / d overflows): then q = 0
      const __m512 amax = reduce16(a, fmax);
      const __mmask16 ok = _mm512_cmp_ps_mask(amax, inf, _CMP_LT_OQ) & static_cast<__mmask16>(~bad);
      const __m512 d = _mm512_mask_div_ps(_mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()), ok, amax,
                                          _mm512_set1_ps(127.f));
      __m512 id = _mm512_maskz_div_ps(ok & _mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_GT_OQ),
                                      _mm512_set1_ps(1.f), d);
      id = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(id, inf, _CMP_LT_OQ), id);
      alignas(64) float ids[16];
      _mm512_store_ps(ids, id);
      for (int i = 0; i < G; ++i) {
        __m512 v0, v1;
        block(i, v0, v1);
        const __m512 vid = _mm512_set1_ps(ids[i]);
        // nearest, ties to even (MXCSR's default, as torch.round); |x * id| <= 127 up to rounding, never past 127.5
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vid)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vid));
        int8_t* qb = g.xq + r * K + (b0 + i) * 32;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtepi32_epi8(q1));
        s[i] = _mm512_castsi512_ps(_mm512_add_epi32(q0, q1));
      }
      const __m512i sum = _mm512_castps_si512(reduce16(s, iadd));
      _mm512_mask_storeu_ps(g.dx + r * KB + b0, lanes, d);
      _mm512_mask_storeu_ps(g.sx + r * KB + b0, lanes, _mm512_mul_ps(d, _mm512_cvtepi32_ps(sum)));
    }
  }
}

// f [R][NT * 16] = the fp32 sums of rows xq[0 .. R) (stride K) against NT 16-column tiles w[t] (their [K/32][8][64]
// quants, s[t] their [K/32][2][16] scales), then the P outlier channels' products: xo [R][P] times wc[t] (stride
// ldwc).
// Each 4-deep step also prefetches its tiles' row one 32-deep block ahead (K = 1,536: a 32-column panel is 48 KiB,
// more than L1 holds, so each call reads it from L2) and one line of pf, the next column block's panels.
template <int R, int NT>
void micro(const int8_t* xq, const float* dx, const float* sx, int64_t K, const uint8_t* const* w,
           const float* const* s, const float* xo, int64_t P, const float* const* wc, int64_t ldwc, float* f,
           NextPanels* pf) {
  const int64_t KB = K / 32;
  __m512 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    __m512i isum[R][NT];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < NT; ++t) isum[r][t] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      __m512i wv[NT];
      for (int t = 0; t < NT; ++t) {
        _mm_prefetch(reinterpret_cast<const char*>(w[t] + (b * 8 + j) * 64 + 512), _MM_HINT_T0);
        wv[t] = _mm512_loadu_si512(w[t] + (b * 8 + j) * 64);
      }
      if (const char* line = pf->next()) _mm_prefetch(line, _MM_HINT_T1);
      for (int r = 0; r < R; ++r) {
        const __m512i xb = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xq + r * K + b * 32 + j * 4));
        for (int t = 0; t < NT; ++t) isum[r][t] = _mm512_dpbusd_epi32(isum[r][t], wv[t], xb);
      }
    }
    for (int t = 0; t < NT; ++t) {
      const __m512 d = _mm512_loadu_ps(s[t] + b * 32), m = _mm512_loadu_ps(s[t] + b * 32 + 16);
      for (int r = 0; r < R; ++r) {
        const __m512 id = _mm512_mul_ps(_mm512_cvtepi32_ps(isum[r][t]), d);
        acc[r][t] = _mm512_fmadd_ps(id, _mm512_set1_ps(dx[r * KB + b]), acc[r][t]);
        acc[r][t] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * KB + b]), acc[r][t]);
      }
    }
  }
  for (int64_t p = 0; p < P; ++p)
    for (int t = 0; t < NT; ++t) {
      const __m512 wv = _mm512_loadu_ps(wc[t] + p * ldwc);
      for (int r = 0; r < R; ++r) acc[r][t] = _mm512_fmadd_ps(_mm512_set1_ps(xo[r * P + p]), wv, acc[r][t]);
    }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(f + r * NT * 16 + t * 16, acc[r][t]);
}

template <int NT, typename... A>
void micro_rows(int R, A... a) {
  switch (R) {
    case 6: micro<6, NT>(a...); break;
    case 5: micro<5, NT>(a...); break;
    case 4: micro<4, NT>(a...); break;
    case 3: micro<3, NT>(a...); break;
    case 2: micro<2, NT>(a...); break;
    default: micro<1, NT>(a...); break;
  }
}

// The fp32 sums of rows [r, r + R) against the 1-2 tiles from tile t0 into f [R][32] (row stride 32).
void sums(const Gemm& g, int64_t r, int R, int64_t t0, int nt, float* f, NextPanels& pf) {
  const int64_t KB = g.K / 32;
  const uint8_t* w[2] = {g.q8 + t0 * KB * 512, g.q8 + (t0 + nt - 1) * KB * 512};
  const float* s[2] = {g.scales + t0 * KB * 32, g.scales + (t0 + nt - 1) * KB * 32};
  const float* wc[2] = {g.wc + t0 * 16, g.wc + (t0 + nt - 1) * 16};
  alignas(64) float tmp[kMR * 32];
  const int8_t* xq = g.xq + r * g.K;
  const float *dx = g.dx + r * KB, *sx = g.sx + r * KB, *xo = g.xo + r * g.P;
  if (nt == 2) {
    micro_rows<2>(R, xq, dx, sx, g.K, w, s, xo, g.P, wc, g.ldwc, f, &pf);
    return;
  }
  micro_rows<1>(R, xq, dx, sx, g.K, w, s, xo, g.P, wc, g.ldwc, tmp, &pf);
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(f + i * 32, _mm512_loadu_ps(tmp + i * 16));
}

// The tiles of the column block at n0 (silu_mul: and up's) into pf.
void add_panels(const Gemm& g, int64_t n0, NextPanels& pf) {
  const int64_t KB = g.K / 32, t0 = n0 / 16, nt = g.N - n0 > 16 ? 2 : 1;
  for (int64_t t = t0; t < t0 + nt; ++t)
    for (const int64_t u : {t, t + g.N / 16}) {
      pf.add(g.q8 + u * KB * 512, KB * 512);
      pf.add(g.scales + u * KB * 32, KB * 32 * sizeof(float));
      if (!g.silu) break;
    }
}

// Output columns [n0, n0 + cols) (cols <= 32) of rows [r0, r1); next_n0 >= 0: the column block this thread runs
// next, whose panels these calls bring into L2.
void column_block(const Gemm& g, int64_t r0, int64_t r1, int64_t n0, int64_t cols, int64_t next_n0) {
  alignas(64) float f[kMR * 32], fu[kMR * 32];
  const int64_t t0 = n0 / 16;
  const int nt = cols > 16 ? 2 : 1;
  NextPanels next;
  if (next_n0 >= 0) add_panels(g, next_n0, next);
  for (int64_t r = r0; r < r1; r += kMR) {
    const int R = static_cast<int>(std::min<int64_t>(kMR, r1 - r));
    sums(g, r, R, t0, nt, f, next);
    if (g.silu) {  // cols == 16 * nt (N % 16 == 0); up's tiles follow gate's N / 16
      sums(g, r, R, t0 + g.N / 16, nt, fu, next);
      for (int i = 0; i < R; ++i) {
        bf16* ym = g.y + (r + i) * g.ldy + n0;
        for (int j = 0; j < cols; j += 16) {
          __m512 gv = _mm512_loadu_ps(f + i * 32 + j), uv = _mm512_loadu_ps(fu + i * 32 + j);
          if (g.bias) {
            gv = _mm512_add_ps(gv, load16(g.bias + n0 + j));
            uv = _mm512_add_ps(uv, load16(g.bias + g.N + n0 + j));
          }
          gv = round_to(gv, ym), uv = round_to(uv, ym);
          store16(ym + j, _mm512_mul_ps(round_to(silu16(gv), ym), uv));
        }
      }
      continue;
    }
    for (int i = 0; i < R; ++i) {
      bf16* ym = g.y + (r + i) * g.ldy + n0;
      const float* fm = f + i * 32;
      int64_t j = 0;
      for (; j + 16 <= cols; j += 16) {
        __m512 v = _mm512_loadu_ps(fm + j);
        if (g.bias) v = _mm512_add_ps(v, load16(g.bias + n0 + j));
        store16(ym + j, v);
      }
      for (; j < cols; ++j) ym[j] = static_cast<bf16>(fm[j] + (g.bias ? to_float(g.bias[n0 + j]) : 0.f));
    }
  }
}

void run(const Gemm& g) {
  const int64_t blocks = (g.N + 31) / 32, chunks = (g.M + kRowChunk - 1) / kRowChunk;
  std::vector<uint32_t> keep(g.K / 32, 0xffffffffu);
  for (int64_t p = 0; p < g.P; ++p) keep[g.chan[p] / 32] &= ~(1u << (g.chan[p] % 32));
  at::parallel_for(0, g.M, 16, [&](int64_t r0, int64_t r1) { quantize_rows(g, keep.data(), r0, r1); });
  // items (row chunk, column block), row-chunk-major: a thread's neighbouring items share the chunk's int8 rows
  claim_from_both_ends(chunks * blocks, 1, [&](int64_t lo, int64_t hi, bool ascending) {
    for (int64_t k = 0; k < hi - lo; ++k) {
      const int64_t u = ascending ? lo + k : hi - 1 - k, c = u / blocks, nb = u % blocks;
      const int64_t r0 = c * kRowChunk, n0 = nb * 32;
      const int64_t u_next = ascending ? u + 1 : u - 1;  // the item this thread runs next, if it has one in hand
      const int64_t next_n0 = k + 1 < hi - lo && u_next / blocks == c ? u_next % blocks * 32 : -1;
      column_block(g, r0, std::min(g.M, r0 + kRowChunk), n0, std::min<int64_t>(32, g.N - n0), next_n0);
    }
  });
}
#endif

}  // namespace

bool q4_vnni_linear_supported() {
#if defined(PAGELLM_Q4_VNNI)
  return true;
#else
  return false;
#endif
}

// out = x W^T (+ bias), or, silu_mul, out = silu(gate) * up of [gate | up] = x W^T (+ bias), W the 4-bit weight
// in q8 / scales (the layout above); x, out, bias bf16. channels (int32 [P], P <= K) and wc (fp32 [P, N/16 * 16]):
// the weight's outlier channels and its values there, which the first call chooses and writes (channels[0] < 0
// until then; P = 0: none).
void q4_vnni_linear(const at::Tensor& x, const at::Tensor& q8, const at::Tensor& scales, at::Tensor channels,
                    at::Tensor wc, const c10::optional<at::Tensor>& bias, at::Tensor out, bool silu_mul) {
  TORCH_CHECK(q4_vnni_linear_supported(), "q4_vnni_linear needs AVX512-VNNI and AVX512-BW");
  const int64_t w_tiles = q8.dim() > 0 ? q8.size(0) : 0, N = out.dim() == 2 ? out.size(1) : 0;
  TORCH_CHECK(!silu_mul || N % 16 == 0, "q4_vnni_linear silu_mul: the intermediate size must be a multiple of 16");
  check_tile_rows(x, bias, out, silu_mul ? 2 * N : N, w_tiles, "q8");  // silu_mul: [gate | up], 2N columns
  TORCH_CHECK(q8.dim() == 4 && q8.is_contiguous() && q8.scalar_type() == at::kByte && q8.size(2) == 8 &&
              q8.size(3) == 64 && q8.size(1) * 32 == x.size(1), "q8: uint8 [N/16, K/32, 8, 64]");
  TORCH_CHECK(scales.dim() == 4 && scales.is_contiguous() && scales.scalar_type() == at::kFloat &&
              scales.size(0) == w_tiles && scales.size(1) == q8.size(1) && scales.size(2) == 2 && scales.size(3) == 16,
              "scales: float32 [N/16, K/32, 2, 16]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16, "x, out: bfloat16");
  const int64_t P = channels.numel();
  TORCH_CHECK(channels.dim() == 1 && channels.is_contiguous() && channels.scalar_type() == at::kInt &&
              P <= x.size(1), "channels: int32 [P], P <= K");
  TORCH_CHECK(wc.dim() == 2 && wc.is_contiguous() && wc.scalar_type() == at::kFloat && wc.size(0) == P &&
              wc.size(1) == w_tiles * 16, "wc: float32 [P, N/16 * 16]");
#if defined(PAGELLM_Q4_VNNI)
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor dsx = at::empty({2, M, K / 32}, x.options().dtype(at::kFloat));
  at::Tensor xo = at::empty({M, std::max<int64_t>(P, 1)}, x.options().dtype(at::kFloat));
  int32_t* chan = channels.data_ptr<int32_t>();
  Gemm g{reinterpret_cast<const bf16*>(x.data_ptr()), x.stride(0), M, K, N,
         q8.data_ptr<uint8_t>(), scales.data_ptr<float>(),
         bias.has_value() && bias->defined() ? reinterpret_cast<const bf16*>(bias->data_ptr()) : nullptr,
         reinterpret_cast<bf16*>(out.data_ptr()), out.stride(0), silu_mul, xq.data_ptr<int8_t>(),
         dsx.data_ptr<float>(), dsx.data_ptr<float>() + M * (K / 32), P, chan, wc.data_ptr<float>(), w_tiles * 16,
         xo.data_ptr<float>()};
  if (P > 0 && chan[0] < 0) choose_outliers(g, chan, wc.data_ptr<float>());
  for (int64_t p = 0; p < P; ++p)
    TORCH_CHECK(chan[p] >= 0 && chan[p] < K && (p == 0 || chan[p] > chan[p - 1]), "channels: ascending, in [0, K)");
  run(g);
#endif
}

TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("q4_vnni_linear(Tensor x, Tensor q8, Tensor scales, Tensor(a!) channels, Tensor(b!) wc, Tensor? bias, "
        "Tensor(c!) out, bool silu_mul) -> ()");
  m.impl("q4_vnni_linear", c10::DispatchKey::CPU, &q4_vnni_linear);
  m.def("q4_vnni_linear_supported() -> bool", [] { return q4_vnni_linear_supported(); });
}
