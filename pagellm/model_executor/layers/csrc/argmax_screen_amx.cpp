// The greedy LM head's int8 screen on AMX tiles: each row's index of the largest bf16 output of amx_linear (no
// bias), the first on ties, exactly what amx_linear_argmax gives, from an int8 pass plus the exact sums of the few
// columns it cannot rule out. The method and its bound are argmax_screen_cpu.cpp's (file comment); this file forms
// the same sums on tiles.
//
// Why: amx_linear_argmax streams the head's bf16 weights each decode step (SmolLM2: 56.6 MB, ~3.4 ms of a ~46 ms
// step at 64 rows). Their int8 copy is half the bytes, and TDPBUSD does twice TDPBF16PS's products per cycle;
// VPDPBUSD (argmax_screen) on the same CPU took 5.2 ms against the bf16 tiles' 2.7 ms.
//
// Per 32-column block (two 16-column panels) and 16 rows:
//   - the int8 sums over Kq/64 tile steps: A the rows' u8 x_in (Rows with mr == 0: row-major, zero past K), B a
//     panel's 16 quads x 16 columns as argmax_screen_pack lays them ([Kq/4][16][4] per panel is B-tile order);
//   - the exact pairs' sums in one TDPBF16PS: the rows' (up to 16) pair words as A, ws's [16][16] words per panel
//     as B (one 32-deep step); pairs past P are zero on both sides;
//   - the bound per row and lane (bound_lanes), as the VNNI screen; select_columns recomputes the bounds of the
//     blocks that pass with VPDPBUSD, as the VNNI screen does.
// The exact stage runs each kept column's panel through amx_linear's tile chain for the rows keeping it: a zero
// tile, then the K/32 steps of x against the packed bf16 panel in order. A sum depends only on its row and column,
// so these are amx_linear's fp32 sums bit for bit, rounded to bf16 as it stores them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "amx.h"
#include "argmax_screen.h"
#include "split_work.h"

namespace {
using namespace pagellm;
using namespace pagellm::screen;

#if defined(PAGELLM_AMX) && defined(__AMX_INT8__) && defined(PAGELLM_SCREEN)
#define PAGELLM_SCREEN_AMX 1

// Tiles (configure_tiles: all 16 rows x 64 bytes): 0-1 the int32 sums of the block's two panels, 2 the rows' u8
// slice, 3-4 the panels' int8 slices (then their pairs' bf16 words), 5-6 the pairs' fp32 sums, 7 the rows' pairs.
struct AmxScreen {
  const Rows* rows;
  const int32_t* ws;  // [N/16][16][16]: the weights' bf16 pairs at the exact pairs, zero past P (b.ws padded)
  const int32_t* xp;  // [rows rounded up to 16][16]: the rows' pair words, zero past P and M
  int64_t N;
  Bounds b;
};

// Block u's screen for every row; next, next_bytes: the int8 panels this thread screens next, and next_ws their
// pair words, fetched into L2 a slice per tile step.
void screen_item(const AmxScreen& s, int64_t u, float* lo_max, const char* next, int64_t next_bytes,
                 const char* next_ws) {
  const Rows& rw = *s.rows;
  const int64_t Kq = rw.Kq, steps = Kq / 64, blocks = (rw.M + 15) / 16;
  const bool two = 2 * u + 1 < s.N / 16;
  const int8_t* w0 = s.b.q + 2 * u * Kq * 16;
  const int8_t* w1 = w0 + Kq * 16;
  const uint8_t* xq = reinterpret_cast<const uint8_t*>(rw.quads.data());
  const int64_t per_step = (next_bytes / 64 + blocks * steps - 1) / (blocks * steps) * 64;  // whole lines
  if (next_ws) _mm_prefetch(next_ws, _MM_HINT_T1), _mm_prefetch(next_ws + 1024, _MM_HINT_T1);
  alignas(64) int32_t sums[2][16][16];
  alignas(64) float pairs[2][16][16];
  const ColumnFactors f0 = column_factors(s.b, 32 * u), f1 = two ? column_factors(s.b, 32 * u + 16) : f0;
  int64_t fetched = 0;
  for (int64_t rb = 0; rb < blocks; ++rb) {
    const int64_t r0 = 16 * rb, R = std::min<int64_t>(16, rw.M - r0);
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t k = 0; k < steps; ++k) {
      for (const int64_t end = std::min(next_bytes, fetched + per_step); next && fetched < end; fetched += 64)
        _mm_prefetch(next + fetched, _MM_HINT_T1);
      _tile_loadd(2, xq + r0 * Kq + 64 * k, Kq);
      _tile_loadd(3, w0 + 1024 * k, 64);
      _tile_dpbusd(0, 2, 3);
      if (two) {
        _tile_loadd(4, w1 + 1024 * k, 64);
        _tile_dpbusd(1, 2, 4);
      }
    }
    _tile_zero(5);
    _tile_zero(6);
    _tile_loadd(7, s.xp + r0 * 16, 64);
    _tile_loadd(3, s.ws + 2 * u * 256, 64);
    _tile_dpbf16ps(5, 7, 3);
    _tile_stored(0, sums[0], 64);
    _tile_stored(5, pairs[0], 64);
    if (two) {
      _tile_loadd(4, s.ws + (2 * u + 1) * 256, 64);
      _tile_dpbf16ps(6, 7, 4);
      _tile_stored(1, sums[1], 64);
      _tile_stored(6, pairs[1], 64);
    }
    for (int64_t m = 0; m < R; ++m) {
      const int64_t row = r0 + m;
      LaneBounds lb = bound_lanes(f0, rw, row, _mm512_load_si512(sums[0][m]), _mm512_load_ps(pairs[0][m]));
      if (two) {
        const LaneBounds l1 = bound_lanes(f1, rw, row, _mm512_load_si512(sums[1][m]), _mm512_load_ps(pairs[1][m]));
        lb = {_mm512_max_ps(lb.lo, l1.lo), _mm512_max_ps(lb.hi, l1.hi)};
      }
      float* lo = lo_max + row * 16;
      _mm512_storeu_ps(lo, _mm512_max_ps(_mm512_loadu_ps(lo), lb.lo));
      s.b.item_hi[row * s.b.items + u] = _mm512_reduce_max_ps(lb.hi);
    }
  }
}

void run_screen(const AmxScreen& s) {
  const int64_t panel = s.rows->Kq * 16;  // bytes of one int8 panel
  claim_from_both_ends(s.b.items, 2, [&](int64_t lo, int64_t hi, bool ascending) {
    configure_tiles();
    float* lo_max = s.b.lo_max + at::get_thread_num() * s.rows->M * 16;
    for (int64_t k = 0; k < hi - lo; ++k) {
      const int64_t u = ascending ? lo + k : hi - 1 - k, un = ascending ? u + 1 : u - 1;
      // the neighbour in this thread's direction: next in this claim, or most likely its next claim's first
      const bool has_next = un >= 0 && un < s.b.items;
      const int64_t next_panels = has_next ? std::min<int64_t>(2, s.N / 16 - 2 * un) : 0;
      screen_item(s, u, lo_max, has_next ? reinterpret_cast<const char*>(s.b.q + 2 * un * panel) : nullptr,
                  next_panels * panel, has_next ? reinterpret_cast<const char*>(s.ws + 2 * un * 256) : nullptr);
    }
    _tile_release();
  });
}

// The exact stage: up to 16 rows keeping columns of one 16-column panel; for each, the run of its kept columns
// there (cols[row][first .. first + count)).
struct Job {
  int64_t panel = 0, n = 0;
  int64_t row[16], first[16], count[16];
};

// vals[m][i]: amx_linear's bf16 output (as float) at row m, column cols[m][i].
void exact_sums(const at::Tensor& x, const bf16* packed, int64_t K, const std::vector<std::vector<int64_t>>& cols,
                std::vector<std::vector<float>>& vals) {
  const int64_t M = x.size(0), kc_n = K / 32;
  std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> runs;  // (panel, row, first, count)
  for (int64_t m = 0; m < M; ++m) {
    vals[m].resize(cols[m].size());
    for (size_t i = 0; i < cols[m].size();) {
      size_t j = i;
      while (j < cols[m].size() && cols[m][j] / 16 == cols[m][i] / 16) ++j;
      runs.emplace_back(cols[m][i] / 16, m, static_cast<int64_t>(i), static_cast<int64_t>(j - i));
      i = j;
    }
  }
  std::sort(runs.begin(), runs.end());
  std::vector<Job> jobs;
  for (const auto& [panel, m, first, count] : runs) {
    if (jobs.empty() || jobs.back().panel != panel || jobs.back().n == 16) jobs.emplace_back(), jobs.back().panel = panel;
    Job& j = jobs.back();
    j.row[j.n] = m, j.first[j.n] = first, j.count[j.n] = count, ++j.n;
  }
  const bf16* X = x.data_ptr<bf16>();
  at::parallel_for(0, static_cast<int64_t>(jobs.size()), 4, [&](int64_t j0, int64_t j1) {
    configure_tiles();
    std::vector<bf16> a(16 * K);
    alignas(64) float c[16][16];
    for (int64_t jj = j0; jj < j1; ++jj) {
      const Job& j = jobs[jj];
      for (int64_t i = 0; i < 16; ++i)
        if (i < j.n) std::memcpy(a.data() + i * K, X + j.row[i] * x.stride(0), K * sizeof(bf16));
        else std::fill_n(a.data() + i * K, K, bf16(0.f));
      _tile_zero(0);
      for (int64_t kc = 0; kc < kc_n; ++kc) {
        _tile_loadd(4, a.data() + 32 * kc, K * 2);
        _tile_loadd(6, packed + (j.panel * kc_n + kc) * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
      }
      _tile_stored(0, c, 64);
      for (int64_t i = 0; i < j.n; ++i)
        for (int64_t t = j.first[i]; t < j.first[i] + j.count[i]; ++t)
          vals[j.row[i]][t] = static_cast<float>(bf16(c[i][cols[j.row[i]][t] % 16]));
    }
    _tile_release();
  });
}
#endif

}  // namespace

bool argmax_screen_amx_supported() {
#if defined(PAGELLM_SCREEN_AMX)
  return request_amx();
#else
  return false;
#endif
}

// out [M] int64: each row's index of the largest bf16 output of amx_linear(x, packed, no bias) (the first on ties),
// through the screen; packed: pack_amx(w) [N/16, K/32, 16, 16, 2], the rest as argmax_screen's (pairs P <= 16 here).
// Returns how many (row, column) pairs went through the exact stage, or -1, out unset, where the full path
// (amx_linear_argmax) should run instead: as argmax_screen.
int64_t argmax_screen_amx(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& q, const at::Tensor& sum128,
                          const at::Tensor& info, const at::Tensor& pairs, const at::Tensor& ws, int64_t max_kept,
                          at::Tensor out) {
  TORCH_CHECK(argmax_screen_amx_supported(), "argmax_screen_amx needs AMX-INT8, AMX-BF16 and AVX512-BF16");
  const auto [N, P] = check_screen_args(x, q, sum128, info, pairs, ws, out);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(P <= 16, "argmax_screen_amx: at most 16 exact pairs (", P, " given)");
  TORCH_CHECK(packed.dim() == 5 && packed.is_contiguous() && packed.scalar_type() == at::kBFloat16 &&
                  packed.size(0) * 16 == N && packed.size(1) * 32 == K && packed.size(2) == 16 &&
                  packed.size(3) == 16 && packed.size(4) == 2,
              "packed: bfloat16 [N/16, K/32, 16, 16, 2] (pack_amx)");
#if defined(PAGELLM_SCREEN_AMX)
  Rows r(M, K, 0, P);
  if (!prepare_rows(r, x, pairs, info)) return -1;
  // the pairs as 16-deep tiles: the rows' words, and the weights' where P < 16 (the engine's heads have 16)
  std::vector<int32_t> xp((M + 15) / 16 * 16 * 16, 0);
  for (int64_t m = 0; m < M; ++m) std::copy_n(r.pair_word.data() + m * P, P, xp.data() + m * 16);
  at::Tensor ws16 = ws;
  if (P < 16) ws16 = at::constant_pad_nd(ws, {0, 0, 0, 16 - P}).contiguous();
  const int64_t T = at::get_num_threads(), items = (N / 16 + 1) / 2;
  std::vector<float> lo_max(static_cast<size_t>(T * M * 16), -std::numeric_limits<float>::infinity());
  std::vector<float> item_hi(static_cast<size_t>(M * items));
  const Bounds b{info.data_ptr<float>(), sum128.data_ptr<int32_t>(), q.data_ptr<int8_t>(), ws.data_ptr<int32_t>(), N,
                 items, lo_max.data(), item_hi.data()};
  run_screen(AmxScreen{&r, ws16.data_ptr<int32_t>(), xp.data(), N, b});
  std::vector<std::vector<int64_t>> cols;
  const int64_t kept = select_columns(b, r, T, max_kept, cols);
  if (kept < 0) return -1;
  std::vector<std::vector<float>> vals(static_cast<size_t>(M));
  exact_sums(x, packed.data_ptr<bf16>(), K, cols, vals);
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {  // the first largest, the columns in order
    size_t best = 0;
    for (size_t i = 1; i < cols[m].size(); ++i)
      if (vals[m][i] > vals[m][best]) best = i;
    o[m] = cols[m][best];
  }
  return kept;
#else
  return -1;
#endif
}

TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("argmax_screen_amx_supported() -> bool", [] { return argmax_screen_amx_supported(); });
  m.def("argmax_screen_amx(Tensor x, Tensor packed, Tensor q, Tensor sum128, Tensor info, Tensor pairs, Tensor ws, "
        "int max_kept, Tensor(a!) out) -> int");
  m.impl("argmax_screen_amx", c10::DispatchKey::CPU, &argmax_screen_amx);
}
