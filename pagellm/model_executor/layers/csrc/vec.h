// Small AVX-512 helpers shared by the CPU kernels: 16-lane fp32 loads/stores from any storage dtype with
// torch's rounding (bf16: round-to-nearest-even, as c10::BFloat16), and a vectorised exp.
// Everything else is plain C++ so the kernels still build (slower) on machines without AVX-512.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// Fully unroll a loop over a compile-time count, so arrays of vector accumulators indexed by its variable live
// in registers (without it GCC may keep them on the stack: a store and a reload around every FMA).
#if defined(__clang__)
#define PAGELLM_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define PAGELLM_UNROLL _Pragma("GCC unroll 16")
#else
#define PAGELLM_UNROLL
#endif

// Force inlining where GCC's heuristics leave a small kernel helper out of line: its vector accumulators, passed
// by reference, then live in memory, a store and a reload around every FMA.
#if defined(__GNUC__)
#define PAGELLM_INLINE inline __attribute__((always_inline))
#else
#define PAGELLM_INLINE inline
#endif

namespace pagellm {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// float -> T with the same rounding torch uses when it stores a float result into a tensor of dtype T.
template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }

#if defined(__AVX512F__)
constexpr int kLanes = 16;

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
// Round-to-nearest-even to bf16, NaN kept quiet (0x7fc0) exactly as c10::BFloat16's constructor does.
inline __m256i cvt_bf16_exact(__m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(rounded);
}
// The same by AVX512-BF16's one-instruction conversion where it agrees: it flushes denormals to zero and keeps
// a NaN's payload, so a vector holding either (in practice never) takes the integer path above.
inline __m256i cvt_bf16(__m512 v) {
#if defined(__AVX512BF16__)
  if (__builtin_expect(_mm512_fpclass_ps_mask(v, 0xA1) == 0, 1))  // 0x01 QNaN | 0x20 denormal | 0x80 SNaN
    return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
#endif
  return cvt_bf16_exact(v);
}
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), cvt_bf16(v));
}
inline void store16(c10::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
// Round to T's precision and back: what a float result looks like after torch stores it in a T tensor.
inline __m512 round_to(__m512 v, const float*) { return v; }
inline __m512 round_to(__m512 v, const c10::BFloat16*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(cvt_bf16(v)), 16));
}
inline __m512 round_to(__m512 v, const c10::Half*) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

// exp(x): range reduction to 2^n * exp(r), |r| <= ln2/2, degree-6 polynomial; relative error ~1e-7.
inline __m512 exp16(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));  // above ~88.7 scalef overflows to +inf, as expf
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
  r = _mm512_fnmadd_ps(n, ln2_lo, r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// silu(x) = x / (1 + exp(-x)), as x * (1 / d): 1/d from rcp14 and one Newton step (~2^-28, below fp32's ulp), as
// the division would be the slowest instruction; d = inf (x < -88.7) gives 0, not the step's inf * 0.
// silu_and_mul and the AMX linear's fused epilogue share it, so their results are the same bits.
inline __m512 silu16(__m512 x) {
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x)));
  const __m512 r0 = _mm512_rcp14_ps(d);
  const __mmask16 finite = _mm512_cmp_ps_mask(d, _mm512_set1_ps(INFINITY), _CMP_NEQ_UQ);
  return _mm512_mul_ps(x, _mm512_maskz_mul_ps(finite, r0, _mm512_fnmadd_ps(d, r0, _mm512_set1_ps(2.f))));
}
#endif

// The largest of x[0..n) (-inf when n = 0).
inline float max_of(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(x + i));
  m = _mm512_reduce_max_ps(vm);
#endif
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// Calls f(T{}) for the storage dtypes the kernels support (float32, bfloat16, float16).
template <typename F>
inline void dispatch_float(c10::ScalarType t, const char* name, F&& f) {
  switch (t) {
    case c10::ScalarType::Float: return f(float{});
    case c10::ScalarType::BFloat16: return f(c10::BFloat16{});
    case c10::ScalarType::Half: return f(c10::Half{});
    default: TORCH_CHECK(false, name, ": dtype ", t, " is not supported (float32, bfloat16, float16)");
  }
}

}  // namespace pagellm
