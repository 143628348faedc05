// Small AVX-512 helpers shared by the CPU kernels: 16-lane fp32 loads/stores from any storage dtype with
// torch's rounding (bf16: round-to-nearest-even, as c10::BFloat16), and a vectorised exp.
// Everything else is plain C++ so the kernels still build (slower) on machines without AVX-512.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "vec8.h"

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
inline float to_float(c10::Float8_e4m3fn x) { return static_cast<float>(x); }
inline float to_float(c10::Float8_e5m2 x) { return static_cast<float>(x); }

// fp8 KV-cache elements (kv_cache_dtype "fp8_e4m3" / "fp8_e5m2", scale 1 as vLLM's default). A float beyond the
// format's largest finite value is stored as that value (saturated), so an outlier never becomes inf or NaN.
template <typename KV>
constexpr bool is_fp8() { return std::is_same_v<KV, c10::Float8_e4m3fn> || std::is_same_v<KV, c10::Float8_e5m2>; }
template <typename KV>
constexpr float fp8_max() { return std::is_same_v<KV, c10::Float8_e4m3fn> ? 448.f : 57344.f; }
template <typename KV>
inline KV to_fp8(float f) {  // c10's rounding (nearest even) after the clamp; NaN stays NaN
  if (f > fp8_max<KV>()) f = fp8_max<KV>();
  else if (f < -fp8_max<KV>()) f = -fp8_max<KV>();
  return KV(f);
}
// The vectorised kernels read an fp8 element through fp16, which holds both formats exactly: e5m2 is fp16's top
// byte; e4m3's magnitude bits sit one bit lower and read as the value / 256. This is the factor to undo it.
template <typename KV>
constexpr float fp8_read_scale() { return std::is_same_v<KV, c10::Float8_e4m3fn> ? 256.f : 1.f; }

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
// c10's float -> fp8 (round to nearest even; below the smallest normal by the same magic-number add), 16 lanes, bit
// for bit as to_fp8: saturated at the largest finite code, NaN kept. kMant mantissa bits, exponent bias kBias.
template <int kMant, int kBias, int kMaxCode>
inline __m128i cvt_fp8_bits(__m512 v) {
  constexpr int shift = 23 - kMant;
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i sign = _mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  const __m512i f = _mm512_xor_si512(bits, sign);
  const __m512i dm = _mm512_set1_epi32((127 - kBias + shift + 1) << 23);
  const __m512i sub = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(f), _mm512_castsi512_ps(dm))), dm);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(f, shift), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(
      f, _mm512_set1_epi32(static_cast<int>((static_cast<uint32_t>(kBias - 127) << 23) + (1u << (shift - 1)) - 1)));
  r = _mm512_min_epu32(_mm512_srli_epi32(_mm512_add_epi32(r, odd), shift), _mm512_set1_epi32(kMaxCode));
  r = _mm512_mask_mov_epi32(r, _mm512_cmplt_epu32_mask(f, _mm512_set1_epi32((127 - kBias + 1) << 23)), sub);
  r = _mm512_mask_mov_epi32(r, _mm512_cmpgt_epu32_mask(f, _mm512_set1_epi32(0x7f800000)), _mm512_set1_epi32(0x7f));
  return _mm512_cvtepi32_epi8(_mm512_or_si512(r, _mm512_srli_epi32(sign, 24)));
}
inline __m128i cvt_fp8(__m512 v, const c10::Float8_e4m3fn*) { return cvt_fp8_bits<3, 7, 0x7e>(v); }
inline __m128i cvt_fp8(__m512 v, const c10::Float8_e5m2*) { return cvt_fp8_bits<2, 15, 0x7b>(v); }

// Byte E of each of 16 words as fp32 (e4m3: the value / 256, see fp8_read_scale): the byte goes to the top of a
// 16-bit lane, which then reads as fp16.
template <int E>
inline __m256i fp8_byte_to_half(__m512i w) {
#if defined(__AVX512VBMI__)
  // 16-bit lane k takes byte 4k + E of w as its high byte, a zero low byte (one vpermb)
  const __m512i idx = _mm512_add_epi16(
      _mm512_slli_epi16(_mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13,
                                         12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 10),
      _mm512_set1_epi16(static_cast<short>(E << 8)));
  return _mm512_castsi512_si256(_mm512_maskz_permutexvar_epi8(0x00000000AAAAAAAAull, idx, w));
#else
  __m512i x;  // byte E at bits 8-15 of each word, zeros below; vpmovdw drops the bits above
  if constexpr (E == 0) x = _mm512_slli_epi32(w, 8);
  else if constexpr (E == 1) x = _mm512_and_si512(w, _mm512_set1_epi32(0xff00));
  else x = _mm512_and_si512(_mm512_srli_epi32(w, 8 * (E - 1)), _mm512_set1_epi32(0xff00));
  return _mm512_cvtepi32_epi16(x);
#endif
}
template <int E>
PAGELLM_INLINE __m512 fp8_lane(__m512i w, const c10::Float8_e5m2*) { return _mm512_cvtph_ps(fp8_byte_to_half<E>(w)); }
template <int E>
PAGELLM_INLINE __m512 fp8_lane(__m512i w, const c10::Float8_e4m3fn*) {
  // sign, then the 7 magnitude bits one place lower: value / 256 (e4m3's NaN, 0x7f, which the saturating writer
  // stores only for a NaN input, reads as 496)
  const __m256i h = fp8_byte_to_half<E>(w);
  return _mm512_cvtph_ps(_mm256_and_si256(_mm256_srai_epi16(h, 1), _mm256_set1_epi16(static_cast<short>(0xBF80))));
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

// The largest of x[0..n) (-inf when n = 0), NaNs left out: max_ps(a, b) returns b when either is NaN, so the new
// values go first (with the running maximum second, a NaN would replace it and lose what its lane had seen).
inline float max_of(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) vm = _mm512_max_ps(_mm512_loadu_ps(x + i), vm);
  if (i < n) {  // the last < 16 in masked lanes
    const __mmask16 k = static_cast<__mmask16>((1u << (n - i)) - 1);
    vm = _mm512_mask_max_ps(vm, k, _mm512_maskz_loadu_ps(k, x + i), vm);
    i = n;
  }
  m = _mm512_reduce_max_ps(vm);
#elif defined(PAGELLM_HAS_AVX2)
  __m256 vm = _mm256_set1_ps(m);
  for (; i + 8 <= n; i += 8) vm = _mm256_max_ps(_mm256_loadu_ps(x + i), vm);
  alignas(32) float part[8];
  _mm256_store_ps(part, vm);
  for (float p : part) m = std::max(m, p);
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
