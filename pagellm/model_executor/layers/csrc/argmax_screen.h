// What the greedy LM head's two int8 screens share (the method: argmax_screen_cpu.cpp's file comment): the rows'
// quantization and bound factors, the per-column bound of one screened sum, and the choice of the columns the
// exact stage sums. The screens differ in how they form the int8 sums and the exact ones: VPDPBUSD and fma_linear's
// micro-kernel (argmax_screen_cpu.cpp, AVX512-VNNI CPUs without AMX), AMX tiles and amx_linear's tile chain
// (argmax_screen_amx.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "vec.h"

namespace pagellm::screen {
using bf16 = c10::BFloat16;

constexpr int64_t kMaxPairs = 32;  // exact pairs of x's dims at most
// Rounding slack, relative, of the bound's own fp32 arithmetic.
constexpr double kBoundSlack = 1.0 / 1024;

// Whether a bf16 value is a denormal: VDPBF16PS and the tiles read those as zero, an error no relative bound covers
// (such rows and weights are left to the full path).
inline bool denormal(bf16 v) { return (v.x & 0x7f80) == 0 && (v.x & 0x7f) != 0; }

// A float not below the double d (norms are summed in double, then rounded up).
inline float up(double d) { return std::nextafter(static_cast<float>(d), std::numeric_limits<float>::infinity()); }

// The packed int8 weight's depth: K rounded up to 64 (one AMX tile's), the quads past K zero.
inline int64_t packed_depth(int64_t K) { return (K + 63) / 64 * 64; }

// Per column of the packed int8 weight: s_w, s_w |q_w| (rounded up), |r_w|, |w| (both rounded up).
enum Info { kScale, kScaledQNorm, kResidualNorm, kNorm, kInfoRows };

// One call's rows: x_in as u8 (q_x + 128), each row's scale and bound factors, its exact pairs. The u8 values lie
// in quads: with mr > 0 per micro-block of mr rows, [K/4][mr] (VPDPBUSD broadcasts a row's quad); with mr == 0 row
// by row, [rows rounded up to 16][Kq] bytes, zero past K (AMX A tiles).
struct Rows {
  int64_t M, K, Kq, mr;
  std::vector<int32_t> quads;
  // s_x, and the bound's factors (rounded up): |r_x| and |x_in| times (1 + kBoundSlack), gx (slack, see prepare_row)
  std::vector<float> sx, rho, xin, gx;
  int64_t P;                       // exact pairs
  std::vector<int32_t> pair_word;  // [M][P]: x's bf16 pair at each exact pair

  Rows(int64_t M_, int64_t K_, int64_t mr_, int64_t P_)
      : M(M_), K(K_), Kq(packed_depth(K_)), mr(mr_), sx(M_), rho(M_), xin(M_), gx(M_), P(P_), pair_word(M_ * P_) {
    quads.assign(static_cast<size_t>(mr ? blocks() * (K / 4) * mr : (M + 15) / 16 * 16 * Kq / 4), 0);
  }
  int64_t blocks() const { return (M + mr - 1) / mr; }
  int64_t block_start(int64_t b) const { return M * b / blocks(); }
  // Row m's first quad and the stride from one of its quads to the next (in quads).
  std::pair<int32_t*, int64_t> row_quads(int64_t m) {
    if (!mr) return {quads.data() + m * (Kq / 4), 1};
    int64_t blk = 0;
    while (block_start(blk + 1) <= m) ++blk;
    return {quads.data() + blk * (K / 4) * mr + (m - block_start(blk)), mr};
  }
};

// Fills row m of r from x (bf16 [K]) and the exact pairs; false if x is not finite, holds a denormal, or is large
// enough that a logit could overflow.
inline bool prepare_row(Rows& r, int64_t m, const bf16* x, const int32_t* pairs, float max_w_norm) {
  const int64_t K = r.K;
  std::vector<float> v(K), a(K);
  double xn = 0;
  for (int64_t k = 0; k < K; ++k) {
    v[k] = static_cast<float>(x[k]), a[k] = std::fabs(v[k]);
    if (!std::isfinite(v[k]) || denormal(x[k])) return false;
    xn += static_cast<double>(v[k]) * v[k];
  }
  if (std::sqrt(xn) * max_w_norm > 1e30) return false;
  for (int64_t j = 0; j < r.P; ++j) {  // the exact pairs, out of x_in
    const int64_t i = 2 * static_cast<int64_t>(pairs[j]);
    r.pair_word[m * r.P + j] = static_cast<int32_t>(x[i].x | (static_cast<uint32_t>(x[i + 1].x) << 16));
    a[i] = a[i + 1] = 0.f, v[i] = v[i + 1] = 0.f;
  }
  const float top = *std::max_element(a.begin(), a.end());
  const float sx = top > 0.f ? top / 127.f : 1.f;
  double rho = 0, xin = 0;
  const auto [quads, stride] = r.row_quads(m);
  uint8_t* q8 = reinterpret_cast<uint8_t*>(quads);
  for (int64_t k = 0; k < K; ++k) {
    const float q = std::clamp(std::nearbyint(v[k] / sx), -127.f, 127.f);
    const double res = static_cast<double>(v[k]) - static_cast<double>(sx) * q;
    rho += res * res, xin += static_cast<double>(v[k]) * v[k];
    q8[(k / 4) * stride * 4 + k % 4] = static_cast<uint8_t>(static_cast<int>(q) + 128);
  }
  // gx |w_v| covers the rounding: the exact kernel's K roundings and the pairs' at most 2P <= K, each of at most
  // 2^-24 sum |w_vi x_i| <= 2^-24 |w_v| |x| (2 (K + 8) of them), and 2^-20 |A_v| for A_v's own arithmetic and the
  // bound's subtraction (|A_v| <= |w_v||x| + E_v, E_v <= 3 |w_v||x| as |r| <= |w| elementwise: under 2^-17 |w_v||x|)
  const double slack = 1 + kBoundSlack;
  r.sx[m] = sx, r.rho[m] = up(std::sqrt(rho) * slack), r.xin[m] = up(std::sqrt(xin) * slack);
  r.gx[m] = up(std::sqrt(xn) * (2.0 * (K + 8) * std::ldexp(1.0, -24) + std::ldexp(1.0, -17)));
  return true;
}

// A screen's operands and results: lo_max [T][M][16] each thread's running max of A - E per row and lane, item_hi
// [M][items] each 32-column block's largest A + E. A column's own A + E is not kept (at 64 rows and SmolLM2's
// vocabulary that would be 6.3 MB written a step): select_columns recomputes it where its block's may pass.
struct Bounds {
  const float* info;      // [kInfoRows][N] (argmax_screen_pack)
  const int32_t* sum128;  // [N]: 128 sum_k q_w
  const int8_t* q;        // [N/16][Kq/4][16][4] (argmax_screen_pack)
  const int32_t* ws;      // [N/16][P][16]: the weights' bf16 pairs at the exact pairs
  int64_t N, items;
  float* lo_max;
  float* item_hi;
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)
#define PAGELLM_SCREEN 1

// The bound's per-column factors of the 16 columns from c0 (one panel).
struct ColumnFactors {
  __m512 sw, c1, nr, nw;  // s_w, s_w |q_w|, |r_w|, |w|
  __m512i s128;
};
inline ColumnFactors column_factors(const Bounds& b, int64_t c0) {
  auto column = [&](Info i) { return _mm512_loadu_ps(b.info + i * b.N + c0); };
  return {column(kScale), column(kScaledQNorm), column(kResidualNorm), column(kNorm),
          _mm512_loadu_si512(b.sum128 + c0)};
}

// Row `row`'s bounds on 16 columns (f their factors) from the int8 sums sum = (q_x + 128) . q_w and the exact
// pairs' sums pairs: A -+ E with E = s_w |q_w| rho' + |r_w| xin' + |w| gx (the row's factors, prepare_row).
struct LaneBounds {
  __m512 lo, hi;
};
inline LaneBounds bound_lanes(const ColumnFactors& f, const Rows& rw, int64_t row, __m512i sum, __m512 pairs) {
  const __m512i d = _mm512_sub_epi32(sum, f.s128);
  const __m512 A = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(_mm512_set1_ps(rw.sx[row]), f.sw), pairs);
  const __m512 E = _mm512_fmadd_ps(f.nw, _mm512_set1_ps(rw.gx[row]),
                                   _mm512_fmadd_ps(f.c1, _mm512_set1_ps(rw.rho[row]),
                                                   _mm512_mul_ps(f.nr, _mm512_set1_ps(rw.xin[row]))));
  return {_mm512_sub_ps(A, E), _mm512_add_ps(A, E)};
}

// The columns each row keeps, ascending: A + E >= L - ulp - 2 tau, with L = the row's largest A - E and
//   - ulp: one bf16 ulp at the largest magnitude a kept logit can have (frexp: mag = f 2^e, f in [0.5, 1), so
//     that ulp is 2^(e - 8)), as two sums that round to one bf16 value lie within one ulp of each other;
//   - tau: the flush to zero of results below 2^-126 (VDPBF16PS's and the tiles'; the inputs hold no denormals),
//     at most 2^-125 a dot product in the exact sums' K / 2 and the pairs' P, absolute, so no relative slack
//     covers it.
// The bounds are recomputed column by column (VPDPBUSD and VDPBF16PS, one row against a block's panels) only in the
// blocks whose item_hi passes; any valid bound will do there. T: the threads whose lo_max rows b holds. Returns how
// many (row, column) pairs are kept, or -1 where a row keeps none (the bound says it cannot happen; the call still
// ends cleanly) or more than max_kept are kept in all.
int64_t select_columns(const Bounds& b, Rows& rw, int64_t T, int64_t max_kept, std::vector<std::vector<int64_t>>& cols);
#endif

// Both screens' operands but the weight's own form (argmax_screen's comment); returns (N, P).
std::pair<int64_t, int64_t> check_screen_args(const at::Tensor& x, const at::Tensor& q, const at::Tensor& sum128,
                                              const at::Tensor& info, const at::Tensor& pairs, const at::Tensor& ws,
                                              const at::Tensor& out);

// prepare_row for each of x's rows (info: argmax_screen_pack's); false if any cannot be screened.
bool prepare_rows(Rows& r, const at::Tensor& x, const at::Tensor& pairs, const at::Tensor& info);

}  // namespace pagellm::screen
