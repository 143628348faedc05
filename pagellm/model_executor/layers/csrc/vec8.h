// 8-lane AVX2 helpers for CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 2/3, Intel before Skylake-SP): the
// counterparts of vec.h's 16-lane ones that the AVX2 kernels need. bf16 stores round to nearest even with NaN as
// 0x7fc0, as c10::BFloat16 does, so a kernel's bf16 output equals torch's rounding of the same fp32 values.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define PAGELLM_HAS_AVX2 1

namespace pagellm::v8 {

// 8 bf16 -> fp32
inline __m256 load8(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// The bf16 bits of 8 floats (round to nearest even, NaN -> 0x7fc0) in the low 16 bits of each 32-bit lane.
inline __m256i bf16_bits(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

// fp32 -> 8 bf16
inline __m128i cvt_bf16(__m256 v) {
  const __m256i r = bf16_bits(v);
  // packus per 128-bit lane: [r0..r3 r0..r3 | r4..r7 r4..r7]; 64-bit elements 0 and 2 are the 8 results
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}
inline void store8(c10::BFloat16* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), cvt_bf16(v)); }

// Round to bf16 and back (what a float looks like after torch stores it in a bf16 tensor).
inline __m256 round_bf16(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16)); }

// exp(x) as vec.h's exp16 (the same reduction and polynomial), 2^n built in the exponent bits: x is clamped to
// [-87, 88], where 2^n stays a normal float (so exp(x) for x > 88 is exp(88), not inf: callers keep to the range).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// silu(x) = x / (1 + exp(-x)); 0 below -87 (where exp(-x) would overflow and the quotient is -0 or a denormal).
// silu_and_mul and the AVX2 linear's fused epilogue share it, so their results are the same bits.
inline __m256 silu8(__m256 x) {
  const __m256 s = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
  return _mm256_and_ps(s, _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_NLT_UQ));
}

}  // namespace pagellm::v8
#endif
