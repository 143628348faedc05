// y = x W^T (+ bias) for a handful of rows (M <= 4: decode with a few requests) on a 4-bit GGUF weight's own
// blocks (the q4_1 layout of gguf_linear_cpu.cpp: Q4_0, Q4_1, Q4_K), with x rounded to int8 per 16 values at each
// call (llama.cpp's Q4_1 x Q8_1 dot products, at half its step's span) and a few outlier channels of x taken
// exactly (layers/linear.py: CPULinear.gguf_int8; EngineConfig.gguf_int8_activations).
//
// Why: gguf_linear turns each block's 32 weights into fp32 in registers, ~25 vector operations a block on AVX2
// (widenings, conversions, the loader's multiply and add, 4 FMAs) and ~15 on AVX-512, so at one row it is bound by
// them, not by memory: SmolLM2's 120 layer linears at one row took 5.1-5.7 ms on Zen 4's two cores (15 GB/s of
// their 80 MB, where two threads read 31), twice that on one core, and twice that again at 4 rows; the AVX2 kind's
// single-request TPOT was 18.3 ms where its memory floor for the 112 MB a token reads is ~9-12 ms. Here the
// nibbles meet x's int8 values as they are: on AVX512-VNNI 4 blocks (128 weights) a step take two VPDPBUSD, the
// nibbles' mask and shift and ~8 operations for the steps; on AVX2 2 blocks take two VPMADDUBSW (whose int16 pairs
// cannot saturate: 2 x 15 x 127 < 2^15) and ~12 more. Figures: docs/performance-log.md.
//
// The math, per row r and output column n, blocks b of 32 depths with the weight's d, m (w = d q + m, q in 0..15,
// exact in fp32 as the loader's values): P outlier channels (chosen once, below) are zeroed in x, then per half h
// of a block (elements 0-15, 16-31) dx = max|x| / 127, xq = round_half_even(x * (1 / dx)) in [-127, 127] (1 / dx
// taken as 0 where dx is 0 or its inverse overflows; dx NaN where the half holds a NaN or an infinity), sx = the
// fp32 sum of the block's x, and
//   y[r][n] = sum_b (d * dx_b0) I_b0 + (d * dx_b1) I_b1 + m * sx_b  + sum_p x[r][c_p] * w[n][c_p],
// I_bh = sum_j q_j xq_j over the half (exact), in fp32, plus the bias, rounded to bf16 once. The m term uses x
// itself, not its int8 values. A step per 16 values rather than 32: teacher-forced agreement with fp32 over
// workload_16 with every row on this math (emulated in torch, 2026-12-06) 99.32% either way, but 45 rather than 41
// of 48 two-to-four-token prompts' next tokens as fp32's (44 with x as it is), none missed where fp32's top two
// are 0.5 nats apart (tests/test_gguf_linear.py); it costs a conversion and an FMA more a half.
//
// Outlier channels: a few input channels of a model's activations run ~20x the rest (SmolLM2's norm outputs) and
// would leave a block's other values a few int8 steps (q4_vnni_linear_cpu.cpp measured what that costs; here,
// without them: 99.17% and 38 of 48). So, as there, each weight keeps P channels
// (layers/linear.py: GGUF_INT8_OUTLIER_CHANNELS) out of the int8 values: chosen on its first call, as the channels
// of largest |x| over that call's rows (outlier_channels.h: as q4_vnni_linear's), ascending, into the
// caller's tensors with the weight's exact values there (wc [N][P]); every later call takes the same ones, and the
// engine makes the first call a fixed prompt's (LLMEngine.choose_int8_outliers).
//
// Layout of x's int8 copy: per row, groups of G blocks (4 on AVX-512, 2 on AVX2), each group the blocks' elements
// 0-15 side by side, then their elements 16-31 (what the nibbles give: a byte's low nibble is element j, its high
// one j + 16), and per group the blocks' (dx of 0-15, sx) pairs, then their (dx of 16-31, 0) pairs, which the
// weight's (d, m) pairs, twice, multiply lane by lane. The last group is padded with zeros (the weight's loads
// there are masked or short).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "ops.h"
#include "outlier_channels.h"
#include "split_work.h"
#include "vec.h"
#include "vec8.h"

namespace {
using namespace pagellm;
using bf16 = c10::BFloat16;

constexpr int kCols = 4;  // output columns a claim's step covers: one sequential stream of the weight

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define PAGELLM_GGUF_INT8 1
#define PAGELLM_GGUF_INT8_VNNI 1
constexpr int G = 4;
#elif defined(PAGELLM_HAS_AVX2)
#define PAGELLM_GGUF_INT8 1
constexpr int G = 2;
#endif

#if defined(PAGELLM_GGUF_INT8)
struct Operands {
  const int8_t* xq;  // [M][groups][2][G * 16]
  const float* xs;   // [M][groups][4 * G]: (dx of elements 0-15, sx) per block, then (dx of 16-31, 0) per block
  const float* xo;   // [M][P]: x at the outlier channels
  int64_t K, N, groups, P;
  const uint8_t* qs;   // [N][K/32][16]
  const float* scales;  // [N][K/32][2]
  const float* wc;      // [N][P]
  const bf16* bias;
  bf16* y;
  int64_t ys;
};

// Row r of x (bf16, K values) into its int8 copy (xq, xs; see the layout above), the outlier channels zeroed.
void quantize_row(const bf16* x, int64_t K, const int32_t* chan, int64_t P, int8_t* xq, float* xs, float* xo,
                  float* xf) {
  for (int64_t k = 0; k < K; k += 8) _mm256_storeu_ps(xf + k, v8::load8(x + k));
  for (int64_t p = 0; p < P; ++p) xo[p] = xf[chan[p]], xf[chan[p]] = 0.f;
  const int64_t KB = K / 32;
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t b = 0; b < KB; ++b) {
    const float* f = xf + b * 32;
    const __m256 v[4] = {_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8), _mm256_loadu_ps(f + 16),
                         _mm256_loadu_ps(f + 24)};
    // max|x| of each half on the bits: without the sign an fp32 orders as its bits (0x7f800000 infinity, above it
    // NaN)
    alignas(32) uint32_t t[2][8];
    alignas(32) float s[8];
    for (int h = 0; h < 2; ++h)
      _mm256_store_si256(reinterpret_cast<__m256i*>(t[h]),
                         _mm256_max_epu32(_mm256_and_si256(_mm256_castps_si256(v[2 * h]), magnitude),
                                          _mm256_and_si256(_mm256_castps_si256(v[2 * h + 1]), magnitude)));
    _mm256_store_ps(s, _mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
    float d[2];
    __m256i q[4];
    for (int h = 0; h < 2; ++h) {
      uint32_t bits = 0;
      for (int i = 0; i < 8; ++i) bits = std::max(bits, t[h][i]);
      float amax;
      std::memcpy(&amax, &bits, sizeof amax);
      d[h] = bits >= 0x7f800000u ? std::numeric_limits<float>::quiet_NaN() : amax / 127.f;
      const float id = d[h] > 0.f && 1.f / d[h] < inf ? 1.f / d[h] : 0.f;
      // nearest, ties to even (MXCSR's default, as torch.round); |x * id| <= 127 up to rounding, never past 127.5
      for (int i = 2 * h; i < 2 * h + 2; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
    }
    // packs work within 128-bit lanes: bytes come out as elements 0-3, 8-11, 16-19, 24-27, 4-7, ...; the
    // permutation puts them back in order
    const __m256i w16a = _mm256_packs_epi32(q[0], q[1]), w16b = _mm256_packs_epi32(q[2], q[3]);
    const __m256i w8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16a, w16b), order);
    const int64_t g = b / G, slot = b % G;
    int8_t* dst = xq + g * 32 * G;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + slot * 16), _mm256_castsi256_si128(w8));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + G * 16 + slot * 16), _mm256_extracti128_si256(w8, 1));
    float* xg = xs + g * 4 * G;
    xg[2 * slot] = d[0];
    xg[2 * slot + 1] = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    xg[2 * G + 2 * slot] = d[1];
    xg[2 * G + 2 * slot + 1] = 0.f;
  }
  for (int64_t b = KB; b < (KB + G - 1) / G * G; ++b) {  // the last group's padding
    const int64_t g = b / G, slot = b % G;
    std::memset(xq + g * 32 * G + slot * 16, 0, 16);
    std::memset(xq + g * 32 * G + G * 16 + slot * 16, 0, 16);
    float* xg = xs + g * 4 * G;
    xg[2 * slot] = xg[2 * slot + 1] = xg[2 * G + 2 * slot] = xg[2 * G + 2 * slot + 1] = 0.f;
  }
}

// The lines of the NC columns two claims on (rows of qs and scales that follow these in memory), spread over the
// groups: step g issues its share.
template <int NC>
PAGELLM_INLINE void prefetch_ahead(const Operands& o, int64_t n, int64_t g) {
  const int64_t KB = o.K / 32;
  if (n + 2 * kCols + NC > o.N) return;
  const char* q = reinterpret_cast<const char*>(o.qs + (n + 2 * kCols) * KB * 16);
  const char* s = reinterpret_cast<const char*>(o.scales + (n + 2 * kCols) * KB * 2);
  const int64_t ql = NC * KB * 16 / 64, sl = NC * KB * 8 / 64;
  for (int64_t l = g * ql / o.groups; l < (g + 1) * ql / o.groups; ++l) _mm_prefetch(q + l * 64, _MM_HINT_T0);
  for (int64_t l = g * sl / o.groups; l < (g + 1) * sl / o.groups; ++l) _mm_prefetch(s + l * 64, _MM_HINT_T0);
}

#if defined(PAGELLM_GGUF_INT8_VNNI)
using Acc = __m512;

// Output columns [n, n + NC) for all M rows: acc[c][m] holds 16 lanes whose sum is the output before the outlier
// channels and the bias.
template <int M, int NC>
PAGELLM_INLINE void column_group(const Operands& o, int64_t n, Acc (&acc)[NC][M]) {
  const int64_t KB = o.K / 32, full = KB / G;
  const __m512i low = _mm512_set1_epi8(0x0F);
  // lane 4i + j: block i's d dx for elements 0-15, then for 16-31 (the (d, m) x (dx, sx) products' lane 2i, and
  // the (d, m) x (dx, 0) products' lane 8 + 2i)
  const __m512i spread_lo = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
  const __m512i spread_hi = _mm512_add_epi32(spread_lo, _mm512_set1_epi32(8));
  const __mmask64 qmask = (1ull << (16 * (KB % G))) - 1;
  const __mmask8 smask = static_cast<__mmask8>((1u << (2 * (KB % G))) - 1);
  PAGELLM_UNROLL for (int c = 0; c < NC; ++c)
    PAGELLM_UNROLL for (int m = 0; m < M; ++m) acc[c][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < o.groups; ++g) {
    prefetch_ahead<NC>(o, n, g);
    __m512i xlo[M], xhi[M];  // x's int8 values and steps for this group, held across the columns
    __m512 xsv[M];
    PAGELLM_UNROLL for (int m = 0; m < M; ++m) {
      const int8_t* xq = o.xq + (m * o.groups + g) * 32 * G;
      xlo[m] = _mm512_loadu_si512(xq), xhi[m] = _mm512_loadu_si512(xq + 16 * G);
      xsv[m] = _mm512_loadu_ps(o.xs + (m * o.groups + g) * 4 * G);
    }
    PAGELLM_UNROLL for (int c = 0; c < NC; ++c) {
      const uint8_t* qp = o.qs + ((n + c) * KB + g * G) * 16;
      const float* sp = o.scales + ((n + c) * KB + g * G) * 2;
      const __m512i q = g < full ? _mm512_loadu_si512(qp) : _mm512_maskz_loadu_epi8(qmask, qp);
      // the blocks' (d, m) pairs, twice
      const __m512 dm = _mm512_broadcast_f32x8(g < full ? _mm256_loadu_ps(sp) : _mm256_maskz_loadu_ps(smask, sp));
      const __m512i lo = _mm512_and_si512(q, low), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), low);
      PAGELLM_UNROLL for (int m = 0; m < M; ++m) {
        const __m512i isum_lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xlo[m]);
        const __m512i isum_hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, xhi[m]);
        const __m512 v = _mm512_mul_ps(dm, xsv[m]);
        acc[c][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum_lo), _mm512_permutexvar_ps(spread_lo, v), acc[c][m]);
        acc[c][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum_hi), _mm512_permutexvar_ps(spread_hi, v), acc[c][m]);
        acc[c][m] = _mm512_mask_add_ps(acc[c][m], 0xAA, acc[c][m], v);  // m sx, lanes 1, 3, 5, 7
      }
    }
  }
}

// v's lanes summed, with the P outlier channels' products xo . wc folded in first (16 lanes a step).
PAGELLM_INLINE float lanes_sum(__m512 v, const float* xo, const float* wc, int64_t P) {
  for (int64_t p = 0; p < P; p += 16) {
    const __mmask16 k = P - p >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (P - p)) - 1);
    v = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, xo + p), _mm512_maskz_loadu_ps(k, wc + p), v);
  }
  return _mm512_reduce_add_ps(v);
}
#else
using Acc = __m256;

template <int M, int NC>
PAGELLM_INLINE void column_group(const Operands& o, int64_t n, Acc (&acc)[NC][M]) {
  const int64_t KB = o.K / 32, full = KB / G;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i spread_lo = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);
  const __m256i spread_hi = _mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6);
  const __m256 zero = _mm256_setzero_ps();
  PAGELLM_UNROLL for (int c = 0; c < NC; ++c)
    PAGELLM_UNROLL for (int m = 0; m < M; ++m) acc[c][m] = zero;
  for (int64_t g = 0; g < o.groups; ++g) {
    prefetch_ahead<NC>(o, n, g);
    PAGELLM_UNROLL for (int c = 0; c < NC; ++c) {
      const uint8_t* qp = o.qs + ((n + c) * KB + g * G) * 16;
      const float* sp = o.scales + ((n + c) * KB + g * G) * 2;
      // the last group of an odd KB: one block, its (d, m) and then zeros
      const __m256i q = g < full ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qp))
                                 : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qp)));
      const __m128 dm4 = g < full ? _mm_loadu_ps(sp) : _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(sp)));
      const __m256 dm = _mm256_set_m128(dm4, dm4);  // the blocks' (d, m) pairs, twice
      const __m256i lo = _mm256_and_si256(q, low), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
      PAGELLM_UNROLL for (int m = 0; m < M; ++m) {
        const int8_t* xq = o.xq + (m * o.groups + g) * 32 * G;
        const __m256i isum_lo = _mm256_madd_epi16(
            _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq))), ones);
        const __m256i isum_hi = _mm256_madd_epi16(
            _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16 * G))), ones);
        const __m256 v = _mm256_mul_ps(dm, _mm256_loadu_ps(o.xs + (m * o.groups + g) * 4 * G));
        acc[c][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum_lo), _mm256_permutevar8x32_ps(v, spread_lo), acc[c][m]);
        acc[c][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum_hi), _mm256_permutevar8x32_ps(v, spread_hi), acc[c][m]);
        acc[c][m] = _mm256_add_ps(acc[c][m], _mm256_blend_ps(zero, v, 0x0A));  // m sx, lanes 1 and 3
      }
    }
  }
}

PAGELLM_INLINE float lanes_sum(__m256 v, const float* xo, const float* wc, int64_t P) {
  int64_t p = 0;
  for (; p + 8 <= P; p += 8) v = _mm256_fmadd_ps(_mm256_loadu_ps(xo + p), _mm256_loadu_ps(wc + p), v);
  alignas(32) float l[8];
  _mm256_store_ps(l, v);
  float sum = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
  for (; p < P; ++p) sum += xo[p] * wc[p];
  return sum;
}
#endif

// Columns [n, n + NC): the blocks' sums, then the outlier channels' exact products and the bias.
template <int M, int NC>
PAGELLM_INLINE void columns_at(const Operands& o, int64_t n) {
  Acc acc[NC][M];
  column_group<M, NC>(o, n, acc);
  for (int c = 0; c < NC; ++c) {
    const float* wc = o.wc + (n + c) * o.P;
    for (int m = 0; m < M; ++m) {
      float v = lanes_sum(acc[c][m], o.xo + m * o.P, wc, o.P);
      if (o.bias) v += to_float(o.bias[n + c]);
      o.y[m * o.ys + n + c] = static_cast<bf16>(v);
    }
  }
}

// Claims [g0, g1) of kCols columns each. The registers hold NC x M accumulators, and on AVX-512 the M rows' int8
// values and steps of the current group (loaded once for all NC columns: 2 rows took 0.8-0.9x the time, 4 rows
// 0.85-0.9x), so two columns at a time for 3 or 4 rows (AVX2: 16 registers).
template <int M>
void columns(const Operands& o, int64_t g0, int64_t g1) {
  constexpr int kNC = M > 2 ? 2 : kCols;
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t n = g * kCols;
    if (n + kCols <= o.N)
      for (int64_t c = n; c < n + kCols; c += kNC) columns_at<M, kNC>(o, c);
    else
      for (int64_t c = n; c < o.N; ++c) columns_at<M, 1>(o, c);
  }
}

// The weight's exact values (d q + m, as the loader's fp32 arithmetic) at the P outlier channels chan into wc [N][P].
void outlier_values(int64_t K, int64_t N, int64_t P, const uint8_t* qs, const float* scales, const int32_t* chan,
                    float* wc) {
  const int64_t KB = K / 32;
  for (int64_t p = 0; p < P; ++p) {
    const int64_t c = chan[p], b = c / 32, j = c % 32;
    for (int64_t n = 0; n < N; ++n) {
      const uint8_t byte = qs[(n * KB + b) * 16 + j % 16];
      const float q = static_cast<float>(j < 16 ? byte & 0x0F : byte >> 4);
      const float* s = scales + (n * KB + b) * 2;
      const float dq = s[0] * q;  // two roundings, as the loader's d * q + m (gguf_loader._dequantize_torch)
      wc[n * P + p] = dq + s[1];
    }
  }
}
#endif
}  // namespace

bool gguf_int8_linear_supported() {
#if defined(PAGELLM_GGUF_INT8)
  return true;
#else
  return false;
#endif
}

// qs uint8 [N, K/32, 16], scales fp32 [N, K/32, 2] (gguf_linear's Q4_1 layout); x [M, K] bf16 (1 <= M <= 4, rows
// may be strided); channels int32 [P] and wc fp32 [N, P]: the outlier channels and the weight's values there,
// which the first call chooses and writes (channels[0] < 0 until then; P = 0: none); out [M, N] bf16.
void gguf_int8_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales, at::Tensor channels,
                      at::Tensor wc, const c10::optional<at::Tensor>& bias, at::Tensor out) {
  TORCH_CHECK(gguf_int8_linear_supported(), "gguf_int8_linear needs AVX512-VNNI or AVX2 with FMA");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1, "x, out: [M, K], [M, N]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16, "x, out: bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(0) == M ? out.size(1) : -1;
  TORCH_CHECK(M >= 1 && M <= 4 && N >= 0, "x: 1 to 4 rows, out: [M, N]");
  TORCH_CHECK(K % 32 == 0, "gguf_int8_linear: K (", K, ") must be a multiple of 32");
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous() && qs.dim() == 3 && qs.size(0) == N &&
              qs.size(1) == K / 32 && qs.size(2) == 16, "qs: uint8 [N, K / 32, 16], got ", qs.sizes());
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 3 &&
              scales.size(0) == N && scales.size(1) == K / 32 && scales.size(2) == 2,
              "scales: float32 [N, K / 32, 2], got ", scales.sizes());
  const int64_t P = channels.numel();
  TORCH_CHECK(channels.dim() == 1 && channels.is_contiguous() && channels.scalar_type() == at::kInt && P <= K,
              "channels: int32 [P], P <= K");
  TORCH_CHECK(wc.dim() == 2 && wc.is_contiguous() && wc.scalar_type() == at::kFloat && wc.size(0) == N &&
              wc.size(1) == P, "wc: float32 [N, P]");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == at::kBFloat16,
                "bias: bfloat16 [", N, "]");
#if defined(PAGELLM_GGUF_INT8)
  const bf16* xp = x.data_ptr<bf16>();
  int32_t* chan = channels.data_ptr<int32_t>();
  if (P > 0 && chan[0] < 0) {  // the first call chooses them (outlier_channels.h)
    choose_outlier_channels(xp, x.stride(0), M, K, P, chan);
    outlier_values(K, N, P, qs.data_ptr<uint8_t>(), scales.data_ptr<float>(), chan, wc.data_ptr<float>());
  }
  for (int64_t p = 0; p < P; ++p)
    TORCH_CHECK(chan[p] >= 0 && chan[p] < K && (p == 0 || chan[p] > chan[p - 1]), "channels: ascending, in [0, K)");
  const int64_t groups = (K / 32 + G - 1) / G;
  // the calling thread's buffers, kept between calls (121 of them per decode step)
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xs, xo, xf;
  xq.resize(M * groups * 32 * G), xs.resize(M * groups * 4 * G), xo.resize(std::max<int64_t>(M * P, 1));
  xf.resize(K);
  for (int64_t m = 0; m < M; ++m)
    quantize_row(xp + m * x.stride(0), K, chan, P, xq.data() + m * groups * 32 * G, xs.data() + m * groups * 4 * G,
                 xo.data() + m * P, xf.data());
  const Operands o{xq.data(), xs.data(), xo.data(), K, N, groups, P, qs.data_ptr<uint8_t>(),
                   scales.data_ptr<float>(), wc.data_ptr<float>(), has_bias ? bias->data_ptr<bf16>() : nullptr,
                   out.data_ptr<bf16>(), out.stride(0)};
  claim_from_both_ends((N + kCols - 1) / kCols, 8, [&](int64_t lo, int64_t hi, bool) {
    switch (M) {
      case 1: return columns<1>(o, lo, hi);
      case 2: return columns<2>(o, lo, hi);
      case 3: return columns<3>(o, lo, hi);
      default: return columns<4>(o, lo, hi);
    }
  });
#endif
}

TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("gguf_int8_linear(Tensor x, Tensor qs, Tensor scales, Tensor(a!) channels, Tensor(b!) wc, Tensor? bias, "
        "Tensor(c!) out) -> ()");
  m.impl("gguf_int8_linear", c10::DispatchKey::CPU, &gguf_int8_linear);
  m.def("gguf_int8_linear_supported() -> bool", [] { return gguf_int8_linear_supported(); });
}
