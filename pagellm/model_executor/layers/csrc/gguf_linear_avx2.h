// gguf_linear (gguf_linear_cpu.cpp) on 8-lane AVX2 FMAs, for CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 2/3):
// the same four layouts, each block's 32 weights as four fp32 vectors with the loader's arithmetic (separate
// multiplies and adds, so each weight is its exact fp32 value), the same column groups claimed from both ends and
// the same prefetch of the group two ahead. Included by gguf_linear_cpu.cpp inside its anonymous namespace: it
// uses that file's Operands, kCols and bf16, and that file's run claims the column groups for its columns(). 16
// vector registers hold 8 accumulators, so a group of 4 columns runs as two halves of 2 for 3 or 4 rows.
#pragma once

// Elements 0-7, 8-15, 16-23, 24-31 of a block.
using Block8 = __m256[4];

inline __m256 u8_to_ps(__m128i q) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)); }  // low 8 bytes
inline __m256 i8_to_ps(__m128i q) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)); }

struct Q4_1 {
  static constexpr int kBytes = 16, kScales = 2;
  static PAGELLM_INLINE void weights(const uint8_t* q, const float* s, Block8& w) {
    const __m128i low = _mm_set1_epi8(0x0F), qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i lo = _mm_and_si128(qs, low), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), low);
    const __m256 d = _mm256_set1_ps(s[0]), m = _mm256_set1_ps(s[1]);
    const __m256 e[4] = {u8_to_ps(lo), u8_to_ps(_mm_srli_si128(lo, 8)), u8_to_ps(hi), u8_to_ps(_mm_srli_si128(hi, 8))};
    PAGELLM_UNROLL for (int i = 0; i < 4; ++i) w[i] = _mm256_add_ps(_mm256_mul_ps(d, e[i]), m);
  }
};

struct Q8_0 {
  static constexpr int kBytes = 32, kScales = 1;
  static PAGELLM_INLINE void weights(const uint8_t* q, const float* s, Block8& w) {
    const __m256 d = _mm256_set1_ps(s[0]);
    PAGELLM_UNROLL for (int i = 0; i < 4; ++i)
      w[i] = _mm256_mul_ps(i8_to_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i))), d);
  }
};

struct U8_1 {
  static constexpr int kBytes = 32, kScales = 2;
  static PAGELLM_INLINE void weights(const uint8_t* q, const float* s, Block8& w) {
    const __m256 d = _mm256_set1_ps(s[0]), m = _mm256_set1_ps(s[1]);
    PAGELLM_UNROLL for (int i = 0; i < 4; ++i)
      w[i] = _mm256_add_ps(_mm256_mul_ps(d, u8_to_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i)))), m);
  }
};

struct Q8_2 {
  static constexpr int kBytes = 32, kScales = 2;
  static PAGELLM_INLINE void weights(const uint8_t* q, const float* s, Block8& w) {
    PAGELLM_UNROLL for (int i = 0; i < 4; ++i)
      w[i] = _mm256_mul_ps(i8_to_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i))),
                           _mm256_set1_ps(s[i / 2]));
  }
};

// Output columns [n, n + NC) for all M rows of x.
template <typename F, int M, int NC>
PAGELLM_INLINE void column_group(const Operands& o, int64_t n) {
  const int64_t blocks = o.K / 32;
  __m256 acc[NC][M];
  PAGELLM_UNROLL for (int c = 0; c < NC; ++c)
    PAGELLM_UNROLL for (int m = 0; m < M; ++m) acc[c][m] = _mm256_setzero_ps();
  const char* pf_qs = reinterpret_cast<const char*>(o.qs + (n + 2 * kCols) * blocks * F::kBytes);  // two groups on
  const char* pf_sc = reinterpret_cast<const char*>(o.scales + (n + 2 * kCols) * blocks * F::kScales);
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = o.xf + b * 32;
    // the NC rows two groups on, spread over the blocks: lines [b, b + 1) x NC kBytes / 64 of their quants, and
    // of their scales
    for (int64_t l = b * NC * F::kBytes / 64; l < (b + 1) * NC * F::kBytes / 64; ++l)
      _mm_prefetch(pf_qs + l * 64, _MM_HINT_T0);
    for (int64_t l = b * NC * F::kScales * 4 / 64; l < (b + 1) * NC * F::kScales * 4 / 64; ++l)
      _mm_prefetch(pf_sc + l * 64, _MM_HINT_T0);
    PAGELLM_UNROLL for (int c = 0; c < NC; ++c) {
      const int64_t blk = (n + c) * blocks + b;
      Block8 w;
      F::weights(o.qs + blk * F::kBytes, o.scales + blk * F::kScales, w);
      PAGELLM_UNROLL for (int m = 0; m < M; ++m)
        PAGELLM_UNROLL for (int i = 0; i < 4; ++i)
          acc[c][m] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + m * o.K + 8 * i), w[i], acc[c][m]);
    }
  }
  for (int c = 0; c < NC; ++c)
    for (int m = 0; m < M; ++m) {
      alignas(32) float part[8];
      _mm256_store_ps(part, acc[c][m]);
      float v = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
      if (o.bias) v += to_float(o.bias[n + c]);
      o.y[m * o.ys + n + c] = static_cast<bf16>(v);
    }
}

// Column groups [g0, g1).
template <typename F, int M>
void columns(const Operands& o, int64_t g0, int64_t g1) {
  constexpr int kHalf = M > 2 ? 2 : kCols;  // columns per pass: at most 8 accumulators
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t n = g * kCols;
    if (n + kCols <= o.N)
      for (int64_t c = n; c < n + kCols; c += kHalf) column_group<F, M, kHalf>(o, c);
    else
      for (int64_t c = n; c < o.N; ++c) column_group<F, M, 1>(o, c);
  }
}

inline void to_fp32(const bf16* x, float* f, int64_t K) {
  for (int64_t k = 0; k < K; k += 8) _mm256_storeu_ps(f + k, v8::load8(x + k));
}
