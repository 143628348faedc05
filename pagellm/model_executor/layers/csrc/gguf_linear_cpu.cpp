// y [M, N] = x [M, K] @ w[N, K]^T (+ bias) for a handful of rows (M <= 4: decode with a few requests), bf16 x and
// y, with w in a GGUF file's own blocks of 32 weights (the loader keeps them split, layers/quantized.py):
//   Q4_1: qs uint8 [N, K/32, 16] (byte j: element j in its low nibble, j + 16 in its high one, as in the file),
//         scales fp32 [N, K/32, 2] (d, m); w = d * q + m (the default model's layer linears);
//   Q8_0: qs int8 [N, K/32, 32], scales fp32 [N, K/32, 1] (d); w = q * d (its tied embeddings, the LM head);
//   U8_1: qs uint8 [N, K/32, 32], scales fp32 [N, K/32, 2] (d, m); w = d * q + m;
//   Q8_2: qs int8 [N, K/32, 32], scales fp32 [N, K/32, 2] (a d for each 16 weights); w = q * d.
// Other GGUF types are re-packed into these at load, exactly (layers/quantized.py: Q4_0 and Q4_K as Q4_1, Q5_0 as
// Q8_0, Q5_1 and Q5_K as U8_1, Q6_K as Q8_2).
//
// Why: with so few rows a linear layer is a pass over its weight, bound by memory bandwidth (gemv_cpu.cpp streams
// bf16 at the machine's rate). Q4_1 kept this way is 6 bits a weight and Q8_0 9, against bf16's 16: a decode step
// of the default model reads 112 MB of weights instead of 270 MB. Each block becomes fp32 in registers (widenings
// and the loader's arithmetic as separate multiplies and adds, so each weight is the loader's fp32 value bit for
// bit: gguf_loader._dequantize_torch) and meets x, converted to fp32 once per call, in fp32 FMAs. The scales are
// fp32 in memory so that their broadcasts ride on the multiply and add as memory operands: from the file's fp16
// each took a conversion and a shuffle on the port the widenings need (1.4x the time). The result is the fp32
// weights' product, where the other paths use the weights rounded to bf16: closer to the fp32 reference, not
// bit-identical to the bf16 paths. Threads claim groups of 4 output columns (4 rows of w, one sequential stream)
// from both ends (split_work.h), and prefetch the group two ahead: left to the hardware, the 4 rows' interleaved
// streams ran at ~5 GB/s a thread (1.2x the time on two threads, 1.6x on one). Figures: docs/performance-log.md.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "ops.h"
#include "split_work.h"
#include "vec.h"
#include "vec8.h"

namespace {
using namespace pagellm;
using bf16 = c10::BFloat16;

constexpr int kCols = 4;  // output columns per step: independent FMA chains, one stream of w

struct Operands {
  const float* xf;  // x in fp32 [M][K]
  int64_t K, N;
  const uint8_t* qs;
  const float* scales;
  const bf16* bias;
  bf16* y;
  int64_t ys;
};

#if defined(__AVX512F__) && defined(__AVX512BW__)
struct Q4_1 {
  static constexpr int kBytes = 16, kScales = 2;  // per block
  // A block's 32 weights as fp32: elements 0-15 in w0, 16-31 in w1.
  static PAGELLM_INLINE void weights(const uint8_t* q, const float* s, __m512& w0, __m512& w1) {
    const __m128i low = _mm_set1_epi8(0x0F), qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m512 d = _mm512_set1_ps(s[0]), m = _mm512_set1_ps(s[1]);
    const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(qs, low)));
    const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(qs, 4), low)));
    w0 = _mm512_add_ps(_mm512_mul_ps(d, q0), m), w1 = _mm512_add_ps(_mm512_mul_ps(d, q1), m);
  }
};

struct Q8_0 {
  static constexpr int kBytes = 32, kScales = 1;
  static PAGELLM_INLINE void weights(const uint8_t* q, const float* s, __m512& w0, __m512& w1) {
    const __m512 d = _mm512_set1_ps(s[0]);
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16));
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d);
  }
};

// 5-bit and wider unsigned quants with a minimum (Q5_1, Q5_K): one uint8 a weight, w = d * q + m.
struct U8_1 {
  static constexpr int kBytes = 32, kScales = 2;
  static PAGELLM_INLINE void weights(const uint8_t* q, const float* s, __m512& w0, __m512& w1) {
    const __m512 d = _mm512_set1_ps(s[0]), m = _mm512_set1_ps(s[1]);
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16));
    w0 = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q0))), m);
    w1 = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q1))), m);
  }
};

// Signed quants with a scale per 16 weights (Q6_K): one int8 a weight, w = q * d (d: elements 0-15, then 16-31).
struct Q8_2 {
  static constexpr int kBytes = 32, kScales = 2;
  static PAGELLM_INLINE void weights(const uint8_t* q, const float* s, __m512& w0, __m512& w1) {
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16));
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), _mm512_set1_ps(s[0]));
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), _mm512_set1_ps(s[1]));
  }
};

// Output columns [n, n + NC) for all M rows of x; NC and M are constants, so the accumulators stay in registers.
template <typename F, int M, int NC>
PAGELLM_INLINE void column_group(const Operands& o, int64_t n) {
  const int64_t blocks = o.K / 32;
  __m512 acc[NC][M];
  PAGELLM_UNROLL for (int c = 0; c < NC; ++c)
    PAGELLM_UNROLL for (int m = 0; m < M; ++m) acc[c][m] = _mm512_setzero_ps();
  // the group two ahead (its rows follow these in memory): kBytes / 16 lines of qs and a line of scales every
  // 64 / (16 kScales) blocks, per block here
  const char* pf_qs = reinterpret_cast<const char*>(o.qs + (n + 2 * NC) * blocks * F::kBytes);
  const char* pf_sc = reinterpret_cast<const char*>(o.scales + (n + 2 * NC) * blocks * F::kScales);
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = o.xf + b * 32;
    PAGELLM_UNROLL for (int l = 0; l < F::kBytes / 16; ++l)
      _mm_prefetch(pf_qs + (b * F::kBytes / 16 + l) * 64, _MM_HINT_T0);
    if (b % (4 / F::kScales) == 0) _mm_prefetch(pf_sc + b * 16 * F::kScales, _MM_HINT_T0);
    PAGELLM_UNROLL for (int c = 0; c < NC; ++c) {
      const int64_t blk = (n + c) * blocks + b;
      __m512 w0, w1;
      F::weights(o.qs + blk * F::kBytes, o.scales + blk * F::kScales, w0, w1);
      PAGELLM_UNROLL for (int m = 0; m < M; ++m) {
        acc[c][m] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + m * o.K), w0, acc[c][m]);
        acc[c][m] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + m * o.K + 16), w1, acc[c][m]);
      }
    }
  }
  for (int c = 0; c < NC; ++c)
    for (int m = 0; m < M; ++m) {
      float v = _mm512_reduce_add_ps(acc[c][m]);
      if (o.bias) v += to_float(o.bias[n + c]);
      o.y[m * o.ys + n + c] = static_cast<bf16>(v);
    }
}

// Column groups [g0, g1).
template <typename F, int M>
void columns(const Operands& o, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t n = g * kCols;
    if (n + kCols <= o.N) column_group<F, M, kCols>(o, n);
    else
      for (int64_t c = n; c < o.N; ++c) column_group<F, M, 1>(o, c);
  }
}

inline void to_fp32(const bf16* x, float* f, int64_t K) {
  for (int64_t k = 0; k < K; k += 16) _mm512_storeu_ps(f + k, load16(x + k));
}
#elif defined(PAGELLM_HAS_AVX2)
#include "gguf_linear_avx2.h"
#endif

#if (defined(__AVX512F__) && defined(__AVX512BW__)) || defined(PAGELLM_HAS_AVX2)
// Column groups claimed from both ends (split_work.h), each claim run for x's number of rows.
template <typename F>
void run(const Operands& o, int64_t M) {
  claim_from_both_ends((o.N + kCols - 1) / kCols, 8, [&](int64_t lo, int64_t hi, bool) {
    switch (M) {
      case 1: return columns<F, 1>(o, lo, hi);
      case 2: return columns<F, 2>(o, lo, hi);
      case 3: return columns<F, 3>(o, lo, hi);
      default: return columns<F, 4>(o, lo, hi);
    }
  });
}
#endif
}  // namespace

bool gguf_linear_supported() {
#if (defined(__AVX512F__) && defined(__AVX512BW__)) || defined(PAGELLM_HAS_AVX2)
  return true;
#else
  return false;
#endif
}

// qs and scales (fp32 [N, K/32, S]) in one of the layouts above, told apart by qs's dtype and last size and S:
// uint8 [N, K/32, 16] with S = 2 (Q4_1), int8 [N, K/32, 32] with S = 1 (Q8_0), uint8 [N, K/32, 32] with S = 2
// (U8_1), int8 [N, K/32, 32] with S = 2 (Q8_2); x [M, K] bf16 (1 <= M <= 4, rows may be strided).
void gguf_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales,
                 const c10::optional<at::Tensor>& bias, at::Tensor out) {
  TORCH_CHECK(gguf_linear_supported(), "gguf_linear needs AVX-512 or AVX2 with FMA");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1, "x, out: [M, K], [M, N]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16, "x, out: bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(0) == M ? out.size(1) : -1;
  TORCH_CHECK(M >= 1 && M <= 4 && N >= 0, "x: 1 to 4 rows, out: [M, N]");
  TORCH_CHECK(K % 32 == 0, "gguf_linear: K (", K, ") must be a multiple of 32");
  const bool u8 = qs.scalar_type() == at::kByte;
  TORCH_CHECK((u8 || qs.scalar_type() == at::kChar) && qs.is_contiguous() && qs.dim() == 3 && qs.size(0) == N &&
              qs.size(1) == K / 32 && (qs.size(2) == 32 || (u8 && qs.size(2) == 16)),
              "qs: uint8 [N, K / 32, 16 or 32] or int8 [N, K / 32, 32], got ", qs.scalar_type(), " ", qs.sizes());
  const bool nibbles = qs.size(2) == 16;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 3 &&
              scales.size(0) == N && scales.size(1) == K / 32 && (scales.size(2) == 2 || (!u8 && scales.size(2) == 1)),
              "scales: float32 [N, K / 32, ", u8 ? "2" : "1 or 2", "], got ", scales.sizes());
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == at::kBFloat16,
                "bias: bfloat16 [", N, "]");
#if (defined(__AVX512F__) && defined(__AVX512BW__)) || defined(PAGELLM_HAS_AVX2)
  thread_local std::vector<float> xf;  // the calling thread's; kept between calls (121 of them per decode step)
  xf.resize(M * K);
  const bf16* xp = x.data_ptr<bf16>();
  for (int64_t m = 0; m < M; ++m) to_fp32(xp + m * x.stride(0), xf.data() + m * K, K);
  const Operands o{xf.data(), K, N, static_cast<const uint8_t*>(qs.data_ptr()), scales.data_ptr<float>(),
                   has_bias ? bias->data_ptr<bf16>() : nullptr, out.data_ptr<bf16>(), out.stride(0)};
  if (nibbles) run<Q4_1>(o, M);
  else if (u8) run<U8_1>(o, M);
  else if (scales.size(2) == 1) run<Q8_0>(o, M);
  else run<Q8_2>(o, M);
#endif
}

TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("gguf_linear(Tensor x, Tensor qs, Tensor scales, Tensor? bias, Tensor(a!) out) -> ()");
  m.impl("gguf_linear", c10::DispatchKey::CPU, &gguf_linear);
  m.def("gguf_linear_supported() -> bool", [] { return gguf_linear_supported(); });
}
