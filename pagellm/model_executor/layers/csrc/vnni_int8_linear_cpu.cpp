// y = x W^T (+ bias) for a GGUF weight of any type (any layout of layers/quantized.py: pack_vnni_int8) on
// AVX512-VNNI's int8 dot product: the weight's values rounded to int8 per output column at load (or, for types of
// finer steps such as Q8_0 and Q6_K, per 32-deep block: below), x to int8 per row at each call, as vLLM's int8
// linears (per-channel weights, dynamic per-token activations); for CPUs without AMX (layers/linear.py:
// CPULinear.vnni_int8; EngineConfig.gguf_int8_activations).
//
// Why: without AMX the bf16 linears run on VDPBF16PS (Zen 4) or fp32 FMAs, and there they are bound by the
// multiply-adds, not by memory: on Zen 4 the 120 layer linears ran at 93-98% of VDPBF16PS's peak, ~75% of
// workload_64's time. VPDPBUSD retires at the same rate there (3.65 G/s a core) with twice the products (64 a
// zmm), and at twice the fp32 FMA's rate on Intel (6.8 G/s a core here) with four times its products. On Zen 4
// every other vector operation of the loop shares VPDPBUSD's pipes. The 4-bit weight as it is (d q + m per 32-deep
// block, x scaled per block as llama.cpp's Q4_1 x Q8_1) took four such operations a block besides its 8 VPDPBUSD
// sets; the weight rounded to int8 per block took two (conversion, the block's step): the 120 linears took
// 0.82-0.85x the time at 64-2,048 rows. One step per column takes none: the int32 sums run the whole depth, and
// the linears took 0.88-0.89x that again (2026-12-06).
//
// The math, per row r and output column n. The weight's column (exact in fp32, e.g. w = d q + m a block) is s[n] *
// w8 with s = max|w| / 127 over the column and w8 = round_half_even(w * (1 / s)) (layers/quantized.py:
// pack_vnni_int8; at most s / 2 off). x's row is dx[r] * xq, dx = max|x| / 127, xq = round_half_even(x * (1 / dx))
// in [-127, 127], stored as xq + 128 (VPDPBUSD's unsigned operand). Then
//   y[r][n] = dx[r] * s[n] * I[r][n],  I = sum_k xq w8 (int32, exact),
// I's sums starting from the column's offset -128 * sum_k w8 to take out x's + 128; I is converted to fp32 once
// (exact below 2^24, within fp32's rounding above), times s, then times dx. Partial sums stay within
// K * (128 + 255) * 127, under 2^31 up to K = VNNI_INT8_MAX_K (44,128). A row holding a NaN or an infinity gets NaN.
// Teacher-forced agreement with fp32 on workload_16 (`pagellm bench agreement`): 99.02% (lowest prompt 97.66%) on
// Zen 4, against 99.07% (96.88%) with a step per 32-deep block, 99.46% (98.44%) with the 4-bit weight as it is
// and x scaled per block, and 99.71% on the bf16 weights; on workload_64 98.54% against 98.73% with a step per
// block.
//
// Outlier channels: a few input channels of a model's activations run ~20x the rest (SmolLM2's norm outputs), and
// a row holding one gets a step that leaves its other values a few int8 steps: teacher-forced agreement on the
// tests' text prompts fell from 97.4% (bf16 x, the same weights) to 95.8% with x scaled per block. So each weight
// keeps P channels (layers/weight_forms.py: INT8_OUTLIER_CHANNELS, 8) out of x's int8 values: chosen once, on its first
// call, as the channels of largest |x| over that call's rows (ties: the lower index), they are zeroed before x is
// quantized and added exactly instead, x[r][c] (bf16) times the weight's value there (s w8), after the sums, 2-4%
// more multiply-adds. The choice lives in the caller's tensors (channels, wc), so every later call, in either layer
// loop, takes the same one and a row's output does not depend on the other rows of its call; the engine makes the
// first call a fixed prompt's (LLMEngine.choose_int8_outliers), so it is the same in every engine of a model.
//
// A step per 32-deep block instead (scales [N/16][K/32][2][16]): s[n,b] = max|w| / 127 over the block, and
//   y[r][n] = dx[r] * sum_b s[n,b] * I_b[r][n],
// each block's int32 sums from its own offset, converted and added in fp32 block by block (a conversion and a
// multiply-add per 8 VPDPBUSD: the 120 layer linears took ~1.13x a step per column's time when the 4-bit weights
// ran so, 2026-12-06). For a file whose own steps are finer than one per column can follow (Q8_0: this form holds
// its values exactly; Q6_K), where the per-column form's guard turns the weight down.
//
// Layout (layers/quantized.py: pack_vnni_int8): q8 int8 [N/16][K/32][8][64]: row j of a block holds, at byte 4 n + e,
// column n's w8 at depth 4 j + e (one VPDPBUSD operand: 16 columns x 4 depths); scales fp32 [N/16][2][16]: the 16
// columns' s, then the bits of their int32 offsets (a step per block: [N/16][K/32][2][16], the block's). Columns
// past N (N % 16) have w8 = s = 0.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "outlier_channels.h"
#include "split_work.h"
#include "tile_linear.h"
#include "vec.h"

namespace {
using namespace pagellm;

// The deepest weight whose int32 sums cannot overflow with a step per column: K * (128 + 255) * 127 < 2^31, a
// multiple of 32 (layers/linear.py: VNNI_INT8_MAX_K, past which the engine takes a step per block)
constexpr int64_t kMaxK = 44128;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PAGELLM_INT8_VNNI 1
using bf16 = c10::BFloat16;

constexpr int64_t kRowChunk = 256;  // rows of x whose int8 copy (K bytes each) stays in L2 across column blocks
// Rows per micro-kernel call: 2 x kMR int32 accumulators. 6 against 4: SmolLM2's 120 layer linears at 2,048 rows
// took 0.94-0.99x the time on Zen 4 in four of five alternating runs (1.05x in one, with a step per block then).
// With NextPanels below, 64 rows (decode) took 0.94-0.96x (three runs). With a step per column, 8 rows took 1.04x
// at 2,048 rows and 64, 12 rows 1.09x (2026-12-06).
constexpr int kMR = 6;

struct Gemm {
  const bf16* x;
  int64_t ldx, M, K, N;  // N: out's columns (silu: the intermediate size; the weight has 2N)
  const int8_t* w8;
  const float* scales;
  bool per_block;       // scales [N/16][K/32][2][16] (a step per 32-deep block), else [N/16][2][16]
  int64_t tile_scales;  // floats of scales a 16-column tile holds: K/32 * 32, or 32
  const bf16* bias;
  bf16* y;
  int64_t ldy;
  bool silu;
  uint8_t* xu;          // [M][K]: x's int8 values plus 128
  float* dx;            // [M]: x's step per row
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

// The outlier channels, once per weight (chan[0] < 0: not chosen yet; outlier_channels.h), and wc, the weight's
// values there (s w8, exact in fp32).
void choose_outliers(const Gemm& g, int32_t* chan, float* wc) {
  choose_outlier_channels(g.x, g.ldx, g.M, g.K, g.P, chan);
  const int64_t KB = g.K / 32, tiles = g.ldwc / 16;
  for (int64_t p = 0; p < g.P; ++p) {
    const int64_t c = chan[p], b = c / 32, j = c % 32 / 4, e = c % 4;
    for (int64_t t = 0; t < tiles; ++t) {
      const float* s = g.scales + t * g.tile_scales + (g.per_block ? b * 32 : 0);
      for (int64_t n = 0; n < 16; ++n)
        wc[p * g.ldwc + t * 16 + n] = s[n] * g.w8[((t * KB + b) * 8 + j) * 64 + 4 * n + e];
    }
  }
}

// x's rows [r0, r1) as int8 values plus 128: xu [M][K] (uint8, VPDPBUSD's unsigned operand) and dx [M], the
// outlier channels zeroed (keep: per 32-deep block, the lanes not zeroed, low 16 and high 16) and copied into xo.
void quantize_rows(const Gemm& g, const uint32_t* keep, int64_t r0, int64_t r1) {
  const int64_t K = g.K, KB = K / 32;
  const float inf = std::numeric_limits<float>::infinity();
  const __m512i bias = _mm512_set1_epi32(128);
  for (int64_t r = r0; r < r1; ++r) {
    const bf16* x = g.x + r * g.ldx;
    for (int64_t p = 0; p < g.P; ++p) g.xo[r * g.P + p] = static_cast<float>(x[g.chan[p]]);
    auto block = [&](int64_t b, __m512& v0, __m512& v1) {
      v0 = _mm512_maskz_mov_ps(static_cast<__mmask16>(keep[b]), load16(x + b * 32));
      v1 = _mm512_maskz_mov_ps(static_cast<__mmask16>(keep[b] >> 16), load16(x + b * 32 + 16));
    };
    // max|x| on the bf16 bits, 32 values a step: without the sign bit a bf16 orders as its bits (0x7f80 infinity,
    // above it NaN), and bf16 to fp32 is exact, so this is the fp32 values' max|x| (a third of the operations)
    const __m512i magnitude = _mm512_set1_epi16(0x7fff);
    __m512i top = _mm512_setzero_si512();
    for (int64_t b = 0; b < KB; ++b) {
      const __m512i v = _mm512_and_si512(_mm512_loadu_si512(x + b * 32), magnitude);
      top = _mm512_mask_max_epu16(top, static_cast<__mmask32>(keep[b]), top, v);
    }
    const uint32_t bits = static_cast<uint32_t>(_mm512_reduce_max_epu32(
        _mm512_max_epu32(_mm512_and_si512(top, _mm512_set1_epi32(0xffff)), _mm512_srli_epi32(top, 16))));
    // d = max|x| / 127, NaN where the row holds a NaN or an infinity; 1 / d, 0 for an all-zero row and where d is
    // below 2^-128 (1 / d overflows): then every value is 0
    const float amax = to_float(c10::BFloat16(static_cast<uint16_t>(bits), c10::BFloat16::from_bits()));
    const float d = bits >= 0x7f80 ? std::numeric_limits<float>::quiet_NaN() : amax / 127.f;
    const float id = d > 0.f && 1.f / d < inf ? 1.f / d : 0.f;
    g.dx[r] = d;
    const __m512 vid = _mm512_set1_ps(id);
    uint8_t* qr = g.xu + r * K;
    for (int64_t b = 0; b < KB; ++b) {
      __m512 v0, v1;
      block(b, v0, v1);
      // nearest, ties to even (MXCSR's default, as torch.round); |x * id| <= 127 up to rounding, never past 127.5
      const __m512i q0 = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v0, vid)), bias);
      const __m512i q1 = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v1, vid)), bias);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + b * 32), _mm512_cvtepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + b * 32 + 16), _mm512_cvtepi32_epi8(q1));
    }
  }
}

// f [R][NT * 16] = rows xu[0 .. R) (stride K) against NT 16-column tiles w[t] (their [K/32][8][64] int8 values,
// s[t] their [2][16] steps and offsets; PB: [K/32][2][16], a block's), times the rows' dx, then plus the P outlier
// channels' products: xo [R][P] times wc[t] (stride ldwc).
// The int32 sums start from the columns' offsets, -128 times the column's sum of values, so that they come out
// exact as the sums of x's int8 values (not plus 128) times the weight's, and run the whole depth: nothing but
// VPDPBUSD, the loads and prefetches in the loop (PB: they run a block, from its offset, and join fp32 sums times
// its step).
// Each 4-deep step also prefetches one line of pf, the next column block's panels, and, in a column block's first
// row group (PF), its tiles' row one 32-deep block ahead. Later row groups find the panel in L1 (K = 576: 18 KiB)
// or stream it from L2 (K = 1,536: 48 KiB), where the hardware's prefetcher keeps up: without their prefetches,
// SmolLM2's 120 layer linears took 0.97x the time at 2,048 rows and 0.98x at 64 on two threads (Zen 4, medians of
// 9 alternating rounds; one thread, each shape at 2,048 rows: 0.96-0.99x).
template <int R, int NT, bool PB, bool PF>
void micro(const uint8_t* xu, const float* dx, int64_t K, const int8_t* const* w, const float* const* s,
           const float* xo, int64_t P, const float* const* wc, int64_t ldwc, float* f, NextPanels* pf) {
  const int64_t KB = K / 32;
  __m512i isum[R][NT];
  __m512 acc[R][NT];
  for (int t = 0; t < NT; ++t) {
    const __m512i offset = _mm512_loadu_si512(s[t] + 16);
    for (int r = 0; r < R; ++r) isum[r][t] = offset, acc[r][t] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < KB; ++b) {
    if (PB && b > 0)
      for (int t = 0; t < NT; ++t) {
        const __m512i offset = _mm512_loadu_si512(s[t] + b * 32 + 16);
        for (int r = 0; r < R; ++r) isum[r][t] = offset;
      }
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      __m512i wv[NT];
      for (int t = 0; t < NT; ++t) {
        if (PF) _mm_prefetch(reinterpret_cast<const char*>(w[t] + (b * 8 + j) * 64 + 512), _MM_HINT_T0);
        wv[t] = _mm512_loadu_si512(w[t] + (b * 8 + j) * 64);
      }
      if (const char* line = pf->next()) _mm_prefetch(line, _MM_HINT_T1);
      for (int r = 0; r < R; ++r) {
        const __m512i xb = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xu + r * K + b * 32 + j * 4));
        for (int t = 0; t < NT; ++t) isum[r][t] = _mm512_dpbusd_epi32(isum[r][t], xb, wv[t]);
      }
    }
    if (PB)
      for (int t = 0; t < NT; ++t) {
        const __m512 step = _mm512_loadu_ps(s[t] + b * 32);
        for (int r = 0; r < R; ++r) acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][t]), step, acc[r][t]);
      }
  }
  for (int t = 0; t < NT; ++t) {
    const __m512 step = _mm512_loadu_ps(s[t]);
    for (int r = 0; r < R; ++r) {
      const __m512 v = PB ? acc[r][t] : _mm512_mul_ps(_mm512_cvtepi32_ps(isum[r][t]), step);
      acc[r][t] = _mm512_mul_ps(v, _mm512_set1_ps(dx[r]));
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

template <int NT, bool PB, bool PF, typename... A>
void micro_rows(int R, A... a) {
  switch (R) {
    case 6: micro<6, NT, PB, PF>(a...); break;
    case 5: micro<5, NT, PB, PF>(a...); break;
    case 4: micro<4, NT, PB, PF>(a...); break;
    case 3: micro<3, NT, PB, PF>(a...); break;
    case 2: micro<2, NT, PB, PF>(a...); break;
    default: micro<1, NT, PB, PF>(a...); break;
  }
}

template <int NT, typename... A>
void micro_rows(bool per_block, bool pf, int R, A... a) {
  if (per_block) {
    if (pf) micro_rows<NT, true, true>(R, a...); else micro_rows<NT, true, false>(R, a...);
  } else {
    if (pf) micro_rows<NT, false, true>(R, a...); else micro_rows<NT, false, false>(R, a...);
  }
}

// The fp32 sums of rows [r, r + R) against the 1-2 tiles from tile t0 into f [R][32] (row stride 32).
void sums(const Gemm& g, int64_t r, int R, int64_t t0, int nt, float* f, NextPanels& pf, bool first) {
  const int64_t KB = g.K / 32;
  const int8_t* w[2] = {g.w8 + t0 * KB * 512, g.w8 + (t0 + nt - 1) * KB * 512};
  const float* s[2] = {g.scales + t0 * g.tile_scales, g.scales + (t0 + nt - 1) * g.tile_scales};
  const float* wc[2] = {g.wc + t0 * 16, g.wc + (t0 + nt - 1) * 16};
  alignas(64) float tmp[kMR * 32];
  const uint8_t* xu = g.xu + r * g.K;
  const float *dx = g.dx + r, *xo = g.xo + r * g.P;
  if (nt == 2) {
    micro_rows<2>(g.per_block, first, R, xu, dx, g.K, w, s, xo, g.P, wc, g.ldwc, f, &pf);
    return;
  }
  micro_rows<1>(g.per_block, first, R, xu, dx, g.K, w, s, xo, g.P, wc, g.ldwc, tmp, &pf);
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(f + i * 32, _mm512_loadu_ps(tmp + i * 16));
}

// The tiles of the column block at n0 (silu_mul: and up's) into pf.
void add_panels(const Gemm& g, int64_t n0, NextPanels& pf) {
  const int64_t KB = g.K / 32, t0 = n0 / 16, nt = g.N - n0 > 16 ? 2 : 1;
  for (int64_t t = t0; t < t0 + nt; ++t)
    for (const int64_t u : {t, t + g.N / 16}) {
      pf.add(g.w8 + u * KB * 512, KB * 512);
      pf.add(g.scales + u * g.tile_scales, g.tile_scales * sizeof(float));
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
    sums(g, r, R, t0, nt, f, next, r == r0);
    if (g.silu) {  // cols == 16 * nt (N % 16 == 0); up's tiles follow gate's N / 16
      sums(g, r, R, t0 + g.N / 16, nt, fu, next, r == r0);
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

bool vnni_int8_linear_supported() {
#if defined(PAGELLM_INT8_VNNI)
  return true;
#else
  return false;
#endif
}

// out = x W^T (+ bias), or, silu_mul, out = silu(gate) * up of [gate | up] = x W^T (+ bias), W a GGUF weight's
// int8 form in q8 / scales (the layout above: a step per column, or per block where scales has four dimensions);
// x, out, bias bf16. channels (int32 [P], P <= K) and wc (fp32 [P, N/16 * 16]): the weight's outlier channels and
// its values there, which the first call chooses and writes (channels[0] < 0 until then; P = 0: none).
void vnni_int8_linear(const at::Tensor& x, const at::Tensor& q8, const at::Tensor& scales, at::Tensor channels,
                      at::Tensor wc, const c10::optional<at::Tensor>& bias, at::Tensor out, bool silu_mul) {
  TORCH_CHECK(vnni_int8_linear_supported(), "vnni_int8_linear needs AVX512-VNNI and AVX512-BW");
  const int64_t w_tiles = q8.dim() > 0 ? q8.size(0) : 0, N = out.dim() == 2 ? out.size(1) : 0;
  TORCH_CHECK(!silu_mul || N % 16 == 0, "vnni_int8_linear silu_mul: the intermediate size must be a multiple of 16");
  check_tile_rows(x, bias, out, silu_mul ? 2 * N : N, w_tiles, "q8");  // silu_mul: [gate | up], 2N columns
  TORCH_CHECK(q8.dim() == 4 && q8.is_contiguous() && q8.scalar_type() == at::kChar && q8.size(2) == 8 &&
              q8.size(3) == 64 && q8.size(1) * 32 == x.size(1), "q8: int8 [N/16, K/32, 8, 64]");
  const bool per_block = scales.dim() == 4;  // (then the int32 sums run 32 deep: any K)
  TORCH_CHECK(per_block || x.size(1) <= kMaxK, "vnni_int8_linear: K = ", x.size(1), " is over ", kMaxK,
              ", past which the int32 sums could overflow (a step per 32-deep block takes it)");
  TORCH_CHECK((scales.dim() == 3 || per_block) && scales.is_contiguous() && scales.scalar_type() == at::kFloat &&
              scales.size(0) == w_tiles &&
              (per_block ? scales.size(1) == q8.size(1) && scales.size(2) == 2 && scales.size(3) == 16
                         : scales.size(1) == 2 && scales.size(2) == 16),
              "scales: float32 [N/16, 2, 16], or [N/16, K/32, 2, 16]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16, "x, out: bfloat16");
  const int64_t P = channels.numel();
  TORCH_CHECK(channels.dim() == 1 && channels.is_contiguous() && channels.scalar_type() == at::kInt &&
              P <= x.size(1), "channels: int32 [P], P <= K");
  TORCH_CHECK(wc.dim() == 2 && wc.is_contiguous() && wc.scalar_type() == at::kFloat && wc.size(0) == P &&
              wc.size(1) == w_tiles * 16, "wc: float32 [P, N/16 * 16]");
#if defined(PAGELLM_INT8_VNNI)
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor xu = at::empty({M, K}, x.options().dtype(at::kByte));
  at::Tensor dx = at::empty({M}, x.options().dtype(at::kFloat));
  at::Tensor xo = at::empty({M, std::max<int64_t>(P, 1)}, x.options().dtype(at::kFloat));
  int32_t* chan = channels.data_ptr<int32_t>();
  Gemm g{reinterpret_cast<const bf16*>(x.data_ptr()), x.stride(0), M, K, N,
         q8.data_ptr<int8_t>(), scales.data_ptr<float>(), per_block, per_block ? q8.size(1) * 32 : 32,
         bias.has_value() && bias->defined() ? reinterpret_cast<const bf16*>(bias->data_ptr()) : nullptr,
         reinterpret_cast<bf16*>(out.data_ptr()), out.stride(0), silu_mul, xu.data_ptr<uint8_t>(),
         dx.data_ptr<float>(), P, chan, wc.data_ptr<float>(), w_tiles * 16,
         xo.data_ptr<float>()};
  if (P > 0 && chan[0] < 0) choose_outliers(g, chan, wc.data_ptr<float>());
  for (int64_t p = 0; p < P; ++p)
    TORCH_CHECK(chan[p] >= 0 && chan[p] < K && (p == 0 || chan[p] > chan[p - 1]), "channels: ascending, in [0, K)");
  run(g);
#endif
}

TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("vnni_int8_linear(Tensor x, Tensor q8, Tensor scales, Tensor(a!) channels, Tensor(b!) wc, Tensor? bias, "
        "Tensor(c!) out, bool silu_mul) -> ()");
  m.impl("vnni_int8_linear", c10::DispatchKey::CPU, &vnni_int8_linear);
  m.def("vnni_int8_linear_supported() -> bool", [] { return vnni_int8_linear_supported(); });
}
