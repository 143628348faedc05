// The FMA linear kernel (fma_linear_cpu.cpp) for CPUs with AVX2 and FMA but no AVX-512, e.g. AMD Zen 2/3: the
// same packed weight ([N/16][K/32][16 k-pairs][16 n][2], layers/linear.py: pack_amx), 8-lane fp32 FMAs.
//
// Why: there, torch's bf16 GEMM (oneDNN's reference path without AVX512-BW) ran 5-11 GFLOP/s on two cores and its
// fp32 one (MKL) 19-52, against ~190 the two cores' FMAs can do; SmolLM2 prefilled a 128-token prompt in ~4.8 s.
//
// A 16-column panel row of one k-pair is 64 bytes: two 8-lane loads, each split into the columns at k even (a
// shift) and at k odd (a mask), as the AVX-512 kernel does. The unit of work is (row chunk, 16-column panel); a
// micro-block is up to kMR rows x 16 columns in 12 fp32 accumulators over all of K, x converted once per row chunk
// to fp32 in k-pair-interleaved order [K/2][kMR][2], so every broadcast is at a fixed offset from one pointer.
// silu_mul runs gate's panel, then up's panel of the same columns (each 12 accumulators), and writes only
// silu(gate) * up, with silu_and_mul's rounding (vec8.h's silu8 in both), so the result is the two steps' bits.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "split_work.h"
#include "vec.h"
#include "vec8.h"

#if defined(PAGELLM_HAS_AVX2)
namespace pagellm::avx2_linear {
using bf16 = c10::BFloat16;

constexpr int kMR = 6;                   // rows per micro-block: 6 x 2 accumulators + the panel's registers
constexpr int64_t kRowChunk = kMR * 16;  // rows per work item; its fp32 copy (<= 590 KB at K = 1,536) stays in L2
constexpr int kPrefetchBytes = 1024;     // each panel row prefetched one 32-deep step (1 KiB) ahead

struct Gemm {
  const bf16* x;
  int64_t lda, M, K;
  const uint16_t* bp;  // packed w
  int64_t N;           // y's columns
  int64_t up_tile;     // silu_mul: up's first 16-column panel; 0: plain
  const bf16* bias;
  bf16* y;
  int64_t ldy;
  int64_t blocks;  // panels (work items) per row chunk
};

// A row chunk splits into near-equal micro-blocks (64 rows: 6 x 6 and 4 x 7 rather than ten of 6 and one of 4).
inline int64_t micro_blocks(int64_t rows) { return (rows + kMR - 1) / kMR; }
inline int64_t micro_start(int64_t rows, int64_t i) { return rows * i / micro_blocks(rows); }

// Rows [m0, m0 + rows) of x into a: micro-block i at a + i * kMR * K, fp32 [K/2][kMR][2].
inline void convert_rows(const Gemm& g, int64_t m0, int64_t rows, float* a) {
  const int64_t K = g.K;
  for (int64_t i = 0; i < micro_blocks(rows); ++i) {
    double* dst = reinterpret_cast<double*>(a + i * kMR * K);  // one k-pair: 8 bytes
    const int64_t r0 = micro_start(rows, i), n = micro_start(rows, i + 1) - r0;
    for (int64_t m = 0; m < n; ++m) {
      const bf16* src = g.x + (m0 + r0 + m) * g.lda;
      for (int64_t k = 0; k < K; k += 8) {  // 8 values, 4 k-pairs: one 64-bit store each, kMR pairs apart
        const __m256 v = v8::load8(src + k);
        const __m128d lo = _mm_castps_pd(_mm256_castps256_ps128(v)), hi = _mm_castps_pd(_mm256_extractf128_ps(v, 1));
        double* d = dst + k / 2 * kMR + m;
        _mm_storel_pd(d, lo), _mm_storeh_pd(d + kMR, lo), _mm_storel_pd(d + 2 * kMR, hi), _mm_storeh_pd(d + 3 * kMR, hi);
      }
    }
  }
}

// R rows (R <= kMR) of a micro-block x one panel: a, the micro-block's fp32 [K/2][kMR][2]; b, the packed panel.
template <int R>
PAGELLM_INLINE void micro(const float* a, const uint16_t* b, int64_t kc_n, __m256 (&out)[kMR][2]) {
  __m256 acc[R][2];
  PAGELLM_UNROLL for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  const __m256i odd = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t kc = 0; kc < kc_n; ++kc) {
    const uint16_t* bk = b + kc * 512;
    const float* ak = a + kc * 16 * kMR * 2;
    PAGELLM_UNROLL for (int r = 0; r < 16; ++r) {  // k-pair r of this 32-deep step
      const uint16_t* row = bk + r * 32;
      _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16));
      const float* ar = ak + r * kMR * 2;
      const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));
      const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
      PAGELLM_UNROLL for (int m = 0; m < R; ++m) {
        const __m256 x = _mm256_broadcast_ss(ar + 2 * m);
        acc[m][0] = _mm256_fmadd_ps(x, e0, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(x, e1, acc[m][1]);
      }
      const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(w0, odd));
      const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(w1, odd));
      PAGELLM_UNROLL for (int m = 0; m < R; ++m) {
        const __m256 x = _mm256_broadcast_ss(ar + 2 * m + 1);
        acc[m][0] = _mm256_fmadd_ps(x, o0, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(x, o1, acc[m][1]);
      }
    }
  }
  PAGELLM_UNROLL for (int m = 0; m < R; ++m) out[m][0] = acc[m][0], out[m][1] = acc[m][1];
}

// A panel as fp32 [K][16] (k-major, one 64-byte row per k): what micro_f32 reads, made once per work item when the
// item has several micro-blocks, so their inner loops run no conversions (shift, mask) and hold 12 accumulators,
// 2 weight vectors and a broadcast in the 16 registers (the bf16 loop needs more and spills).
inline void panel_to_f32(const uint16_t* b, int64_t kc_n, float* wf) {
  const __m256i odd = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t kp = 0; kp < kc_n * 16; ++kp) {  // k-pair kp: k = 2 kp, 2 kp + 1
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + kp * 32));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + kp * 32 + 16));
    float* even = wf + kp * 32;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(even), _mm256_slli_epi32(w0, 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(even + 8), _mm256_slli_epi32(w1, 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(even + 16), _mm256_and_si256(w0, odd));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(even + 24), _mm256_and_si256(w1, odd));
  }
}

// micro on a panel made by panel_to_f32.
template <int R>
PAGELLM_INLINE void micro_f32(const float* a, const float* wf, int64_t K, __m256 (&out)[kMR][2]) {
  __m256 acc[R][2];
  PAGELLM_UNROLL for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    const float* ar = a + k * kMR;  // k-pair k / 2: [kMR][2]
    const float* wk = wf + k * 16;
    PAGELLM_UNROLL for (int e = 0; e < 2; ++e) {
      __m256 w0 = _mm256_loadu_ps(wk + 16 * e), w1 = _mm256_loadu_ps(wk + 16 * e + 8);
      // in registers: folded into each FMA as a memory operand they cost a load per FMA, and with the broadcasts the
      // loads then outnumber what the core issues per cycle
      __asm__("" : "+x"(w0), "+x"(w1));
      PAGELLM_UNROLL for (int m = 0; m < R; ++m) {
        const __m256 x = _mm256_broadcast_ss(ar + 2 * m + e);
        acc[m][0] = _mm256_fmadd_ps(x, w0, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(x, w1, acc[m][1]);
      }
    }
  }
  PAGELLM_UNROLL for (int m = 0; m < R; ++m) out[m][0] = acc[m][0], out[m][1] = acc[m][1];
}

// bf16 of v (+ bias) into y's 8 columns, the first `cols` of them.
inline void store_cols(bf16* y, __m256 v, const bf16* bias, int64_t cols) {
  if (cols >= 8) {
    if (bias) v = _mm256_add_ps(v, v8::load8(bias));
    v8::store8(y, v);
    return;
  }
  alignas(32) float f[8];
  _mm256_store_ps(f, v);
  for (int64_t c = 0; c < cols; ++c) y[c] = static_cast<bf16>(bias ? f[c] + static_cast<float>(bias[c]) : f[c]);
}

// One micro-block's R rows at y's rows m0.. and panel nb: multiplies, then the epilogue. wf: null, or the panel
// (and for silu_mul up's panel after it) as fp32 (panel_to_f32).
template <int R>
void micro_block(const Gemm& g, const float* a, int64_t m0, int64_t nb, const float* wf) {
  const int64_t panel = g.K / 32 * 512, kc_n = g.K / 32, n0 = nb * 16;
  __m256 acc[kMR][2];
  if (wf) micro_f32<R>(a, wf, g.K, acc);
  else micro<R>(a, g.bp + nb * panel, kc_n, acc);
  if (g.up_tile > 0) {  // silu_mul: the same columns of up's panel, then silu(gate) * up
    __m256 up[kMR][2];
    if (wf) micro_f32<R>(a, wf + g.K * 16, g.K, up);
    else micro<R>(a, g.bp + (nb + g.up_tile) * panel, kc_n, up);
    for (int m = 0; m < R; ++m) {
      bf16* ym = g.y + (m0 + m) * g.ldy + n0;
      PAGELLM_UNROLL for (int h = 0; h < 2; ++h) {
        __m256 gv = acc[m][h], uv = up[m][h];
        if (g.bias)
          gv = _mm256_add_ps(gv, v8::load8(g.bias + n0 + 8 * h)),
          uv = _mm256_add_ps(uv, v8::load8(g.bias + g.N + n0 + 8 * h));
        gv = v8::round_bf16(gv), uv = v8::round_bf16(uv);
        v8::store8(ym + 8 * h, _mm256_mul_ps(v8::round_bf16(v8::silu8(gv)), uv));
      }
    }
    return;
  }
  const int64_t cols = std::min<int64_t>(16, g.N - n0);
  for (int m = 0; m < R; ++m) {
    bf16* ym = g.y + (m0 + m) * g.ldy + n0;
    PAGELLM_UNROLL for (int h = 0; h < 2; ++h)
      if (cols > 8 * h)
        store_cols(ym + 8 * h, acc[m][h], g.bias ? g.bias + n0 + 8 * h : nullptr, std::min<int64_t>(8, cols - 8 * h));
  }
}

template <int... Rs>
void micro_block_rows(int rows, const Gemm& g, const float* a, int64_t m0, int64_t nb, const float* wf,
                      std::integer_sequence<int, Rs...>) {
  ((rows == Rs + 1 ? micro_block<Rs + 1>(g, a, m0, nb, wf) : void()), ...);
}

// Work items u = (row chunk u / blocks, panel u % blocks), [lo, hi) in the given direction. wf: room for two
// panels in fp32, for items of several micro-blocks.
inline void items(const Gemm& g, int64_t lo, int64_t hi, bool ascending, std::vector<float>& a, int64_t& a_chunk,
                  float* wf) {
  const int64_t panel = g.K / 32 * 512;
  for (int64_t k = 0; k < hi - lo; ++k) {
    const int64_t u = ascending ? lo + k : hi - 1 - k;
    const int64_t chunk = u / g.blocks, nb = u % g.blocks;
    const int64_t m0 = chunk * kRowChunk, rows = std::min(kRowChunk, g.M - m0);
    if (chunk != a_chunk) convert_rows(g, m0, rows, a.data()), a_chunk = chunk;
    const bool f32 = micro_blocks(rows) > 1;
    if (f32) {
      panel_to_f32(g.bp + nb * panel, g.K / 32, wf);
      if (g.up_tile > 0) panel_to_f32(g.bp + (nb + g.up_tile) * panel, g.K / 32, wf + g.K * 16);
    }
    for (int64_t i = 0; i < micro_blocks(rows); ++i) {
      const int64_t r0 = micro_start(rows, i);
      micro_block_rows(static_cast<int>(micro_start(rows, i + 1) - r0), g, a.data() + i * kMR * g.K, m0 + r0, nb,
                       f32 ? wf : nullptr, std::make_integer_sequence<int, kMR>{});
    }
  }
}

// Items claimed from both ends (split_work.h); a thread keeps its fp32 copy of a row chunk across its claims.
inline void run(Gemm g) {
  const int64_t chunks = (g.M + kRowChunk - 1) / kRowChunk;
  g.blocks = g.up_tile > 0 ? g.N / 16 : (g.N + 15) / 16;
  const int64_t scratch = micro_blocks(std::min(kRowChunk, g.M)) * kMR * g.K;
  static std::atomic<uint64_t> calls{0};
  const uint64_t call = ++calls;
  claim_from_both_ends(chunks * g.blocks, 2, [&](int64_t lo, int64_t hi, bool ascending) {
    thread_local std::vector<float> a, wf;
    thread_local uint64_t a_call = 0;
    thread_local int64_t a_chunk = -1;
    if (a_call != call) {
      a_call = call, a_chunk = -1;
      if (static_cast<int64_t>(a.size()) < scratch) a.resize(scratch);
      if (static_cast<int64_t>(wf.size()) < 32 * g.K) wf.resize(32 * g.K);
    }
    items(g, lo, hi, ascending, a, a_chunk, wf.data());
  });
}

}  // namespace pagellm::avx2_linear
#endif
