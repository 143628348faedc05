// The AMX linear kernel's epilogue (amx_linear_cpu.cpp): a 32 x 32 block of y from its fp32 sums, as bf16 (+ bias),
// as silu(gate) * up, or offered to each row's running argmax.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "vec.h"

#if defined(__AVX512F__)
namespace pagellm::amx_epilogue {
using bf16 = c10::BFloat16;

// The epilogue of one 32 x 32 block of y from its fp32 block c [32][32] (+ bias): y = bf16(c), or, for
// silu_mul, y = silu(g) * u from gate's block c and up's block cu, each first rounded to bf16 (+ bias: gate's at
// n0, up's at up_n0), so the result is bit for bit silu_and_mul's on the bf16 gate_up the plain epilogue would
// have written (they share vec.h's silu16). Written a few rows at a time (rows_to), between the next block's tile
// multiplies, so its vector work overlaps them: the product's epilogue took ~40% of gate/up's time when it ran
// after the block. SmolLM2's shapes at 2,048 rows, 30 paired runs against the epilogue after the block: gate/up
// with the product 0.91x the time, qkv 0.95x, o and down ~1.0x; at 64 rows 0.97-1.0x.
// A row's largest output so far and its column (argmax: the first on ties, the first NaN over any number).
struct Best {
  float v = -std::numeric_limits<float>::infinity();
  int64_t i = std::numeric_limits<int64_t>::max();  // max: no column seen

  // Takes (v, i) if it comes first in torch.argmax's order: NaN above all, then larger, then lower index.
  void offer(float value, int64_t index) {
    const bool nan = std::isnan(value), have_nan = std::isnan(v);
    if (nan != have_nan ? nan : (nan ? index < i : value > v || (value == v && index < i))) v = value, i = index;
  }
};

struct Epilogue {
  const float* c = nullptr;
  const float* cu = nullptr;  // silu_mul: up's block
  int64_t rows = 0, done = 0, n0 = 0, up_n0 = 0, cols = 0;
  const bf16* bias = nullptr;
  bf16* y = nullptr;  // the block's first row
  int64_t ldy = 0;
  Best* best = nullptr;  // argmax: the block's first row's entry (y unused)

  void rows_to(int64_t end) {
    for (end = std::min(end, rows); done < end; ++done) best ? argmax_row(done) : cu ? silu_row(done) : plain_row(done);
  }

 private:
  void plain_row(int64_t m) const {
    const float* cm = c + m * 32;
    bf16* ym = y + m * ldy + n0;
    int64_t j = 0;
    for (; j + 16 <= cols; j += 16) {
      __m512 v = _mm512_loadu_ps(cm + j);
      if (bias) v = _mm512_add_ps(v, load16(bias + n0 + j));
      store16(ym + j, v);
    }
    for (; j < cols; ++j) ym[j] = static_cast<bf16>(cm[j] + (bias ? to_float(bias[n0 + j]) : 0.f));
  }
  // The row's block as plain_row would store it (bf16, no bias: amx_linear_argmax checks), offered to its Best.
  void argmax_row(int64_t m) const {
    for (int64_t j = 0; j < cols; j += 16) {
      const __mmask16 k = cols - j >= 16 ? 0xffff : static_cast<__mmask16>((1u << (cols - j)) - 1);
      const __m512 v = round_to(_mm512_maskz_loadu_ps(k, c + m * 32 + j), static_cast<const bf16*>(nullptr));
      const __mmask16 nan = _mm512_mask_cmp_ps_mask(k, v, v, _CMP_UNORD_Q);
      if (nan) {
        best[m].offer(std::numeric_limits<float>::quiet_NaN(), n0 + j + __builtin_ctz(nan));
        continue;
      }
      const float top = _mm512_mask_reduce_max_ps(k, v);
      const __mmask16 at = _mm512_mask_cmp_ps_mask(k, v, _mm512_set1_ps(top), _CMP_EQ_OQ);
      best[m].offer(top, n0 + j + __builtin_ctz(at));
    }
  }
  void silu_row(int64_t m) const {  // cols is a multiple of 16 (amx_linear_silu_mul checks)
    bf16* ym = y + m * ldy + n0;
    for (int64_t j = 0; j < cols; j += 16) {
      __m512 g = _mm512_loadu_ps(c + m * 32 + j), u = _mm512_loadu_ps(cu + m * 32 + j);
      if (bias) g = _mm512_add_ps(g, load16(bias + n0 + j)), u = _mm512_add_ps(u, load16(bias + up_n0 + j));
      g = round_to(g, ym), u = round_to(u, ym);
      store16(ym + j, _mm512_mul_ps(round_to(silu16(g), ym), u));
    }
  }
};

}  // namespace pagellm::amx_epilogue
#endif
