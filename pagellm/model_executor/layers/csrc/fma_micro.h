// The FMA linear kernel's micro-kernels (fma_linear_cpu.cpp, whose file comment explains the three ways they sum):
// R rows of x against NP 16-column panels of the packed weight over all of K, in registers; and job_sums, the same
// arithmetic for independent (row, panel) pairs side by side (the LM head's screen, argmax_screen_cpu.cpp, asks for
// a few columns with fma_linear's bits).
#pragma once

#include <cstdint>

#include "vec.h"

namespace pagellm::fma {

// How the micro-kernel sums: fp32 FMAs on the widened bf16 weight, fp16 FMAs on an fp16 copy, or bf16 dot products.
enum class Sums { kFp32, kFp16, kDot };

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int kMR = 12;                 // rows per micro-block: 12 x 2 accumulators + 4 weight registers
// fp16 sums (fma_linear_cpu.cpp's file comment): x rows scaled by a power of two to a largest |value| in
// [256, 512), weights to one in [0.5, 1), so kFlushSteps x 16 products per lane stay below 2^14 (fp16's largest).
constexpr int kFlushSteps = 2;  // 32-deep steps between flushes of the fp16 accumulators into fp32
constexpr int kRowExp = 9;      // a row's largest |x| times 2^(kRowExp - its exponent) lies in [256, 512)
// Each panel row's load is preceded by a prefetch of the same row one 32-deep step ahead (16 lines, 1 KiB): the
// first micro-block of a work item reads its panels from memory, the next ones from L2, and the FMAs waited on
// those loads (the FMA after a panel load held ~8% of the kernel's samples in `perf annotate`).
// At the last step it reaches past the panel, which is harmless: a prefetch never faults.
constexpr int kPrefetchLines = 16;
// The panels of the item a thread runs next come into L2 while it runs this item's micro-blocks 1 and 2 (half of
// each panel during each, one line per k-pair step): the next item's first micro-block then reads them from L2 rather
// than from memory. SmolLM2's linears at 64 rows (decode), alternating in one process: 0.91-0.93x the time on two
// threads, 0.90x on one, the LM head 0.89x; 0.97x at 256 rows, unchanged at 2,048; decode steps of workload_64
// 0.96-0.97x (2026-12-02, AMX-less VM). The AMX kernel does the same (amx_linear_cpu.cpp).

// R rows (R <= kMR) of one micro-block, a: its fp32 [K/2][kMR][2]; b[p]: NP packed bf16 panels; out: [R][NP];
// pn: null, or NP panels to bring into L2 (the next item's), one line per k-pair step.
template <int R, int NP>
PAGELLM_INLINE void micro(const float* a, const uint16_t* const* b, int64_t kc_n, __m512 (&out)[kMR][2],
                          const char* const* pn) {
  __m512 acc[R][NP];
  PAGELLM_UNROLL for (int m = 0; m < R; ++m)
    PAGELLM_UNROLL for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_setzero_ps();
  const __m512i odd = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t kc = 0; kc < kc_n; ++kc) {
    const float* ak = a + kc * 16 * kMR * 2;
    const uint16_t* bk[NP];
    PAGELLM_UNROLL for (int p = 0; p < NP; ++p) bk[p] = b[p] + kc * 512;
    for (int r = 0; r < 16; ++r) {  // k-pair r of this 32-deep step
      __m512 we[NP], wo[NP];  // the panels' 16 columns at k even and k odd, as fp32
      PAGELLM_UNROLL for (int p = 0; p < NP; ++p)
        _mm_prefetch(reinterpret_cast<const char*>(bk[p] + r * 32) + kPrefetchLines * 64, _MM_HINT_T0);
      PAGELLM_UNROLL for (int p = 0; p < NP; ++p) {
        const __m512i w = _mm512_loadu_si512(bk[p] + r * 32);
        we[p] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
        wo[p] = _mm512_castsi512_ps(_mm512_and_si512(w, odd));
      }
      if (pn) {
        const int64_t it = kc * 16 + r;
        _mm_prefetch(pn[it % NP] + (it / NP) * 64, _MM_HINT_T1);
      }
      const float* ar = ak + r * kMR * 2;
      PAGELLM_UNROLL for (int m = 0; m < R; ++m) {
        const __m512 ae = _mm512_set1_ps(ar[2 * m]), ao = _mm512_set1_ps(ar[2 * m + 1]);
        PAGELLM_UNROLL for (int p = 0; p < NP; ++p) {
          acc[m][p] = _mm512_fmadd_ps(ae, we[p], acc[m][p]);
          acc[m][p] = _mm512_fmadd_ps(ao, wo[p], acc[m][p]);
        }
      }
    }
  }
  PAGELLM_UNROLL for (int m = 0; m < R; ++m) PAGELLM_UNROLL for (int p = 0; p < NP; ++p) out[m][p] = acc[m][p];
}

// One 32-deep step kc of the kernels that broadcast x's 32-bit pairs (micro_half, micro_dot): a, [K/2][kMR] pairs;
// for each k-pair, the NP panels' rows as raw vectors, then mac(m, p, pair of row m broadcast, row of panel p).
template <int R, int NP, typename Mac>
PAGELLM_INLINE void pair_step(const int* pairs, const uint16_t* const* b, int64_t kc, const char* const* pn, Mac mac) {
  const int* ak = pairs + kc * 16 * kMR;
  const uint16_t* bk[NP];
  PAGELLM_UNROLL for (int p = 0; p < NP; ++p) bk[p] = b[p] + kc * 512;
  for (int r = 0; r < 16; ++r) {
    __m512i w[NP];
    PAGELLM_UNROLL for (int p = 0; p < NP; ++p) w[p] = _mm512_loadu_si512(bk[p] + r * 32);
    PAGELLM_UNROLL for (int p = 0; p < NP; ++p)
      _mm_prefetch(reinterpret_cast<const char*>(bk[p] + r * 32) + kPrefetchLines * 64, _MM_HINT_T0);
    if (pn) {
      const int64_t it = kc * 16 + r;
      _mm_prefetch(pn[it % NP] + (it / NP) * 64, _MM_HINT_T1);
    }
    const int* ar = ak + r * kMR;
    PAGELLM_UNROLL for (int m = 0; m < R; ++m) {
      const __m512i xv = _mm512_set1_epi32(ar[m]);
      PAGELLM_UNROLL for (int p = 0; p < NP; ++p) mac(m, p, xv, w[p]);
    }
  }
}

#if defined(__AVX512FP16__)
// The same on fp16: a, a micro-block's fp16 pairs [K/2][kMR] and row factors; b[p]: NP packed fp16 panels. A
// 32-bit lane n of a weight vector holds column n at k even and k odd, times the broadcast pair (x_k, x_k+1):
// each fp16 lane sums its own parity's products for kFlushSteps steps, then adds into fp32 (lo: columns 0-7,
// hi: 8-15, parities interleaved); the parities are summed and the scales undone once at the end.
template <int R, int NP>
PAGELLM_INLINE void micro_half(const float* a, const uint16_t* const* b, int64_t kc_n, float w_inv,
                               __m512 (&out)[kMR][2], const char* const* pn) {
  const int* pairs = reinterpret_cast<const int*>(a);
  const float* row_inv = a + kc_n * 16 * kMR;
  __m512h acc[R][NP];
  __m512 lo[R][NP], hi[R][NP];
  PAGELLM_UNROLL for (int m = 0; m < R; ++m) PAGELLM_UNROLL for (int p = 0; p < NP; ++p) {
    acc[m][p] = _mm512_setzero_ph();
    lo[m][p] = hi[m][p] = _mm512_setzero_ps();
  }
  for (int64_t kc = 0; kc < kc_n; ++kc) {
    pair_step<R, NP>(pairs, b, kc, pn, [&](int m, int p, __m512i xv, __m512i w) __attribute__((always_inline)) {
      acc[m][p] = _mm512_fmadd_ph(_mm512_castsi512_ph(xv), _mm512_castsi512_ph(w), acc[m][p]);
    });
    if ((kc + 1) % kFlushSteps == 0 || kc + 1 == kc_n) {
      PAGELLM_UNROLL for (int m = 0; m < R; ++m) PAGELLM_UNROLL for (int p = 0; p < NP; ++p) {
        const __m512i v = _mm512_castph_si512(acc[m][p]);
        lo[m][p] = _mm512_add_ps(lo[m][p], _mm512_cvtph_ps(_mm512_castsi512_si256(v)));
        hi[m][p] = _mm512_add_ps(hi[m][p], _mm512_cvtph_ps(_mm512_extracti64x4_epi64(v, 1)));
        acc[m][p] = _mm512_setzero_ph();
      }
    }
  }
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  PAGELLM_UNROLL for (int m = 0; m < R; ++m) {
    const __m512 f = _mm512_set1_ps(row_inv[m] * w_inv);  // powers of two: exact
    PAGELLM_UNROLL for (int p = 0; p < NP; ++p)
      out[m][p] = _mm512_mul_ps(_mm512_add_ps(_mm512_permutex2var_ps(lo[m][p], even, hi[m][p]),
                                              _mm512_permutex2var_ps(lo[m][p], odd, hi[m][p])), f);
  }
}
#endif

#if defined(__AVX512BF16__)
// The same with AVX512-BF16's dot product: a, a micro-block's bf16 pairs [K/2][kMR]; b[p]: NP packed bf16 panels.
// VDPBF16PS adds the two products of a broadcast pair (x_k, x_k+1) and lane n's pair (column n at k and k+1) into
// lane n: no conversion of either operand, one instruction for two FMAs' work.
template <int R, int NP>
PAGELLM_INLINE void micro_dot(const float* a, const uint16_t* const* b, int64_t kc_n, __m512 (&out)[kMR][2],
                              const char* const* pn) {
  const int* pairs = reinterpret_cast<const int*>(a);
  __m512 acc[R][NP];
  PAGELLM_UNROLL for (int m = 0; m < R; ++m)
    PAGELLM_UNROLL for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_setzero_ps();
  for (int64_t kc = 0; kc < kc_n; ++kc)
    pair_step<R, NP>(pairs, b, kc, pn, [&](int m, int p, __m512i xv, __m512i w) __attribute__((always_inline)) {
      acc[m][p] = _mm512_dpbf16_ps(acc[m][p], (__m512bh)xv, (__m512bh)w);
    });
  PAGELLM_UNROLL for (int m = 0; m < R; ++m) PAGELLM_UNROLL for (int p = 0; p < NP; ++p) out[m][p] = acc[m][p];
}
#endif

template <Sums S, int R, int NP>
PAGELLM_INLINE void multiply(const float* a, const uint16_t* const* b, int64_t kc_n, float w_inv,
                             __m512 (&out)[kMR][2], const char* const* pn = nullptr) {
#if defined(__AVX512FP16__)
  if constexpr (S == Sums::kFp16) return micro_half<R, NP>(a, b, kc_n, w_inv, out, pn);
#endif
#if defined(__AVX512BF16__)
  if constexpr (S == Sums::kDot) return micro_dot<R, NP>(a, b, kc_n, out, pn);
#endif
  micro<R, NP>(a, b, kc_n, out, pn);
}

// fp32 sums of (row, 16-column panel) jobs, as run() computes them before the bf16 store (fma_linear_panel_sums):
// each lane is one chain of the micro-kernel's instructions in the same order whatever sits beside it, so a job
// gives the full call's bits. kJobs chains side by side (one alone waits out each instruction's latency, ~6x).
// a[j]: the job's row in convert_rows' layout (its micro-block, offset to its lane); b[j]: its panel.
constexpr int kJobs = 8;
template <Sums S>
void job_sums(const float* const* a, const uint16_t* const* b, int64_t kc_n, float* out) {
  __m512 acc[kJobs];
  PAGELLM_UNROLL for (int j = 0; j < kJobs; ++j) acc[j] = _mm512_setzero_ps();
  const __m512i odd = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t kc = 0; kc < kc_n; ++kc)
    for (int r = 0; r < 16; ++r) {
      const int64_t at = (kc * 16 + r) * kMR;  // the k-pair's entry of lane 0 (kDot: a pair; kFp32: two floats)
      PAGELLM_UNROLL for (int j = 0; j < kJobs; ++j) {
        const __m512i w = _mm512_loadu_si512(b[j] + kc * 512 + r * 32);
        if constexpr (S == Sums::kDot) {
#if defined(__AVX512BF16__)
          const __m512i xv = _mm512_set1_epi32(reinterpret_cast<const int*>(a[j])[at]);
          acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)xv, (__m512bh)w);
#endif
        } else {
          acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(a[j][2 * at]), _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), acc[j]);
          acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(a[j][2 * at + 1]), _mm512_castsi512_ps(_mm512_and_si512(w, odd)),
                                   acc[j]);
        }
      }
    }
  PAGELLM_UNROLL for (int j = 0; j < kJobs; ++j) _mm512_storeu_ps(out + 16 * j, acc[j]);
}
#endif

}  // namespace pagellm::fma
