// y = x W^T (+ bias) for a handful of rows (M <= 4: decode with a few requests) on a 4-bit GGUF weight's nibbles
// (the q4_1 layout of gguf_linear_cpu.cpp: Q4_0, Q4_1, Q4_K, its bytes regrouped at load, below), with x rounded
// to int8 per 16 values at each call (llama.cpp's Q4_1 x Q8_1 dot products, at half its step's span) and a few
// outlier channels of x taken exactly (layers/linear.py: CPULinear.gguf_int8, gguf_int8_form;
// EngineConfig.gguf_int8_activations).
//
// Why: gguf_linear turns each block's 32 weights into fp32 in registers, ~25 vector operations a block on AVX2
// (widenings, conversions, the loader's multiply and add, 4 FMAs) and ~15 on AVX-512, so at one row it is bound by
// them, not by memory: SmolLM2's 120 layer linears at one row took 5.1-5.7 ms on Zen 4's two cores (15 GB/s of
// their 80 MB, where two threads read 31), twice that on one core, and twice that again at 4 rows; the AVX2 kind's
// single-request TPOT was 18.3 ms where its memory floor for the 112 MB a token reads is ~9-12 ms. Here the
// nibbles meet x's int8 values as they are, 16 output columns to a vector (8 on AVX2): per block of 32 depths and
// row, 8 VPDPBUSD (AVX2: 8 VPMADDUBSW summed in int16, then 2 VPMADDWD) on x's quads broadcast, then 2
// conversions, a multiply and 3 FMAs for the block's steps; the nibbles' mask and shift are shared by the rows. A
// first version kept each output column's blocks in its own vector's lanes, which cost ~8 operations a row for
// every 128 weights of a column (2.5-3x these) and made 4 rows slower than vnni_int8_linear. Figures:
// docs/performance-log.md.
//
// The math, per row r and output column n, blocks b of 32 depths with the weight's d, m (w = d q + m, q in 0..15,
// exact in fp32 as the loader's values): P outlier channels (chosen once, below) are zeroed in x, then per half h
// of a block (elements 0-15, 16-31) dx = max|x| / 127, xq = round_half_even(x * (1 / dx)) in [-127, 127] (1 / dx
// taken as 0 where dx is 0 or its inverse overflows; dx NaN where the half holds a NaN or an infinity), sx = the
// fp32 sum of the block's x, and
//   y[r][n] = sum_b d (dx_b0 I_b0 + dx_b1 I_b1) + m sx_b  + sum_p x[r][c_p] w[n][c_p],
// I_bh = sum_j q_j xq_j over the half (exact), in fp32, plus the bias, rounded to bf16 once. The m term uses x
// itself, not its int8 values. A step per 16 values rather than 32: teacher-forced agreement with fp32 over
// workload_16 with every row on this math (emulated in torch, 2026-12-06) 99.32% either way, but 45 rather than 41
// of 48 two-to-four-token prompts' next tokens as fp32's (44 with x as it is), none missed where fp32's top two
// are 0.5 nats apart (tests/test_gguf_linear.py); it costs a conversion and an FMA more a block.
//
// Outlier channels: a few input channels of a model's activations run ~20x the rest (SmolLM2's norm outputs) and
// would leave a block's other values a few int8 steps (vnni_int8_linear_cpu.cpp measured what that costs; here,
// without them: 99.17% and 38 of 48). So, as there, each weight keeps P channels
// (layers/weight_forms.py: GGUF_INT8_OUTLIER_CHANNELS) out of the int8 values: chosen on its first call, as the channels
// of largest |x| over that call's rows (outlier_channels.h: as vnni_int8_linear's), ascending, into the
// caller's tensors with the weight's exact values there (wc [N][P]); every later call takes the same ones, and the
// engine makes the first call a fixed prompt's (LLMEngine.choose_int8_outliers).
//
// The weight's layout (layers/linear.py: gguf_int8_form, a permutation of the GGUF blocks' bytes, N padded to a
// multiple of 16 with zero nibbles and steps): qs uint8 [N/16][K/32][4][64], row j of a block holding at byte
// 4 c + e column c's block byte 4 j + e, whose low nibble is the column's element 4 j + e and high nibble element
// 16 + 4 j + e (so one 64-byte row is a VPDPBUSD operand for x's quad j of either half); scales fp32
// [N/16][K/32][2][16]: the 16 columns' d, then their m. x's int8 copy is row-major; its steps per block (dx of
// 0-15, dx of 16-31, sx, 0).
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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define PAGELLM_GGUF_INT8 1
#define PAGELLM_GGUF_INT8_VNNI 1
#elif defined(PAGELLM_HAS_AVX2)
#define PAGELLM_GGUF_INT8 1
#endif

#if defined(PAGELLM_GGUF_INT8)
struct Operands {
  const int8_t* xq;  // [M][K]
  const float* xs;   // [M][K/32][4]: dx of elements 0-15, dx of 16-31, sx, 0
  const float* xo;   // [M][P]: x at the outlier channels
  int64_t K, N, P;
  const uint8_t* qs;    // [N/16][K/32][4][64]
  const float* scales;  // [N/16][K/32][2][16]
  const float* wc;      // [N][P]
  const bf16* bias;
  bf16* y;
  int64_t ys;
};

// Row r of x (bf16, K values) into its int8 copy (xq, xs; see above), the outlier channels zeroed.
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
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * 32),
                        _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16a, w16b), order));
    float* xb = xs + b * 4;
    xb[0] = d[0];
    xb[1] = d[1];
    xb[2] = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    xb[3] = 0.f;
  }
}

inline int32_t quad(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

#if defined(PAGELLM_GGUF_INT8_VNNI)
constexpr int kW = 16;  // output columns a vector holds
using Acc = __m512;

// The 16 columns of group g for all M rows, before the outlier channels and the bias.
template <int M>
PAGELLM_INLINE void column_group(const Operands& o, int64_t g, Acc (&y)[M]) {
  const int64_t KB = o.K / 32;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const uint8_t* qp = o.qs + g * KB * 256;
  const float* sp = o.scales + g * KB * 32;
  const uint8_t* next = o.qs + std::min(g + 1, (o.N + kW - 1) / kW - 1) * KB * 256;  // the next group's blocks
  PAGELLM_UNROLL for (int m = 0; m < M; ++m) y[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b, qp += 256, sp += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(qp + 1024), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(next + b * 256), _MM_HINT_T2);
    __m512i lo_sum[M], hi_sum[M];
    PAGELLM_UNROLL for (int m = 0; m < M; ++m) lo_sum[m] = hi_sum[m] = _mm512_setzero_si512();
    PAGELLM_UNROLL for (int j = 0; j < 4; ++j) {
      const __m512i w = _mm512_loadu_si512(qp + 64 * j);
      const __m512i lo = _mm512_and_si512(w, low), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
      PAGELLM_UNROLL for (int m = 0; m < M; ++m) {
        const int8_t* xq = o.xq + m * o.K + b * 32 + 4 * j;
        lo_sum[m] = _mm512_dpbusd_epi32(lo_sum[m], lo, _mm512_set1_epi32(quad(xq)));
        hi_sum[m] = _mm512_dpbusd_epi32(hi_sum[m], hi, _mm512_set1_epi32(quad(xq + 16)));
      }
    }
    const __m512 d = _mm512_loadu_ps(sp), mm = _mm512_loadu_ps(sp + 16);
    PAGELLM_UNROLL for (int m = 0; m < M; ++m) {
      const float* xb = o.xs + (m * KB + b) * 4;
      const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi_sum[m]), _mm512_set1_ps(xb[1]),
                                       _mm512_mul_ps(_mm512_cvtepi32_ps(lo_sum[m]), _mm512_set1_ps(xb[0])));
      y[m] = _mm512_fmadd_ps(mm, _mm512_set1_ps(xb[2]), _mm512_fmadd_ps(t, d, y[m]));
    }
  }
}

// Group g's columns: the outlier channels' exact products and the bias added, rounded to bf16 and stored.
template <int M>
PAGELLM_INLINE void finish_group(const Operands& o, int64_t g, Acc (&y)[M]) {
  const int64_t n = g * kW, cols = std::min<int64_t>(kW, o.N - n);
  const __mmask16 k = cols == kW ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(static_cast<int>(o.P)));
  for (int64_t p = 0; p < o.P; ++p) {
    const __m512 w = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), k, idx, o.wc + n * o.P + p, 4);
    PAGELLM_UNROLL for (int m = 0; m < M; ++m) y[m] = _mm512_fmadd_ps(_mm512_set1_ps(o.xo[m * o.P + p]), w, y[m]);
  }
  __m512 bias = _mm512_setzero_ps();
  if (o.bias)
    bias = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, reinterpret_cast<const uint16_t*>(o.bias + n))), 16));
  PAGELLM_UNROLL for (int m = 0; m < M; ++m)
    _mm256_mask_storeu_epi16(o.y + m * o.ys + n, k, cvt_bf16(o.bias ? _mm512_add_ps(y[m], bias) : y[m]));
}
#else
constexpr int kW = 8;  // output columns a vector holds: half of a 16-column group
using Acc = __m256;

// The 8 columns of half-group g (group g / 2, its columns 8 (g % 2) to 8 (g % 2) + 7) for all M rows. VPMADDUBSW's
// int16 pairs cannot saturate (2 x 15 x 127 < 2^15), nor their sums over a half's 4 quads (8 x 15 x 127).
template <int M>
PAGELLM_INLINE void column_group(const Operands& o, int64_t g, Acc (&y)[M]) {
  const int64_t KB = o.K / 32;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const uint8_t* qp = o.qs + (g / 2) * KB * 256 + (g % 2) * 32;
  const float* sp = o.scales + (g / 2) * KB * 32 + (g % 2) * 8;
  PAGELLM_UNROLL for (int m = 0; m < M; ++m) y[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < KB; ++b, qp += 256, sp += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(qp + 1024), _MM_HINT_T0);
    __m256i lo_sum[M], hi_sum[M];
    PAGELLM_UNROLL for (int m = 0; m < M; ++m) lo_sum[m] = hi_sum[m] = _mm256_setzero_si256();
    PAGELLM_UNROLL for (int j = 0; j < 4; ++j) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qp + 64 * j));
      const __m256i lo = _mm256_and_si256(w, low), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
      PAGELLM_UNROLL for (int m = 0; m < M; ++m) {
        const int8_t* xq = o.xq + m * o.K + b * 32 + 4 * j;
        lo_sum[m] = _mm256_add_epi16(lo_sum[m], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(quad(xq))));
        hi_sum[m] = _mm256_add_epi16(hi_sum[m], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(quad(xq + 16))));
      }
    }
    const __m256 d = _mm256_loadu_ps(sp), mm = _mm256_loadu_ps(sp + 16);
    PAGELLM_UNROLL for (int m = 0; m < M; ++m) {
      const float* xb = o.xs + (m * KB + b) * 4;
      const __m256 lo = _mm256_cvtepi32_ps(_mm256_madd_epi16(lo_sum[m], ones));
      const __m256 hi = _mm256_cvtepi32_ps(_mm256_madd_epi16(hi_sum[m], ones));
      const __m256 t = _mm256_fmadd_ps(hi, _mm256_set1_ps(xb[1]), _mm256_mul_ps(lo, _mm256_set1_ps(xb[0])));
      y[m] = _mm256_fmadd_ps(mm, _mm256_set1_ps(xb[2]), _mm256_fmadd_ps(t, d, y[m]));
    }
  }
}

template <int M>
PAGELLM_INLINE void finish_group(const Operands& o, int64_t g, Acc (&y)[M]) {
  const int64_t n = g * kW, cols = std::min<int64_t>(kW, o.N - n);
  alignas(32) float v[kW];
  for (int m = 0; m < M; ++m) {
    _mm256_store_ps(v, y[m]);
    for (int64_t c = 0; c < cols; ++c) {
      const float* wc = o.wc + (n + c) * o.P;
      const float* xo = o.xo + m * o.P;
      float s = v[c];
      for (int64_t p = 0; p < o.P; ++p) s = std::fma(xo[p], wc[p], s);
      if (o.bias) s += to_float(o.bias[n + c]);
      o.y[m * o.ys + n + c] = static_cast<bf16>(s);
    }
  }
}
#endif

// Claims [g0, g1) of kW columns each.
template <int M>
void columns(const Operands& o, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    Acc y[M];
    column_group<M>(o, g, y);
    finish_group<M>(o, g, y);
  }
}

// The weight's exact values (d q + m, as the loader's fp32 arithmetic) at the P outlier channels chan into wc [N][P].
void outlier_values(int64_t K, int64_t N, int64_t P, const uint8_t* qs, const float* scales, const int32_t* chan,
                    float* wc) {
  const int64_t KB = K / 32;
  for (int64_t p = 0; p < P; ++p) {
    const int64_t c = chan[p], b = c / 32, j = c % 32, e = j % 16;
    for (int64_t n = 0; n < N; ++n) {
      const int64_t g = n / 16, col = n % 16;
      const uint8_t byte = qs[((g * KB + b) * 4 + e / 4) * 64 + 4 * col + e % 4];
      const float q = static_cast<float>(j < 16 ? byte & 0x0F : byte >> 4);
      const float* s = scales + (g * KB + b) * 32 + col;
      const float dq = s[0] * q;  // two roundings, as the loader's d * q + m (gguf_loader._dequantize_torch)
      wc[n * P + p] = dq + s[16];
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

// qs uint8 [ceil(N/16), K/32, 4, 64], scales fp32 [ceil(N/16), K/32, 2, 16] (gguf_int8_form's layout, above); x
// [M, K] bf16 (1 <= M <= 4, rows may be strided); channels int32 [P] and wc fp32 [N, P]: the outlier channels and
// the weight's values there, which the first call chooses and writes (channels[0] < 0 until then; P = 0: none);
// out [M, N] bf16.
void gguf_int8_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales, at::Tensor channels,
                      at::Tensor wc, const c10::optional<at::Tensor>& bias, at::Tensor out) {
  TORCH_CHECK(gguf_int8_linear_supported(), "gguf_int8_linear needs AVX512-VNNI or AVX2 with FMA");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1, "x, out: [M, K], [M, N]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16, "x, out: bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(0) == M ? out.size(1) : -1;
  TORCH_CHECK(M >= 1 && M <= 4 && N >= 0, "x: 1 to 4 rows, out: [M, N]");
  TORCH_CHECK(K % 32 == 0, "gguf_int8_linear: K (", K, ") must be a multiple of 32");
  const int64_t N16 = (N + 15) / 16;
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous() && qs.dim() == 4 && qs.size(0) == N16 &&
              qs.size(1) == K / 32 && qs.size(2) == 4 && qs.size(3) == 64,
              "qs: uint8 [ceil(N / 16), K / 32, 4, 64], got ", qs.sizes());
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 4 &&
              scales.size(0) == N16 && scales.size(1) == K / 32 && scales.size(2) == 2 && scales.size(3) == 16,
              "scales: float32 [ceil(N / 16), K / 32, 2, 16], got ", scales.sizes());
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
  // the calling thread's buffers, kept between calls (121 of them per decode step)
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xs, xo, xf;
  xq.resize(M * K), xs.resize(M * K / 8), xo.resize(std::max<int64_t>(M * P, 1));
  xf.resize(K);
  for (int64_t m = 0; m < M; ++m)
    quantize_row(xp + m * x.stride(0), K, chan, P, xq.data() + m * K, xs.data() + m * K / 8, xo.data() + m * P,
                 xf.data());
  const Operands o{xq.data(), xs.data(), xo.data(), K, N, P, qs.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                   wc.data_ptr<float>(), has_bias ? bias->data_ptr<bf16>() : nullptr, out.data_ptr<bf16>(),
                   out.stride(0)};
  claim_from_both_ends((N + kW - 1) / kW, 2, [&](int64_t lo, int64_t hi, bool) {
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
