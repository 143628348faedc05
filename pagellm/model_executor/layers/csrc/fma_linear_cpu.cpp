// y [M, N] = x [M, K] @ w[N, K]^T (+ bias) for bf16 on CPUs with AVX-512 but no AMX: fp32 FMAs on the weight
// in the AMX kernel's packed order (amx_linear_cpu.cpp), bf16 out.
//
// Why not AVX512-BF16's dot product: on the project's AMX-less VM (Xeon, family 6 model 207, AMX hidden by the
// hypervisor) VDPBF16PS retires one per two cycles per core, 32 flops a cycle, while FMA retires two a cycle, 64
// flops (tight register loops, 2026-12-01). oneDNN's bf16 GEMM, which F.linear and vLLM-cpu run there, reached
// ~150 GFLOP/s on two cores, the dot product's ceiling. Here each bf16 weight becomes fp32 in a register with one
// integer instruction (the even k of a packed pair by a shift, the odd by a mask) and feeds 12 rows' FMAs, so
// the conversion costs ~8% of the issue slots. A bf16 x bf16 product is exact in fp32, so the result differs
// from oneDNN's only in the order of the fp32 sums.
//
// AMD's cores are the other way round (Zen 4, an EPYC VM, family 25 model 17, 2026-12-04): VDPBF16PS retires one
// a cycle, as the FMA does, so it does twice the work (in-process, SmolLM2's 120 layer linears: 410-440 against
// 205-220 GFLOP/s on two cores at 64 to 2,048 rows; workload_64 39.3 -> 20.5 s). There (fma_linear_dot_default:
// the CPU's vendor, or PAGELLM_FMA_DOT=0 / 1) x goes as bf16 pairs [K/2][kMR] and one VDPBF16PS takes a broadcast
// pair against a panel row (micro_dot): its two products are exact in fp32, as the FMAs', and summed into lane n
// one after the other, so it rounds as the FMA path does but for the order of the pair and denormals (flushed).
//
// Packed w: [N/16][K/32][16 k-pairs][16 n][2] (layers/linear.py: pack_amx), so the AMX and the FMA kernel share
// one packed copy. The unit of work is kMR rows x 32 columns (two 16-column panels; for silu_mul gate's and up's
// panel of the same 16 columns) in 24 fp32 accumulators over all of K. x is first converted, kMR rows at a time,
// to fp32 in k-pair-interleaved order [K/2][kMR][2], so every broadcast is at a fixed offset from one pointer.
// Work items are (row chunk, 32-column block), claimed from both ends as in the AMX kernel (split_work.h); a
// thread converts a row chunk when it first meets it, and runs every micro-block of it against the block's two
// panels, which stay in L1/L2 after the first.
//
// fp16 sums (EngineConfig.reduced_precision_reduction, CPUs with AVX512-FP16): the packed weight is fp16 instead
// (layers/linear.py: pack_fp16), and one VFMADD231PH does 32 lanes' products and sums, twice an fp32 FMA's work at
// the same rate (2 a cycle per core here, 363 GFLOP/s on one core against 167). x becomes fp16 pairs [K/2][kMR],
// each 32-bit pair (x_k, x_k+1) broadcast against a panel row (column n at k and k+1 in lane pair n), so no
// conversion of the weight at all. The catch is fp16's range and 11-bit precision, so:
//   - both operands are scaled by powers of two (exact): w per matrix to a largest |value| in [0.5, 1), each x row
//     to one in [256, 512); a product is then below 512 and a lane's sum of 32 below 2^14, for any input;
//   - each lane sums 32 products (2 steps of 32 k) in fp16, then the sums join fp32 accumulators, so the rounding
//     error is that of 32-term fp16 sums, not of K-term ones;
//   - the inputs lose nothing that counts: bf16's 8-bit significands fit fp16's 11; only values over 2^13 (w) or
//     2^22 (x) times smaller than their matrix's / row's largest fall below fp16's normal range, and round to a
//     multiple of 2^-25 of that largest.
// SmolLM2's shapes: ~1.6x the fp32 path's speed; the mean error against fp64 1.6e-3 of the mean |y| against
// 1.4e-3 (both mostly the bf16 rounding of y); teacher-forced top-1 agreement with fp32 on workload_16 0.9956
// against 0.9951 (tests/test_fp16_linear.py, docs/performance.md).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "fma_linear_avx2.h"
#include "ops.h"
#include "split_work.h"
#include "tile_linear.h"
#include "vec.h"

namespace {
using namespace pagellm;
using bf16 = c10::BFloat16;

#if defined(__AVX512FP16__)
constexpr bool kHasFp16 = true;
#else
constexpr bool kHasFp16 = false;
#endif
#if defined(__AVX512BF16__)
constexpr bool kHasDot = true;
#else
constexpr bool kHasDot = false;
#endif

// How the micro-kernel sums: fp32 FMAs on the widened bf16 weight, fp16 FMAs on an fp16 copy, or bf16 dot products.
enum class Sums { kFp32, kFp16, kDot };

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int kMR = 12;                 // rows per micro-block: 12 x 2 accumulators + 4 weight registers
constexpr int64_t kRowChunk = kMR * 8;  // rows per work item; its fp32 copy (<= 590 KB at K = 1,536) stays in L2

// fp16 sums (see the file comment): x rows scaled by a power of two to a largest |value| in [256, 512), weights
// to one in [0.5, 1), so kFlushSteps x 16 products per lane stay below 2^14 (fp16's largest: 65,504).
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

struct Gemm {
  const bf16* x;
  int64_t lda, M, K;
  const uint16_t* bp;  // packed w: bf16, or fp16 times 1 / w_inv (half)
  bool half;
  bool dot;          // bf16 weight: AVX512-BF16 dot products (see the file comment)
  float w_inv;       // half: the weight's scale
  int64_t N;         // y's columns
  int64_t up_tile;   // silu_mul: up's first 16-column panel; 0: plain
  const bf16* bias;
  bf16* y;
  int64_t ldy;
  int64_t blocks;    // work items per row chunk
};

// A row chunk of `rows` rows splits into ceil(rows / kMR) micro-blocks of near-equal size (64 rows: 11, 11, 11,
// 11, 10, 10 rather than five of 12 and one of 4, which would load and convert the weights for 4 rows' FMAs).
inline int64_t micro_blocks(int64_t rows) { return (rows + kMR - 1) / kMR; }
inline int64_t micro_start(int64_t rows, int64_t i) { return rows * i / micro_blocks(rows); }
// A micro-block's converted x, in floats: fp32 [K/2][kMR][2]; fp16: fp16 pairs [K/2][kMR] then kMR row factors;
// dot: bf16 pairs [K/2][kMR].
template <Sums S>
inline int64_t block_floats(int64_t K) {
  return S == Sums::kFp16 ? kMR * (K / 2 + 1) : S == Sums::kDot ? kMR * K / 2 : kMR * K;
}

// Rows [m0, m0 + rows) of x into a: micro-block i at a + i * block_floats(K) (its first rows).
template <Sums S>
void convert_rows(const Gemm& g, int64_t m0, int64_t rows, float* a) {
  const int64_t K = g.K;
  for (int64_t i = 0; i < micro_blocks(rows); ++i) {
    float* dst = a + i * block_floats<S>(K);
    const int64_t r0 = micro_start(rows, i), n = micro_start(rows, i + 1) - r0;
    const bf16* src0 = g.x + (m0 + r0) * g.lda;
    if constexpr (S == Sums::kDot) {
      // the rows' 32-bit pairs (x_k, x_k+1) as they are, k outer: two rows' 16 pairs interleaved, so each 64-bit
      // store puts both rows' pair at k in place
      int* d = reinterpret_cast<int*>(dst);
      for (int64_t k = 0; k < K; k += 32) {
        int64_t m = 0;
        for (; m + 1 < n; m += 2) {
          const __m512i xm = _mm512_loadu_si512(src0 + m * g.lda + k);
          const __m512i xn = _mm512_loadu_si512(src0 + (m + 1) * g.lda + k);
          const __m512i lo = _mm512_unpacklo_epi32(xm, xn), hi = _mm512_unpackhi_epi32(xm, xn);
          // lo's 128-bit lane j: pairs 4j, 4j+1 of both rows; hi's: pairs 4j+2, 4j+3
          long long* q = reinterpret_cast<long long*>(d + k / 2 * kMR + m);
          alignas(64) long long l[8], h[8];
          _mm512_store_si512(l, lo), _mm512_store_si512(h, hi);
          PAGELLM_UNROLL for (int j = 0; j < 4; ++j) {
            q[(4 * j) * kMR / 2] = l[2 * j], q[(4 * j + 1) * kMR / 2] = l[2 * j + 1];
            q[(4 * j + 2) * kMR / 2] = h[2 * j], q[(4 * j + 3) * kMR / 2] = h[2 * j + 1];
          }
        }
        if (m < n) {
          const int* r = reinterpret_cast<const int*>(src0 + m * g.lda + k);
          for (int j = 0; j < 16; ++j) d[(k / 2 + j) * kMR + m] = r[j];
        }
      }
    } else if constexpr (S == Sums::kFp16) {
      float scale[kMR], *row_inv = dst + kMR * K / 2;
      for (int64_t m = 0; m < n; ++m) {
        __m512 mx = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(load16(src0 + m * g.lda + k)));
        const float top = _mm512_reduce_max_ps(mx);
        int e = kRowExp;  // 0 or not finite: scale 1
        if (top > 0.f && std::isfinite(top)) std::frexp(top, &e);  // top = f 2^e, f in [0.5, 1)
        const int s = std::clamp(kRowExp - e, -126, 126);
        scale[m] = std::ldexp(1.f, s), row_inv[m] = std::ldexp(1.f, -s);
      }
      // k outer, rows inner (as below); a row's 8 pairs at k go kMR words apart
      const __m256i pair_at = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(kMR));
      int* d = reinterpret_cast<int*>(dst);
      for (int64_t k = 0; k < K; k += 16)
        for (int64_t m = 0; m < n; ++m) {
          const __m256i h = _mm512_cvtps_ph(_mm512_mul_ps(load16(src0 + m * g.lda + k), _mm512_set1_ps(scale[m])),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          _mm256_i32scatter_epi32(d + k / 2 * kMR + m, pair_at, h, 4);
        }
    } else {
      // k outer, rows inner: the rows' 8 k-pairs at k fill one 768-byte stretch of a before the next k (row by
      // row, each row's stores swept the micro-block's whole stretch, larger than L1, at a 96-byte stride)
      for (int64_t k = 0; k < K; k += 16)
        for (int64_t m = 0; m < n; ++m) {  // 16 values, 8 k-pairs: one 64-bit store each, kMR pairs apart
          const __m512 v = load16(src0 + m * g.lda + k);
          double* d = reinterpret_cast<double*>(dst) + k / 2 * kMR + m;
          PAGELLM_UNROLL for (int j = 0; j < 4; ++j) {
            const __m128d lane = _mm_castps_pd(_mm512_extractf32x4_ps(v, j));
            _mm_storel_pd(d + 2 * j * kMR, lane);
            _mm_storeh_pd(d + (2 * j + 1) * kMR, lane);
          }
        }
    }
  }
}

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

// bf16 of v (+ bias[0..16)) into y's 16 columns, the first `cols` of them.
inline void store_cols(bf16* y, __m512 v, const bf16* bias, int64_t cols) {
  if (bias) v = _mm512_add_ps(v, cols >= 16 ? load16(bias) : _mm512_castsi512_ps(_mm512_slli_epi32(
                                  _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16((1u << cols) - 1, bias)), 16)));
  if (cols >= 16) store16(y, v);
  else _mm256_mask_storeu_epi16(y, static_cast<__mmask16>((1u << cols) - 1), cvt_bf16(v));
}

// One micro-block's R rows at y's rows m0.. and its 32-column block nb: multiplies, then the epilogue.
template <Sums S, int R>
void micro_block(const Gemm& g, const float* a, int64_t m0, int64_t nb, int64_t nb_next, int part) {
  const int64_t panel = g.K / 32 * 512, tiles_n = (g.N + 15) / 16;
  __m512 acc[kMR][2];
  // part 1 / 2: this micro-block prefetches the first / second halves of column block nb_next's panels
  const char* pn_buf[2];
  const char* const* pn = nullptr;
  if (nb_next >= 0 && part > 0) {
    const int64_t half = (part - 1) * panel;  // in bytes: a panel's elements are 2 bytes
    const int64_t p0 = g.up_tile > 0 ? nb_next : 2 * nb_next;
    const int64_t p1 = g.up_tile > 0 ? nb_next + g.up_tile : std::min(2 * nb_next + 1, tiles_n - 1);
    pn_buf[0] = reinterpret_cast<const char*>(g.bp + p0 * panel) + half;
    pn_buf[1] = reinterpret_cast<const char*>(g.bp + p1 * panel) + half;
    pn = pn_buf;
  }
  if (g.up_tile > 0) {  // silu_mul: 16 columns, gate's panel and up's
    const uint16_t* b[2] = {g.bp + nb * panel, g.bp + (nb + g.up_tile) * panel};
    multiply<S, R, 2>(a, b, g.K / 32, g.w_inv, acc, pn);
    const int64_t n0 = nb * 16;
    for (int m = 0; m < R; ++m) {
      bf16* ym = g.y + (m0 + m) * g.ldy + n0;
      __m512 gv = acc[m][0], uv = acc[m][1];
      if (g.bias) gv = _mm512_add_ps(gv, load16(g.bias + n0)), uv = _mm512_add_ps(uv, load16(g.bias + g.N + n0));
      gv = round_to(gv, ym), uv = round_to(uv, ym);
      store16(ym, _mm512_mul_ps(round_to(silu16(gv), ym), uv));
    }
    return;
  }
  const int64_t t0 = nb * 2, nt = std::min<int64_t>(2, tiles_n - t0), n0 = t0 * 16;
  const uint16_t* b[2] = {g.bp + t0 * panel, g.bp + (t0 + nt - 1) * panel};
  if (nt == 2) multiply<S, R, 2>(a, b, g.K / 32, g.w_inv, acc, pn);
  else multiply<S, R, 1>(a, b, g.K / 32, g.w_inv, acc);
  for (int m = 0; m < R; ++m) {
    bf16* ym = g.y + (m0 + m) * g.ldy + n0;
    for (int p = 0; p < nt; ++p)
      store_cols(ym + 16 * p, acc[m][p], g.bias ? g.bias + n0 + 16 * p : nullptr,
                 std::min<int64_t>(16, g.N - n0 - 16 * p));
  }
}

template <Sums S, int... Rs>
void micro_block_rows(int rows, const Gemm& g, const float* a, int64_t m0, int64_t nb, int64_t nb_next, int part,
                      std::integer_sequence<int, Rs...>) {
  ((rows == Rs + 1 ? micro_block<S, Rs + 1>(g, a, m0, nb, nb_next, part) : void()), ...);
}

// Work items u = (row chunk u / blocks, column block u % blocks), [lo, hi) in the given direction.
template <Sums S>
void items(const Gemm& g, int64_t lo, int64_t hi, bool ascending, std::vector<float>& a, int64_t& a_chunk) {
  for (int64_t k = 0; k < hi - lo; ++k) {
    const int64_t u = ascending ? lo + k : hi - 1 - k;
    const int64_t chunk = u / g.blocks, nb = u % g.blocks;
    const int64_t m0 = chunk * kRowChunk, rows = std::min(kRowChunk, g.M - m0);
    if (chunk != a_chunk) convert_rows<S>(g, m0, rows, a.data()), a_chunk = chunk;
    const int64_t n_mb = micro_blocks(rows);
    // the column block this thread runs next, if in this row chunk: micro-blocks 1 and 2 prefetch its panels
    const int64_t u_next = ascending ? u + 1 : u - 1;
    const int64_t nb_next = k + 1 < hi - lo && u_next / g.blocks == chunk ? u_next % g.blocks : -1;
    for (int64_t i = 0; i < n_mb; ++i) {
      const int64_t r0 = micro_start(rows, i);
      micro_block_rows<S>(static_cast<int>(micro_start(rows, i + 1) - r0), g,
                              a.data() + i * block_floats<S>(g.K), m0 + r0, nb, nb_next,
                              n_mb >= 3 && (i == 1 || i == 2) ? static_cast<int>(i) : 0,
                              std::make_integer_sequence<int, kMR>{});
    }
  }
}

template <Sums S>
void run(Gemm g) {
  const int64_t chunks = (g.M + kRowChunk - 1) / kRowChunk;
  g.blocks = g.up_tile > 0 ? g.N / 16 : (g.N + 31) / 32;
  const int64_t scratch = micro_blocks(std::min(kRowChunk, g.M)) * block_floats<S>(g.K);
  // A thread's fp32 copy of a row chunk outlives its claim: a thread makes several claims per call (each a
  // shrinking share of what is left), and converting the chunk again at each one cost ~20% of a 64-row call
  // (4-5 claims of 18 column blocks). The call's number tells a thread whether its copy is of this call's x.
  static std::atomic<uint64_t> calls{0};
  const uint64_t call = ++calls;
  claim_from_both_ends(chunks * g.blocks, 2, [&](int64_t lo, int64_t hi, bool ascending) {
    thread_local std::vector<float> a;
    thread_local uint64_t a_call = 0;
    thread_local int64_t a_chunk = -1;
    if (a_call != call) {
      a_call = call, a_chunk = -1;
      if (static_cast<int64_t>(a.size()) < scratch) a.resize(scratch);
    }
    items<S>(g, lo, hi, ascending, a, a_chunk);
  });
}

void run(const Gemm& g) {
  if constexpr (kHasFp16)
    if (g.half) return run<Sums::kFp16>(g);
  if constexpr (kHasDot)
    if (g.dot) return run<Sums::kDot>(g);
  run<Sums::kFp32>(g);
}
#endif

// Checks the operands (tile_linear.h); a packed fp16 weight needs AVX512-FP16, dot products AVX512-BF16.
void check(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
           const at::Tensor& out, int64_t w_cols, double w_inv, int64_t dot) {
  const bool half = packed.scalar_type() == at::kHalf;
  if (half) TORCH_CHECK(fma_linear_fp16_supported(), "fma_linear on an fp16 weight needs AVX512-FP16");
  TORCH_CHECK(dot <= 0 || (fma_linear_dot_supported() && !half),
              "fma_linear: dot=1 needs AVX512-BF16 and a bf16 packed weight");
  check_tile_linear(fma_linear_supported(), "fma_linear needs AVX-512 or AVX2 with FMA", x, packed, bias, out, w_cols,
                    half);
  TORCH_CHECK(w_inv > 0 && std::isfinite(w_inv), "fma_linear: w_inv must be a positive number, got ", w_inv);
}

#if !(defined(__AVX512F__) && defined(__AVX512BW__)) && defined(PAGELLM_HAS_AVX2)
// (run is avx2_linear::run, found by argument-dependent lookup)
avx2_linear::Gemm operands(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                           at::Tensor& out, double, int64_t) {
  const bool has_bias = bias.has_value() && bias->defined();
  return avx2_linear::Gemm{x.data_ptr<bf16>(), x.stride(0), x.size(0), x.size(1),
                           reinterpret_cast<const uint16_t*>(packed.data_ptr()), out.size(1), 0,
                           has_bias ? bias->data_ptr<bf16>() : nullptr, out.data_ptr<bf16>(), out.stride(0), 0};
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
Gemm operands(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, at::Tensor& out,
              double w_inv, int64_t dot) {
  const bool has_bias = bias.has_value() && bias->defined();
  return Gemm{x.data_ptr<bf16>(), x.stride(0), x.size(0), x.size(1),
              reinterpret_cast<const uint16_t*>(packed.data_ptr()), packed.scalar_type() == at::kHalf,
              dot < 0 ? fma_linear_dot_default() : dot > 0, static_cast<float>(w_inv), out.size(1), 0,
              has_bias ? bias->data_ptr<bf16>() : nullptr, out.data_ptr<bf16>(), out.stride(0), 0};
}
#endif
}  // namespace

bool fma_linear_supported() {
#if (defined(__AVX512F__) && defined(__AVX512BW__)) || defined(PAGELLM_HAS_AVX2)
  return true;
#else
  return false;
#endif
}

bool fma_linear_fp16_supported() { return fma_linear_supported() && kHasFp16; }

bool fma_linear_dot_supported() {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  return kHasDot;
#else
  return false;
#endif
}

// Whether a bf16 weight takes the dot products when the caller does not say (dot=-1): on AMD's cores, whose
// VDPBF16PS retires at the FMA's rate and so does twice its work, not on Intel's (half the rate there, see the
// file comment). PAGELLM_FMA_DOT=0 / 1 overrides, to compare the two in one engine.
bool fma_linear_dot_default() {
  static const bool on = [] {
    if (!fma_linear_dot_supported()) return false;
    if (const char* env = std::getenv("PAGELLM_FMA_DOT"); env && *env) return std::strcmp(env, "0") != 0;
#if defined(__x86_64__) || defined(__i386__)
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
    return b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;  // "AuthenticAMD"
#else
    return false;
#endif
  }();
  return on;
}

// packed: [ceil(N/16), K/32, 16, 16, 2] (amx_linear_cpu.cpp), bf16, or fp16 holding w / w_inv (layers/linear.py:
// pack_fp16, largest |value| below 1); x [M, K] with K % 32 == 0.
// dot: 1 / 0 the bf16 dot products or not (AVX512-BF16, a bf16 weight), -1 as fma_linear_dot_default says.
void fma_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, at::Tensor out,
                double w_inv, int64_t dot) {
  check(x, packed, bias, out, out.size(1), w_inv, dot);
#if (defined(__AVX512F__) && defined(__AVX512BW__)) || defined(PAGELLM_HAS_AVX2)
  run(operands(x, packed, bias, out, w_inv, dot));
#endif
}

// out [M, I] = silu(gate) * up with [gate | up] = x @ w^T (+ bias), w: 2I columns packed (I % 16 == 0); the same
// bits as fma_linear into a bf16 gate_up and then silu_and_mul.
void fma_linear_silu_mul(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         at::Tensor out, double w_inv, int64_t dot) {
  const int64_t I = out.size(1);
  TORCH_CHECK(I % 16 == 0, "fma_linear_silu_mul: the intermediate size (", I, ") must be a multiple of 16");
  check(x, packed, bias, out, 2 * I, w_inv, dot);
#if (defined(__AVX512F__) && defined(__AVX512BW__)) || defined(PAGELLM_HAS_AVX2)
  auto g = operands(x, packed, bias, out, w_inv, dot);
  g.up_tile = I / 16;
  run(g);
#endif
}

TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("fma_linear(Tensor x, Tensor packed, Tensor? bias, Tensor(a!) out, float w_inv=1.0, int dot=-1) -> ()");
  m.impl("fma_linear", c10::DispatchKey::CPU, &fma_linear);
  m.def("fma_linear_silu_mul(Tensor x, Tensor packed, Tensor? bias, Tensor(a!) out, float w_inv=1.0, int dot=-1) "
        "-> ()");
  m.impl("fma_linear_silu_mul", c10::DispatchKey::CPU, &fma_linear_silu_mul);
  m.def("fma_linear_supported() -> bool", [] { return fma_linear_supported(); });
  m.def("fma_linear_fp16_supported() -> bool", [] { return fma_linear_fp16_supported(); });
  m.def("fma_linear_dot_supported() -> bool", [] { return fma_linear_dot_supported(); });
  m.def("fma_linear_dot_default() -> bool", [] { return fma_linear_dot_default(); });
}
