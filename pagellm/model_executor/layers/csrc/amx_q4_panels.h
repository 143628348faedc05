// A 4-bit GGUF weight (the q4_1 layout of layers/quantized.py: Q4_0, Q4_1, Q4_K) laid out so that AMX's B tiles
// come out of it with a few vector instructions each, for the tile linear at decode sizes (amx_linear_cpu.cpp,
// amx_q4_linear).
//
// Why: a decode step with tens of rows is one pass over every weight, and on the bf16 B-tile panels (16 bits a
// weight) the AMX linear is bound by reading them (SmolLM2: 212 MB a step). Kept as nibbles and fp32 scales it
// reads 6 bits a weight; each tile is rebuilt in bf16 just before its multiplies, into a per-thread panel the
// unchanged tile loop reads. Each weight is bf16(d * q + m), one fused multiply-add (d * q is exact in fp32: d
// has at most 17 significant bits, q 4) rounded to nearest even, which is what the loader's dequantization to bf16
// gives (gguf_loader: fp32, then .to(bfloat16)), so the output equals amx_linear's on the bf16 weight bit for
// bit. (The values are multiples of 2^-24 or zero, never fp32 denormals, which VCVTNE2PS2BF16 would flush.)
//
// Layout, per 16-column tile t and 32-deep step kc (layers/quantized.py: pack_amx_q4):
//   q4     uint8 [N/16][K/32][16 k-pairs p][16 bytes b]: byte b of row p holds, in its low nibble, the quant of
//          column b / 2 at depth 2p + b % 2 and, in its high nibble, that of column 8 + b / 2 at the same depth:
//          the two halves of the B tile's row p ([16 n][2] bf16) once widened to 32-bit lanes;
//   scales fp32  [N/16][K/32][2][16]: the 16 columns' d, then their m.
// Columns past N (N % 16) have q = d = m = 0.
#pragma once

#include <cstdint>

#include "amx.h"

namespace pagellm {
constexpr int64_t kQ4TileBytes = 16 * 16, kQ4ScaleFloats = 32;  // per (tile, 32-deep step)
}  // namespace pagellm

#if defined(PAGELLM_AMX) && defined(__AVX512BF16__)
#define PAGELLM_AMX_Q4 1

#include <c10/util/BFloat16.h>

namespace pagellm {

// One B tile (16 k-pairs x 16 columns x 2, bf16, 1 KiB) from its nibbles q (256 bytes) and scales s (32 floats).
inline void q4_tile(const uint8_t* q, const float* s, c10::BFloat16* out) {
  const __m512i lo_idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
  const __m512 d = _mm512_loadu_ps(s), m = _mm512_loadu_ps(s + 16);
  const __m512 d_lo = _mm512_permutexvar_ps(lo_idx, d), d_hi = _mm512_permutexvar_ps(hi_idx, d);
  const __m512 m_lo = _mm512_permutexvar_ps(lo_idx, m), m_hi = _mm512_permutexvar_ps(hi_idx, m);
  // q as fp32 by a 16-entry table (vpermps reads an index's low 4 bits: the low nibble needs no mask), on the
  // shuffle port, where int-to-float conversions would compete with the multiply-adds
  const __m512 levels = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
#pragma GCC unroll 4
  for (int p = 0; p < 16; ++p) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + p * 16)));
    const __m512 lo = _mm512_fmadd_ps(d_lo, _mm512_permutexvar_ps(b, levels), m_lo);
    const __m512 hi = _mm512_fmadd_ps(d_hi, _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), levels), m_hi);
    _mm512_store_si512(out + p * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

}  // namespace pagellm
#endif
