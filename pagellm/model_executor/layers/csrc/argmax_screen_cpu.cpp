// A greedy LM head's token without most of its flops: each row's argmax of x @ w^T, exactly the index that
// fma_linear (no bias) then torch.argmax give, from an int8 screening pass at twice the bf16 rate plus the exact
// sums of the few columns the screen cannot rule out.
//
// Why: at 64 decode rows SmolLM2's head (49,152 x 576) is ~3.6 GFLOP a step, ~12% of a decode step on Zen 4, and
// greedy decoding keeps one number of it per row. VPDPBUSD (AVX512-VNNI: u8 x s8, four products into an int32
// lane) retires at VDPBF16PS's rate with twice its products (Zen 4: 3.65 G/s each, register loops).
//
// The screen, per row x and column v (w_v its weights):
//   - P pairs of x's dimensions, the caller's choice, are summed exactly against w_v's bf16 pairs (VDPBF16PS):
//     CPULinear._exact_pairs picks the channels where a final norm's output is ~20x the rest (SmolLM2: largest
//     |x_i| ~46 against an rms of ~2.4), which would make x's int8 step that much coarser;
//   - the rest, x_in, is quantized per row: x_in = s_x q_x + r_x, q_x in [-127, 127], sent as u8 q_x + 128;
//   - w_v is quantized per column at pack time: w_v = s_w q_w + r_w, q_w in [-127, 127];
//   - A_v = s_x s_w (q_x . q_w) + (the pairs' sum), q_x . q_w = sum (q_x + 128) q_w - 128 sum q_w exact in int32.
// The exact dot x . w_v differs from A_v by s_w (q_w . r_x) + r_w . x_in plus rounding, so by Cauchy-Schwarz
//   |x . w_v - A_v| <= s_w |q_w| |r_x| + |r_w| |x_in| + slack = E_v,
// the slack covering the fp32 rounding of A_v and of the exact kernel's own sums (prepare_row; VDPBF16PS's flush of
// results below 2^-126, an absolute error, moves the threshold below). Then with
// L = max_v (A_v - E_v) the largest exact sum is >= L, and a column whose bf16 logit could equal the largest bf16
// logit has an exact sum >= L - ulp (two sums that round to one bf16 value lie within one ulp of it; the ulp at
// the largest magnitude a kept logit can have): only columns with A_v + E_v >= that can be the answer
// (torch.argmax's, the first on ties). Their weights are packed into 16-column panels, whose sums
// fma_linear_panel_sums gives with fma_linear's bits, and rounded to bf16 as fma_linear stores them. The screen
// keeps each 32-column block's largest A_v + E_v; select_columns recomputes the columns' bounds only in the blocks
// that pass (writing every column's bound was 6.3 MB a step at 64 rows). argmax_screen_amx.cpp is the same screen
// on AMX tiles for amx_linear's index; argmax_screen.h holds what the two share.
//
// SmolLM2's head on workload_64's decode rows, 16 exact pairs: E ~1.6 against logits ~34 whose spread is ~4, so a
// row keeps ~25 of 49,152 columns on average (median 1, 99th percentile ~290). Left to the caller's full path:
// rows that are not finite, hold a denormal (VDPBF16PS reads it as zero) or could overflow, calls whose rows keep
// more columns than the caller allows (a row of zeros keeps them all), and weights that are not finite or hold a
// denormal.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "argmax_screen.h"
#include "ops.h"
#include "split_work.h"
#include "vec.h"

namespace {
using namespace pagellm;
using namespace pagellm::screen;

#if defined(PAGELLM_SCREEN)
constexpr bool kScreen = true;
#else
constexpr bool kScreen = false;
#endif

constexpr int kMR = 12;  // rows per micro-block: 12 x 2 int32 accumulators
// The exact stage's panels are built and summed this many jobs (16 columns each) at a time (~9 MB at K = 576).
constexpr int64_t kJobChunk = 512;

#if defined(PAGELLM_SCREEN)
struct Screen {
  const Rows* rows;
  int64_t N, K;
  Bounds b;  // with the int8 panels q and the pairs' weights ws
};

// Rows [r0, r0 + R) of micro-block blk against 32-column block u (panels 2u, 2u + 1; np of them).
// next: the int8 panels of the block this thread runs next (or null), brought into L2 during the first rows' loop
// (the hardware's prefetch alone left the first rows of each block waiting on memory: ~25% of the screen's time).
template <int R>
void screen_block(const Screen& s, int64_t blk, int64_t r0, int64_t u, int np, float* lo_max, const char* next) {
  const Rows& rw = *s.rows;
  const int64_t K4 = s.K / 4, Kq4 = rw.Kq / 4;  // q's panels are Kq deep, the quads past K zero
  const int32_t* xq = rw.quads.data() + blk * K4 * kMR;
  const int8_t* w0 = s.b.q + (2 * u) * Kq4 * 64;
  const int8_t* w1 = np == 2 ? w0 + Kq4 * 64 : w0;
  __m512i acc[R][2];
  PAGELLM_UNROLL for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_si512();
  for (int64_t k = 0; k < K4; ++k) {
    if (next) _mm_prefetch(next + k * 128, _MM_HINT_T1), _mm_prefetch(next + k * 128 + 64, _MM_HINT_T1);
    const __m512i a = _mm512_loadu_si512(w0 + k * 64), b = _mm512_loadu_si512(w1 + k * 64);
    PAGELLM_UNROLL for (int m = 0; m < R; ++m) {
      const __m512i x = _mm512_set1_epi32(xq[k * kMR + m]);
      acc[m][0] = _mm512_dpbusd_epi32(acc[m][0], x, a);
      acc[m][1] = _mm512_dpbusd_epi32(acc[m][1], x, b);
    }
  }
  // to memory before the epilogue, whose runtime panel index would otherwise keep acc on the stack in the loop
  alignas(64) int32_t res[R][2][16];
  PAGELLM_UNROLL for (int m = 0; m < R; ++m) PAGELLM_UNROLL for (int p = 0; p < 2; ++p)
    _mm512_store_si512(res[m][p], acc[m][p]);
  __m512 hi[R];  // each row's largest A + E over the block
  PAGELLM_UNROLL for (int m = 0; m < R; ++m) hi[m] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int p = 0; p < np; ++p) {
    const int64_t c0 = (2 * u + p) * 16;
    // the exact pairs' sums, the rows side by side (a row's in one chain would wait on each dot product)
    const int32_t* wb = s.b.ws + (2 * u + p) * rw.P * 16;
    __m512 out[R];
    PAGELLM_UNROLL for (int m = 0; m < R; ++m) out[m] = _mm512_setzero_ps();
    for (int64_t j = 0; j < rw.P; ++j) {
      const __m512i w = _mm512_loadu_si512(wb + j * 16);
      PAGELLM_UNROLL for (int m = 0; m < R; ++m)
        out[m] = _mm512_dpbf16_ps(out[m], (__m512bh)_mm512_set1_epi32(rw.pair_word[(r0 + m) * rw.P + j]), (__m512bh)w);
    }
    const ColumnFactors f = column_factors(s.b, c0);
    PAGELLM_UNROLL for (int m = 0; m < R; ++m) {
      const LaneBounds lb = bound_lanes(f, rw, r0 + m, _mm512_load_si512(res[m][p]), out[m]);
      float* lo = lo_max + (r0 + m) * 16;
      _mm512_storeu_ps(lo, _mm512_max_ps(_mm512_loadu_ps(lo), lb.lo));
      hi[m] = _mm512_max_ps(hi[m], lb.hi);
    }
  }
  PAGELLM_UNROLL for (int m = 0; m < R; ++m) s.b.item_hi[(r0 + m) * s.b.items + u] = _mm512_reduce_max_ps(hi[m]);
}

template <int... Rs>
void screen_rows(int rows, const Screen& s, int64_t blk, int64_t r0, int64_t u, int np, float* lo_max,
                 const char* next, std::integer_sequence<int, Rs...>) {
  ((rows == Rs + 1 ? screen_block<Rs + 1>(s, blk, r0, u, np, lo_max, next) : void()), ...);
}

void run_screen(const Screen& s) {
  const Rows& rw = *s.rows;
  claim_from_both_ends(s.b.items, 2, [&](int64_t lo, int64_t hi, bool ascending) {
    float* lo_max = s.b.lo_max + at::get_thread_num() * rw.M * 16;
    for (int64_t k = 0; k < hi - lo; ++k) {
      const int64_t u = ascending ? lo + k : hi - 1 - k, u_next = ascending ? u + 1 : u - 1;
      const int np = 2 * u + 1 < s.N / 16 ? 2 : 1;
      // the neighbour in this thread's direction: next in this claim, or most likely its next claim's first
      const char* next = u_next >= 0 && 2 * u_next + 1 < s.N / 16
                             ? reinterpret_cast<const char*>(s.b.q + 2 * u_next * (rw.Kq / 4) * 64) : nullptr;
      for (int64_t b = 0; b < rw.blocks(); ++b) {
        const int64_t r0 = rw.block_start(b);
        screen_rows(static_cast<int>(rw.block_start(b + 1) - r0), s, b, r0, u, np, lo_max, b == 0 ? next : nullptr,
                    std::make_integer_sequence<int, kMR>{});
      }
    }
  });
}
#endif

}  // namespace

bool argmax_screen_supported() { return kScreen; }

namespace pagellm::screen {

#if defined(PAGELLM_SCREEN)
int64_t select_columns(const Bounds& b, Rows& rw, int64_t T, int64_t max_kept, std::vector<std::vector<int64_t>>& cols) {
  const int64_t M = rw.M, items = b.items, N = b.N, K4 = rw.K / 4, Kq4 = rw.Kq / 4, P = rw.P;
  const double tau = std::ldexp(static_cast<double>(rw.K + 2 * P + 16), -125);
  cols.assign(static_cast<size_t>(M), {});
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      float L = -std::numeric_limits<float>::infinity(), H = L;
      for (int64_t t = 0; t < T; ++t)
        for (int l = 0; l < 16; ++l) L = std::max(L, b.lo_max[(t * M + m) * 16 + l]);
      for (int64_t u = 0; u < items; ++u) H = std::max(H, b.item_hi[m * items + u]);
      int e = 0;
      std::frexp((std::max(std::fabs(static_cast<double>(L)), std::fabs(static_cast<double>(H))) + tau) *
                     (1.0 + 1.0 / 256), &e);
      const double thr = static_cast<double>(L) - std::ldexp(1.0, e - 8) * (1 + kBoundSlack) - 2 * tau;
      const auto [xq, stride] = rw.row_quads(m);
      for (int64_t c = 0; c < N / 16; ++c) {  // panel by panel: the 16 columns' bounds again where the block passes
        if (static_cast<double>(b.item_hi[m * items + c / 2]) < thr) continue;
        const int8_t* w = b.q + c * Kq4 * 64;
        __m512i acc = _mm512_setzero_si512();
        for (int64_t k = 0; k < K4; ++k)
          acc = _mm512_dpbusd_epi32(acc, _mm512_set1_epi32(xq[k * stride]), _mm512_loadu_si512(w + k * 64));
        __m512 pairs = _mm512_setzero_ps();
        for (int64_t j = 0; j < P; ++j)
          pairs = _mm512_dpbf16_ps(pairs, (__m512bh)_mm512_set1_epi32(rw.pair_word[m * P + j]),
                                   (__m512bh)_mm512_loadu_si512(b.ws + (c * P + j) * 16));
        alignas(64) float hi[16];
        _mm512_store_ps(hi, bound_lanes(column_factors(b, 16 * c), rw, m, acc, pairs).hi);
        for (int l = 0; l < 16; ++l)
          if (static_cast<double>(hi[l]) >= thr) cols[m].push_back(16 * c + l);
      }
    }
  });
  int64_t kept = 0;
  for (int64_t m = 0; m < M; ++m) {
    if (cols[m].empty()) return -1;
    kept += static_cast<int64_t>(cols[m].size());
  }
  return kept > max_kept ? -1 : kept;
}
#endif

std::pair<int64_t, int64_t> check_screen_args(const at::Tensor& x, const at::Tensor& q, const at::Tensor& sum128,
                                              const at::Tensor& info, const at::Tensor& pairs, const at::Tensor& ws,
                                              const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(0) >= 1 && x.scalar_type() == at::kBFloat16,
              "x: bfloat16 [M, K] with M >= 1 rows");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % 32 == 0 && K > 0, "x: K (", K, ") must be a positive multiple of 32");
  TORCH_CHECK(K <= 32768, "argmax_screen: K (", K, ") above 32,768 could overflow the int32 sums");
  TORCH_CHECK(q.dim() == 4 && q.is_contiguous() && q.scalar_type() == at::kChar && q.size(1) * 4 == packed_depth(K) &&
                  q.size(2) == 16 && q.size(3) == 4,
              "q: int8 [N/16, K/4 rounded up to 16, 16, 4] (argmax_screen_pack)");
  const int64_t N = q.size(0) * 16;
  TORCH_CHECK(sum128.is_contiguous() && sum128.scalar_type() == at::kInt && sum128.numel() == N &&
                  info.is_contiguous() && info.scalar_type() == at::kFloat && info.numel() == kInfoRows * N,
              "sum128, info: argmax_screen_pack's");
  const int64_t P = pairs.numel();
  TORCH_CHECK(pairs.is_contiguous() && pairs.scalar_type() == at::kInt && P <= kMaxPairs,
              "pairs: int32, at most ", kMaxPairs);
  TORCH_CHECK(ws.is_contiguous() && ws.scalar_type() == at::kInt && ws.dim() == 3 && ws.size(0) * 16 == N &&
                  ws.size(1) == P && ws.size(2) == 16, "ws: int32 [N/16, P, 16]");
  std::vector<char> seen(static_cast<size_t>(K / 2), 0);
  for (int64_t j = 0; j < P; ++j) {
    const int32_t t = pairs.data_ptr<int32_t>()[j];
    TORCH_CHECK(t >= 0 && t < K / 2 && !seen[t], "pairs: distinct pair indices below K / 2 (", K / 2, ")");
    seen[t] = 1;
  }
  TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous() && out.numel() == x.size(0), "out: int64 [M]");
  return {N, P};
}

bool prepare_rows(Rows& r, const at::Tensor& x, const at::Tensor& pairs, const at::Tensor& info) {
  const int64_t N = info.size(-1);
  const float* I = info.data_ptr<float>();
  const float max_w_norm = *std::max_element(I + kNorm * N, I + (kNorm + 1) * N);
  std::atomic<bool> ok{true};
  const bf16* X = x.data_ptr<bf16>();
  at::parallel_for(0, r.M, 8, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      if (!prepare_row(r, m, X + m * x.stride(0), pairs.data_ptr<int32_t>(), max_w_norm)) ok = false;
  });
  return ok;
}

}  // namespace pagellm::screen

// w [N, K] bf16 (N % 16 == 0, K % 32 == 0) -> (q int8 [N/16, Kq/4, 16, 4], sum128 int32 [N], info float [4, N]): the
// screen's per-column int8 copy (see the file comment), Kq = K rounded up to 64 (the quads past K zero); three empty
// tensors where w is not finite or holds a denormal.
std::tuple<at::Tensor, at::Tensor, at::Tensor> argmax_screen_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kBFloat16 && w.size(0) % 16 == 0 &&
                  w.size(0) > 0 && w.size(1) % 32 == 0 && w.size(1) > 0,
              "argmax_screen_pack: w must be contiguous bfloat16 [N, K] with N % 16 == 0 and K % 32 == 0");
  const int64_t N = w.size(0), K = w.size(1), Kq = packed_depth(K);
  auto q = at::zeros({N / 16, Kq / 4, 16, 4}, w.options().dtype(at::kChar));
  auto sum128 = at::empty({N}, w.options().dtype(at::kInt));
  auto info = at::empty({kInfoRows, N}, w.options().dtype(at::kFloat));
  const bf16* W = w.data_ptr<bf16>();
  int8_t* Q = q.data_ptr<int8_t>();
  float* I = info.data_ptr<float>();
  int32_t* S = sum128.data_ptr<int32_t>();
  std::atomic<bool> finite{true};
  at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const bf16* row = W + n * K;
      float top = 0.f;
      for (int64_t k = 0; k < K; ++k) {
        const float v = static_cast<float>(row[k]);
        if (!std::isfinite(v) || denormal(row[k])) finite = false;
        top = std::max(top, std::fabs(v));
      }
      const float sw = top > 0.f ? top / 127.f : 1.f;
      double qn = 0, rn = 0, wn = 0;
      int32_t sum = 0;
      for (int64_t k = 0; k < K; ++k) {
        const float v = static_cast<float>(row[k]);
        const float qv = std::clamp(std::nearbyint(v / sw), -127.f, 127.f);
        const double res = static_cast<double>(v) - static_cast<double>(sw) * qv;
        qn += static_cast<double>(qv) * qv, rn += res * res, wn += static_cast<double>(v) * v;
        sum += static_cast<int32_t>(qv);
        Q[(((n / 16) * (Kq / 4) + k / 4) * 16 + n % 16) * 4 + k % 4] = static_cast<int8_t>(qv);
      }
      S[n] = 128 * sum;
      I[kScale * N + n] = sw;
      I[kScaledQNorm * N + n] = up(static_cast<double>(sw) * std::sqrt(qn));
      I[kResidualNorm * N + n] = up(std::sqrt(rn));
      I[kNorm * N + n] = up(std::sqrt(wn));
    }
  });
  if (!finite) return {q.new_empty({0}), sum128.new_empty({0}), info.new_empty({0})};
  return {q, sum128, info};
}

// out [M] int64: each row's index of the largest bf16 output of fma_linear(x, pack_amx(w), no bias, dot) (the first
// on ties), through the screen: q, sum128, info from argmax_screen_pack(w); pairs int32 [P] the pairs of x's dims
// (k / 2) summed exactly (any, distinct: a choice only moves how many columns the screen keeps), ws int32
// [N/16, P, 16] w's bf16 pairs there (ws[c, j, n] = w's pair pairs[j] of column 16c + n). Returns how many (row,
// column) pairs went through the exact stage, or -1, out unset, where the full path should run instead: a row that
// cannot be screened (non-finite or denormal x, a possible overflow), or rows keeping more than max_kept pairs in
// all (a row of zeros keeps every column: the caller's cap, past which its full path is the cheaper one).
int64_t argmax_screen(const at::Tensor& x, const at::Tensor& w, const at::Tensor& q, const at::Tensor& sum128,
                      const at::Tensor& info, const at::Tensor& pairs, const at::Tensor& ws, int64_t dot,
                      int64_t max_kept, at::Tensor out) {
  TORCH_CHECK(kScreen, "argmax_screen needs AVX512-VNNI and AVX512-BF16");
  const auto [N, P] = check_screen_args(x, q, sum128, info, pairs, ws, out);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kBFloat16 && w.size(0) == N &&
                  w.size(1) == K, "w: bfloat16 [N, K], contiguous");
#if defined(PAGELLM_SCREEN)
  Rows r(M, K, kMR, P);
  if (!prepare_rows(r, x, pairs, info)) return -1;
  const int64_t T = at::get_num_threads(), items = (N / 16 + 1) / 2;
  std::vector<float> lo_max(static_cast<size_t>(T * M * 16), -std::numeric_limits<float>::infinity());
  std::vector<float> item_hi(static_cast<size_t>(M * items));
  const Bounds b{info.data_ptr<float>(), sum128.data_ptr<int32_t>(), q.data_ptr<int8_t>(), ws.data_ptr<int32_t>(), N,
                 items, lo_max.data(), item_hi.data()};
  run_screen(Screen{&r, N, K, b});
  // The kept columns' weights go into panels of 16 columns in fma_linear's packed order (zero past the last), whose
  // sums fma_linear_panel_sums gives with fma_linear's bits.
  std::vector<std::vector<int64_t>> cols;
  const int64_t kept = select_columns(b, r, T, max_kept, cols);
  if (kept < 0) return -1;
  const bf16* X = x.data_ptr<bf16>();
  std::vector<int64_t> job_row, job_first;  // a job: 16 of a row's columns from its list, from job_first
  for (int64_t m = 0; m < M; ++m)
    for (size_t i = 0; i < cols[m].size(); i += 16) job_row.push_back(m), job_first.push_back(static_cast<int64_t>(i));
  // each row's first largest bf16 value, its columns in order (a row's jobs come in order, chunk after chunk)
  int64_t* o = out.data_ptr<int64_t>();
  std::fill(o, o + M, int64_t{-1});
  std::vector<float> best(static_cast<size_t>(M));
  const int64_t n = static_cast<int64_t>(job_row.size()), panel = K / 32 * 512;
  const uint32_t* W = reinterpret_cast<const uint32_t*>(w.data_ptr());  // [N][K/2] bf16 pairs
  std::unique_ptr<uint16_t[]> panels(new uint16_t[std::min(n, kJobChunk) * panel]);  // written in full before use
  std::vector<const uint16_t*> panel_at(static_cast<size_t>(kJobChunk));
  std::vector<float> sums(static_cast<size_t>(kJobChunk * 16));
  for (int64_t c0 = 0; c0 < n; c0 += kJobChunk) {
    const int64_t cn = std::min(kJobChunk, n - c0);
    at::parallel_for(0, cn, 4, [&](int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j) {
        uint32_t* dst = reinterpret_cast<uint32_t*>(panels.get() + j * panel);  // [K/2 pairs][16 columns]
        const auto& c = cols[job_row[c0 + j]];
        const int64_t first = job_first[c0 + j], cnt = std::min<int64_t>(16, static_cast<int64_t>(c.size()) - first);
        for (int64_t l = 0; l < 16; ++l) {
          const uint32_t* src = W + (l < cnt ? c[first + l] : 0) * (K / 2);
          for (int64_t t = 0; t < K / 2; ++t) dst[t * 16 + l] = l < cnt ? src[t] : 0u;
        }
        panel_at[j] = panels.get() + j * panel;
      }
    });
    fma_linear_panel_sums(X, x.stride(0), M, K, dot, job_row.data() + c0, panel_at.data(), cn, sums.data());
    for (int64_t j = 0; j < cn; ++j) {
      alignas(32) uint16_t h[16];
      _mm256_store_si256(reinterpret_cast<__m256i*>(h), cvt_bf16(_mm512_loadu_ps(sums.data() + 16 * j)));
      const int64_t m = job_row[c0 + j];
      const auto& c = cols[m];
      const int64_t first = job_first[c0 + j];
      for (int64_t l = 0; l < std::min<int64_t>(16, static_cast<int64_t>(c.size()) - first); ++l) {
        const float v = to_float(c10::BFloat16(h[l], c10::BFloat16::from_bits()));
        if (o[m] < 0 || v > best[m]) best[m] = v, o[m] = c[first + l];
      }
    }
  }
  return kept;
#else
  return -1;
#endif
}

TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("argmax_screen_supported() -> bool", [] { return argmax_screen_supported(); });
  m.def("argmax_screen_pack(Tensor w) -> (Tensor, Tensor, Tensor)");
  m.impl("argmax_screen_pack", c10::DispatchKey::CPU, &argmax_screen_pack);
  m.def("argmax_screen(Tensor x, Tensor w, Tensor q, Tensor sum128, Tensor info, Tensor pairs, Tensor ws, int dot, "
        "int max_kept, Tensor(a!) out) -> int");
  m.impl("argmax_screen", c10::DispatchKey::CPU, &argmax_screen);
}
