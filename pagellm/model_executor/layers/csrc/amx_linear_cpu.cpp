// y [M, N] = x [M, K] @ w[N, K]^T (+ bias) on AMX tiles, bf16 in, fp32 accumulation, bf16 out.
//
// w is packed once at load into AMX's B-tile order, [N/16][K/32][16 k-pairs][16 n][2]: each 16-column x 32-deep
// slice is one contiguous KiB and each 16-column panel one contiguous run of K/32 KiB. The unit of work is a
// 32 x 32 block of y held in four fp32 C tiles (two A tiles of x, two B tiles of w per 32-deep step: four loads
// feed four tile multiplies, with each load issued as soon as the multiplies before it have read the tile it
// overwrites).
//
// The work items are (row chunk of kRowChunk rows, 32-column block), row chunk by row chunk (the chunk's x stays
// in L2); an item runs every 32-row block of its chunk against the block's w panel (in L1/L2 after the first).
// Threads claim runs of items from both ends (split_work.h), so a core that runs faster takes more of them:
// SmolLM2's 120 linears at 64 rows, each layer's four alternating with the previous static column split in one
// process, 20 rounds: 21.3 against 24.8 ms (median ratio 0.87); at 2,048 rows no different. For a decode step
// (tens of rows) that is one pass over w, which streams from memory once; for a prefill chunk w is read once per
// row chunk.
// While a block runs, the next block's panels are prefetched into L2, a slice per row block and a few lines per
// 32-deep step. Into L2 rather than L1, and spread over all the row blocks rather than issued by the first:
// 0.89-0.94x the time at 1-512 rows (SmolLM2's 120 linears against the previous build, 10 alternating pairs per
// row count in one process, two runs; `python bench/kernels.py` times the kernel per row count).
// Prefill-sized calls (kRowMajorRows rows or more per part of K) run row-major instead (row_block): the items are
// (column group of ~1 MiB of panels, 32-row block); a row block's x stays in L1 across the group's column blocks
// and w's tiles stream from L2 (the group's panels stay there while the row blocks pass). A tile multiply takes
// 16 cycles and a 2 x 2 block's 32-deep step loads 4 KiB, so with both operands coming from L2 the loads, not the
// multiplies, set the pace (a bare tile loop here: ~3.0 TFLOP/s a core with one operand in L1, ~2.1 with both in
// L2). SmolLM2's 120 linears at 2,048 rows, alternating in one process: 154-165 against 182-198 ms (qkv and o
// 0.78x, gate/up 0.82x, down 0.96x); at 384-768 rows 0.90-1.0x; below, column-major stays faster.
// x rows past the last full 16 are copied into a zero-padded tile so every tile load is a full 16 rows.
// amx_linear_argmax runs an LM head for greedy sampling: each row's index of its largest output (as bf16), kept per
// thread as the blocks come and merged at the end, so the [rows, vocab] logits are never written nor read back
// (6.3 MB a decode step at 64 rows for SmolLM2). workload_64, 4 alternating process pairs against the logits and
// argmax_rows: 8.38-8.73 against 8.75-8.92 s, inter-token p50 47.2-48.5 against 48.4-50.3 ms.
// amx_linear_silu_mul runs a gate/up layer ([gate | up] packed as one weight) with silu(gate) * up in the epilogue:
// each item computes gate's block and up's block of the same columns and writes only their product, so the
// 2I-wide gate_up never goes to memory (at 2,048 rows its stores made the GEMM ~1.6x slower than the same
// multiplies writing to one L1-resident row) and no separate pass reads it back.
// amx_q4_linear runs the column-major order on a 4-bit GGUF weight kept as nibbles (amx_q4_panels.h): each item's
// first row block rebuilds the block's bf16 panels two k-steps ahead of its tile loads, into a per-thread buffer
// the later row blocks read; the next block's nibbles and scales are prefetched instead of its panels. In the
// engine (workload_64's prompts, decode steps alternating in pairs between the two, medians of 116): 8 rows 14.4
// against 16.6 ms a step, 16 rows 17.8 against 19.7, 32 rows 27.3 against 28.8, 48 rows 36.0 against 37.2, 64
// rows 43.3-49.1 against 45.2-49.7 (five runs), 96 rows 60.0 against 64.2, 128 rows 74.5 against 80.0.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "amx.h"
#include "amx_linear_epilogue.h"
#include "amx_q4_panels.h"
#include "split_work.h"
#include "tile_linear.h"
#include "vec.h"

namespace {
using namespace pagellm;
using bf16 = c10::BFloat16;

#if defined(PAGELLM_AMX)
using amx_epilogue::Best;
using amx_epilogue::Epilogue;

constexpr int64_t kRowChunk = 256;
// Row-major order (row_block): x's 32 rows held in L1 in parts of at most kResidentSteps 32-deep steps (36 KiB),
// for calls of at least kRowMajorRows rows per part.
constexpr int64_t kResidentSteps = 18, kRowMajorRows = 384;

inline int64_t k_parts(int64_t kc_n) { return (kc_n + kResidentSteps - 1) / kResidentSteps; }

// A B tile's load, with the streaming hint (TILELOADDT1) or without; the tile intrinsics take the tile as a literal.
#define PAGELLM_LOAD_B(tile, stream, p)                   \
  do {                                                    \
    if constexpr (stream) _tile_stream_loadd(tile, p, 64); \
    else _tile_loadd(tile, p, 64);                        \
  } while (0)

// Tiles (configure_tiles): C 0-3 (fp32 16 x 16; C[2 mi + ni]), A 4-5 (bf16 16 x 32), B 6-7 (16 k-pairs).
// One 16*MB x 16*NB block: a[i] rows of x (stride lda elements), b[j] packed panels; c: [32][32] fp32, started
// from cin's sums (the same layout) or from zero (cin null). StreamB: w's tiles loaded with the streaming hint.
// pf, pf_bytes: a slice of the next column block's panels, fetched into L2 alongside, evenly over the k-steps.
// between(kc, kc_n) runs after each k-step's multiplies are issued: the previous block's epilogue, a slice at a
// time, so its vector work overlaps this block's tile multiplies.
// produce(kc) writes w's tiles of k-step kc before they are loaded (amx_q4_linear's rebuilt panels; a no-op
// otherwise), two steps ahead, so that its stores drain before the tile loads read them and its vector work runs
// while the tile multiplies of the steps before do.
template <int MB, int NB, bool StreamB, typename Between, typename Produce>
void block(const bf16* const* a, const int64_t* lda, const bf16* const* b, int64_t kc_n, const char* pf,
           int64_t pf_bytes, const float* cin, float* c, Between&& between, Produce&& produce) {
  const int64_t pf_step = ((pf_bytes + kc_n - 1) / kc_n + 63) / 64 * 64;  // whole lines per k-step
  if (cin) {
    _tile_loadd(0, cin, 128);
    if (NB > 1) _tile_loadd(1, cin + 16, 128);
    if (MB > 1) _tile_loadd(2, cin + 512, 128);
    if (MB > 1 && NB > 1) _tile_loadd(3, cin + 528, 128);
  } else {
    _tile_zero(0);
    if (NB > 1) _tile_zero(1);
    if (MB > 1) _tile_zero(2);
    if (MB > 1 && NB > 1) _tile_zero(3);
  }
  const int64_t sa0 = lda[0] * 2, sa1 = lda[1] * 2;
  produce(0);
  if (kc_n > 1) produce(1);
  _tile_loadd(4, a[0], sa0);
  PAGELLM_LOAD_B(6, StreamB, b[0]);
  if (NB > 1) PAGELLM_LOAD_B(7, StreamB, b[1]);
  if (MB > 1) _tile_loadd(5, a[1], sa1);
  for (int64_t kc = 0; kc < kc_n; ++kc) {
    const bool more = kc + 1 < kc_n;
    const int64_t ka = (kc + 1) * 32, kb = (kc + 1) * 512;
    for (int64_t o = kc * pf_step, end = std::min(pf_bytes, o + pf_step); o < end; o += 64)
      _mm_prefetch(pf + o, _MM_HINT_T1);
    _tile_dpbf16ps(0, 4, 6);
    if (NB > 1) _tile_dpbf16ps(1, 4, 7);
    if (kc + 2 < kc_n) produce(kc + 2);
    if (more) _tile_loadd(4, a[0] + ka, sa0);
    if (MB > 1) {
      _tile_dpbf16ps(2, 5, 6);
      if (more) PAGELLM_LOAD_B(6, StreamB, b[0] + kb);
      if (NB > 1) _tile_dpbf16ps(3, 5, 7);
      if (more) _tile_loadd(5, a[1] + ka, sa1);
    } else if (more) {
      PAGELLM_LOAD_B(6, StreamB, b[0] + kb);
    }
    if (NB > 1 && more) PAGELLM_LOAD_B(7, StreamB, b[1] + kb);
    between(kc, kc_n);
  }
  _tile_stored(0, c, 128);
  if (NB > 1) _tile_stored(1, c + 16, 128);
  if (MB > 1) _tile_stored(2, c + 512, 128);
  if (MB > 1 && NB > 1) _tile_stored(3, c + 528, 128);
}

// block() for mt row tiles and nt column tiles (1 or 2 each).
template <bool StreamB, typename Between, typename Produce>
void dispatch_block(int64_t mt, int64_t nt, const bf16* const* a, const int64_t* lda, const bf16* const* b,
                    int64_t kc_n, const char* pf, int64_t pf_bytes, const float* cin, float* c, Between&& between,
                    Produce&& produce) {
  if (mt == 2 && nt == 2) block<2, 2, StreamB>(a, lda, b, kc_n, pf, pf_bytes, cin, c, between, produce);
  else if (mt == 2) block<2, 1, StreamB>(a, lda, b, kc_n, pf, pf_bytes, cin, c, between, produce);
  else if (nt == 2) block<1, 2, StreamB>(a, lda, b, kc_n, pf, pf_bytes, cin, c, between, produce);
  else block<1, 1, StreamB>(a, lda, b, kc_n, pf, pf_bytes, cin, c, between, produce);
}

constexpr auto kNoProduce = [](int64_t) {};

// One call's operands. Plain: y [M, N] = x @ w^T. silu_mul: w holds [gate | up] (2 * N columns, N % 16 == 0),
// up's first 16-column panel is panel up_tile = N / 16, and y [M, N] = silu(x @ gate^T) * (x @ up^T).
struct Gemm {
  const bf16* x;
  int64_t lda, M;
  const bf16* bp;  // packed w
  int64_t kc_n;    // K / 32
  int64_t N;       // y's columns
  int64_t up_tile; // silu_mul: up's first panel; 0: plain
  const bf16* bias;
  bf16* y;
  int64_t ldy;
  int64_t blocks;  // y's 32-column blocks
  Best* best = nullptr;  // argmax: [threads][M], each thread's rows (y unused)
  // amx_q4_linear: w as nibbles and scales (amx_q4_panels.h) instead of bp, each block's panels rebuilt per item
  const uint8_t* q4 = nullptr;
  const float* q4_scales = nullptr;
};

// Rows [mc, mc_end) of y's column block nb (32 columns); next_nb: the block this thread runs next (-1: none),
// whose panels are prefetched meanwhile. tail: x's rows past the last full 16, zero-padded to 16 (or empty).
// c, cu: two [32][32] fp32 blocks each (cu: up's, silu_mul only): row block r's epilogue reads slot r % 2 while
// row block r + 1 computes into the other.
void column_block(const Gemm& g, int64_t mc, int64_t mc_end, int64_t nb, int64_t next_nb, const bf16* tail,
                  float* c, float* cu, Best* best, bf16* panels) {
  const int64_t full = g.M / 16 * 16, K = g.kc_n * 32;
  const int64_t panel = g.kc_n * 512, tiles_n = (g.N + 15) / 16;
  const int64_t t0 = nb * 2, nt = std::min<int64_t>(2, tiles_n - t0), n0 = t0 * 16;
  const int64_t cols = std::min<int64_t>(32, g.N - n0);
  const bool silu = g.up_tile > 0;
  // w's panels of this block: packed at load, or (q4) rebuilt here from its nibbles into panels, [gate's 2][up's 2]
  const bf16* w0 = g.q4 ? nullptr : g.bp + t0 * panel;
  const bf16* wu = g.q4 ? nullptr : w0 + g.up_tile * panel;
  // bytes of w's stored form a panel (each block's are contiguous; silu_mul: gate's, then up's, up_tile panels on)
  const int64_t stored = g.q4 ? g.kc_n * kQ4TileBytes : panel * static_cast<int64_t>(sizeof(bf16));
  const char* base = g.q4 ? reinterpret_cast<const char*>(g.q4) : reinterpret_cast<const char*>(g.bp);
#if defined(PAGELLM_AMX_Q4)
  if (g.q4) {
    if (next_nb >= 0)  // the next block's scales (its nibbles come with the slices below)
      for (int64_t u = 0; u < (silu ? 2 : 1); ++u) {
        const char* s = reinterpret_cast<const char*>(g.q4_scales + (next_nb * 2 + u * g.up_tile) * g.kc_n * 32);
        for (int64_t o = 0; o < 2 * g.kc_n * 128; o += 64) _mm_prefetch(s + o, _MM_HINT_T1);
      }
    w0 = panels, wu = panels + 2 * panel;
  }
#endif
  const bf16* b[2] = {w0, w0 + (nt - 1) * panel};
  const bf16* bu[2] = {wu, wu + (nt - 1) * panel};
  // The next block's panels (or nibbles), a slice per row block and operand.
  const char* next = next_nb >= 0 ? base + next_nb * 2 * stored : nullptr;
  const int64_t up_offset = g.up_tile * stored;
  const int64_t next_tiles = next_nb >= 0 ? std::min<int64_t>(next_nb * 2 + 2, tiles_n) - next_nb * 2 : 0;
  const int64_t next_bytes = next_tiles * stored;
  const int64_t row_blocks = (mc_end - mc + 31) / 32;
  Epilogue prev;  // the previous row block's (rows = 0: none)
  for (int64_t m0 = mc; m0 < mc_end; m0 += 32) {
    const int64_t rows = std::min<int64_t>(32, mc_end - m0), mt = (rows + 15) / 16;
    const bf16* a[2];
    int64_t ld[2];
    for (int i = 0; i < 2; ++i) {
      const int64_t r = m0 + 16 * std::min<int64_t>(i, mt - 1);
      a[i] = r < full ? g.x + r * g.lda : tail;
      ld[i] = r < full ? g.lda : K;
    }
    // This block's output lines, fetched for writing now and written during the next block, when y is larger
    // than L2: stores that miss fill the store buffer and stall the multiplies. At 2,048 rows, paired runs: qkv
    // 0.93x the time, o 0.96x, down 0.97x; at 64 rows (y stays in L2) it cost 0-5%, hence the row condition.
    if (g.M > kRowChunk && !best)
      for (int64_t r = 0; r < rows; ++r) __builtin_prefetch(g.y + (m0 + r) * g.ldy + n0, 1, 3);
    const int64_t i = (m0 - mc) / 32, lo = next_bytes * i / row_blocks / 64 * 64;
    const int64_t hi = i + 1 == row_blocks ? next_bytes : next_bytes * (i + 1) / row_blocks / 64 * 64;
    const int64_t slot = i % 2 * 1024;
    // run(w, pf, out, from, to, t, dst): the block against panels w into out, with rows [from, to) of prev's
    // epilogue; q4: the first row block rebuilds the panels of tiles t, t + 1 into dst (= w[0]) as it goes
    auto run = [&](const bf16* const* w, const char* pf, float* out, int64_t from, int64_t to, int64_t t,
                   bf16* dst) {
      auto between = [&](int64_t kc, int64_t kc_n) { prev.rows_to(from + (to - from) * (kc + 1) / kc_n); };
#if defined(PAGELLM_AMX_Q4)
      if (g.q4 && m0 == mc) {
        auto produce = [&](int64_t kc) {
          for (int64_t j = 0; j < nt; ++j) {
            const int64_t tile = (t + j) * g.kc_n + kc;
            q4_tile(g.q4 + tile * kQ4TileBytes, g.q4_scales + tile * kQ4ScaleFloats, dst + (j * g.kc_n + kc) * 512);
          }
        };
        dispatch_block<false>(mt, nt, a, ld, w, g.kc_n, pf + lo, hi - lo, nullptr, out, between, produce);
        return;
      }
#endif
      dispatch_block<false>(mt, nt, a, ld, w, g.kc_n, pf + lo, hi - lo, nullptr, out, between, kNoProduce);
    };
    if (silu) {
      run(b, next, c + slot, 0, prev.rows / 2, t0, panels);
      run(bu, next ? next + up_offset : nullptr, cu + slot, prev.rows / 2, prev.rows, t0 + g.up_tile,
          panels ? panels + 2 * panel : nullptr);
    } else {
      run(b, next, c + slot, 0, prev.rows, t0, panels);
    }
    prev = Epilogue{c + slot, silu ? cu + slot : nullptr, rows, 0, n0, g.up_tile * 16 + n0, cols, g.bias,
                    g.y + m0 * g.ldy, g.ldy, best ? best + m0 : nullptr};
  }
  prev.rows_to(prev.rows);
}

// Rows [m0, m0 + 32) of y against column blocks [nb0, nb1), the row-major order of prefill-sized calls: x's 32
// rows stay in L1 from one column block to the next while w's tiles stream from L2 with the streaming hint, so
// every 32-deep step takes one operand from L1 and only 2 KiB from L2 (the column-major order reads both from L2
// once a row block's x and a column block's panels exceed L1 together, as at K = 576: 36 KiB each). x's rows
// longer than kResidentSteps steps go in parts, each column block's sums kept in part (fp32: the same bits) from
// one part to the next; the epilogue runs in the last.
void row_block(const Gemm& g, int64_t m0, int64_t nb0, int64_t nb1, const bf16* tail, float* c, float* cu,
               float* part, Best* best) {
  const int64_t full = g.M / 16 * 16, K = g.kc_n * 32;
  const int64_t panel = g.kc_n * 512, tiles_n = (g.N + 15) / 16;
  const int64_t rows = std::min<int64_t>(32, g.M - m0), mt = (rows + 15) / 16;
  const bool silu = g.up_tile > 0;
  const int64_t parts = k_parts(g.kc_n);
  for (int64_t q = 0; q < parts; ++q) {
    const int64_t k0 = g.kc_n * q / parts, kn = g.kc_n * (q + 1) / parts - k0;
    const bool first = q == 0, last = q + 1 == parts;
    const bf16* a[2];
    int64_t ld[2];
    for (int i = 0; i < 2; ++i) {
      const int64_t r = m0 + 16 * std::min<int64_t>(i, mt - 1);
      a[i] = (r < full ? g.x + r * g.lda : tail) + k0 * 32;
      ld[i] = r < full ? g.lda : K;
    }
    Epilogue prev;  // the previous column block's (rows = 0: none)
    for (int64_t nb = nb0; nb < nb1; ++nb) {
      const int64_t t0 = nb * 2, nt = std::min<int64_t>(2, tiles_n - t0), n0 = t0 * 16;
      const int64_t cols = std::min<int64_t>(32, g.N - n0);
      const bf16* b[2] = {g.bp + t0 * panel + k0 * 512, g.bp + (t0 + nt - 1) * panel + k0 * 512};
      const bf16* bu[2] = {b[0] + g.up_tile * panel, b[1] + g.up_tile * panel};
      const int64_t slot = (nb - nb0) % 2 * 1024;
      float* pg = parts > 1 ? part + (nb - nb0) * 2048 : nullptr;  // this block's partial sums: gate's (or plain), up's
      auto run = [&](const bf16* const* w, float* pw, float* out, int64_t from, int64_t to) {
        auto between = [&](int64_t kc, int64_t kc_n) { prev.rows_to(from + (to - from) * (kc + 1) / kc_n); };
        dispatch_block<true>(mt, nt, a, ld, w, kn, nullptr, 0, first ? nullptr : pw, last ? out : pw, between,
                             kNoProduce);
      };
      if (silu) {
        run(b, pg, c + slot, 0, prev.rows / 2);
        run(bu, pg + 1024, cu + slot, prev.rows / 2, prev.rows);
      } else {
        run(b, pg, c + slot, 0, prev.rows);
      }
      if (last)
        prev = Epilogue{c + slot, silu ? cu + slot : nullptr, rows, 0, n0, g.up_tile * 16 + n0, cols, g.bias,
                        g.y + m0 * g.ldy, g.ldy, best ? best + m0 : nullptr};
    }
    prev.rows_to(prev.rows);
  }
}

// Work items u = (row chunk u / blocks, column block u % blocks), [lo, hi) in the given direction; row-major
// (groups > 0): u = (column group u / row blocks, row block u % row blocks).
void items(const Gemm& g, int64_t lo, int64_t hi, bool ascending, int64_t groups) {
  configure_tiles();
  alignas(64) float c[2 * 32 * 32], cu[2 * 32 * 32];
  const int64_t full = g.M / 16 * 16, K = g.kc_n * 32;
  // The last M % 16 rows, zero-padded to 16 (memcpy / memset: a vector's fill of 2-byte elements runs element by
  // element).
  std::unique_ptr<bf16[]> tail;
  if (full < g.M) {
    tail.reset(new bf16[16 * K]);
    for (int64_t m = full; m < g.M; ++m) std::memcpy(tail.get() + (m - full) * K, g.x + m * g.lda, K * sizeof(bf16));
    std::memset(tail.get() + (g.M - full) * K, 0, (16 - (g.M - full)) * K * sizeof(bf16));
  }
  Best* best = g.best ? g.best + at::get_thread_num() * g.M : nullptr;
  const int64_t row_blocks = (g.M + 31) / 32;
  // q4: a block's rebuilt panels, gate's and up's (64-byte aligned for the tile loads)
  std::unique_ptr<char[]> panel_mem(g.q4 ? new char[4 * g.kc_n * 1024 + 64] : nullptr);
  bf16* panels = g.q4 ? reinterpret_cast<bf16*>((reinterpret_cast<uintptr_t>(panel_mem.get()) + 63) / 64 * 64)
                      : nullptr;
  std::unique_ptr<float[]> part;  // row-major, K split: [column block][gate, up][32][32] partial sums
  for (int64_t k = 0; k < hi - lo; ++k) {
    const int64_t u = ascending ? lo + k : hi - 1 - k;
    if (groups > 0) {
      const int64_t grp = u / row_blocks;
      const int64_t nb0 = g.blocks * grp / groups, nb1 = g.blocks * (grp + 1) / groups;
      if (!part && k_parts(g.kc_n) > 1) part.reset(new float[(g.blocks / groups + 1) * 2048]);
      const int64_t rb = u % row_blocks;
      row_block(g, rb * 32, nb0, nb1, tail.get(), c, cu, part.get(), best);
      continue;
    }
    const int64_t mc = u / g.blocks * kRowChunk, nb = u % g.blocks, next = ascending ? nb + 1 : nb - 1;
    column_block(g, mc, std::min(g.M, mc + kRowChunk), nb, next >= 0 && next < g.blocks ? next : -1, tail.get(),
                 c, cu, best, panels);
  }
  _tile_release();
}

void run(Gemm g) {
  const int64_t chunks = (g.M + kRowChunk - 1) / kRowChunk;
  g.blocks = (g.N + 31) / 32;
  if (g.M >= kRowMajorRows * k_parts(g.kc_n) && !g.q4) {
    // w's column groups of at most ~1 MiB of panels (gate/up: both), each in L2 while the row blocks pass
    const int64_t block_bytes = g.kc_n * 2048 * (g.up_tile > 0 ? 2 : 1);
    const int64_t per_group = std::max<int64_t>(1, (int64_t{1} << 20) / block_bytes);
    const int64_t groups = (g.blocks + per_group - 1) / per_group, row_blocks = (g.M + 31) / 32;
    claim_from_both_ends(groups * row_blocks, 2, [&](int64_t lo, int64_t hi, bool ascending) {
      items(g, lo, hi, ascending, groups);
    });
    return;
  }
  claim_from_both_ends(chunks * g.blocks, 2, [&](int64_t lo, int64_t hi, bool ascending) {
    items(g, lo, hi, ascending, 0);
  });
}
#endif

}  // namespace

bool amx_linear_supported() {
#if defined(PAGELLM_AMX)
  return request_amx();
#else
  return false;
#endif
}

namespace {
// Checks the operands (tile_linear.h).
void check(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
           const at::Tensor& out, int64_t w_cols) {
  check_tile_linear(amx_linear_supported(), "amx_linear needs AMX-BF16", x, packed, bias, out, w_cols);
}

#if defined(PAGELLM_AMX)
Gemm operands(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  const bool has_bias = bias.has_value() && bias->defined();
  return Gemm{x.data_ptr<bf16>(), x.stride(0), x.size(0), packed.data_ptr<bf16>(), packed.size(1), out.size(1), 0,
              has_bias ? bias->data_ptr<bf16>() : nullptr, out.data_ptr<bf16>(), out.stride(0), 0};
}
#endif
}  // namespace

// packed: [ceil(N/16), K/32, 16, 16, 2] bf16 (see above); x [M, K] with K % 32 == 0.
void amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, at::Tensor out) {
  check(x, packed, bias, out, out.size(1));
#if defined(PAGELLM_AMX)
  run(operands(x, packed, bias, out));
#endif
}

// out [M, I] = silu(gate) * up with [gate | up] = x @ w^T (+ bias), w: 2I columns packed (I % 16 == 0, so gate
// and up share no panel). The same bits as amx_linear into a bf16 gate_up and then silu_and_mul, without writing
// and re-reading gate_up (at 2,048 rows, 12 MB per layer) or a separate pass.
void amx_linear_silu_mul(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         at::Tensor out) {
  const int64_t I = out.size(1);
  TORCH_CHECK(I % 16 == 0, "amx_linear_silu_mul: the intermediate size (", I, ") must be a multiple of 16");
  check(x, packed, bias, out, 2 * I);
#if defined(PAGELLM_AMX)
  Gemm g = operands(x, packed, bias, out);
  g.up_tile = I / 16;
  run(g);
#endif
}

// out [M] int64: each row's index of the largest column of x @ w^T (n columns, no bias) as amx_linear would store it
// (bf16), the first on ties and the first NaN if any: torch.argmax of amx_linear's output, without writing it.
void amx_linear_argmax(const at::Tensor& x, const at::Tensor& packed, int64_t n, at::Tensor out) {
  TORCH_CHECK(amx_linear_supported(), "amx_linear_argmax needs AMX-BF16");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(0) >= 1 && x.scalar_type() == at::kBFloat16,
              "x: bfloat16 [M, K] with M >= 1 rows");
  TORCH_CHECK(packed.dim() == 5 && packed.is_contiguous() && packed.scalar_type() == at::kBFloat16 &&
              packed.size(1) * 32 == x.size(1) && packed.size(2) == 16 && packed.size(3) == 16 &&
              packed.size(4) == 2 && n >= 1 && (n + 15) / 16 == packed.size(0),
              "packed: bfloat16 [ceil(n/16), K/32, 16, 16, 2]");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous() && out.numel() == x.size(0), "out: int64 [M]");
#if defined(PAGELLM_AMX)
  const int64_t M = x.size(0), T = at::get_num_threads();
  std::vector<Best> best(static_cast<size_t>(T * M));
  run(Gemm{x.data_ptr<bf16>(), x.stride(0), M, packed.data_ptr<bf16>(), packed.size(1), n, 0, nullptr, nullptr, 0, 0,
           best.data()});
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    Best r;
    for (int64_t t = 0; t < T; ++t)
      if (best[t * M + m].i != std::numeric_limits<int64_t>::max()) r.offer(best[t * M + m].v, best[t * M + m].i);
    o[m] = r.i;
  }
#endif
}

bool amx_q4_linear_supported() {
#if defined(PAGELLM_AMX_Q4)
  return request_amx();
#else
  return false;
#endif
}

// amx_linear (silu_mul: amx_linear_silu_mul, out [M, N / 2]) with w [N, K] as nibbles and scales (amx_q4_panels.h:
// q4 uint8 [ceil(N/16), K/32, 16, 16], scales fp32 [ceil(N/16), K/32, 2, 16]): the same bits as those on the bf16
// weight the loader dequantizes, reading 6 bits a weight instead of 16. Decode-sized calls: every call runs
// column-major, each block's panels rebuilt once per 256-row chunk.
void amx_q4_linear(const at::Tensor& x, const at::Tensor& q4, const at::Tensor& scales,
                   const c10::optional<at::Tensor>& bias, at::Tensor out, bool silu_mul) {
  TORCH_CHECK(amx_q4_linear_supported(), "amx_q4_linear needs AMX-BF16 and AVX512-BF16");
  TORCH_CHECK(out.dim() == 2 && (!silu_mul || out.size(1) % 16 == 0),
              "amx_q4_linear: out [M, N]; the intermediate size (", out.dim() == 2 ? out.size(1) : -1,
              ") must be a multiple of 16");
  const int64_t n = silu_mul ? 2 * out.size(1) : out.size(1);
  check_tile_rows(x, bias, out, n, q4.dim() > 0 ? q4.size(0) : 0, "q4");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16, "x, out: bfloat16");
  TORCH_CHECK(q4.dim() == 4 && q4.is_contiguous() && q4.scalar_type() == at::kByte && q4.size(2) == 16 &&
              q4.size(3) == 16 && q4.size(1) * 32 == x.size(1), "q4: uint8 [N/16, K/32, 16, 16]");
  TORCH_CHECK(scales.dim() == 4 && scales.is_contiguous() && scales.scalar_type() == at::kFloat &&
              scales.size(0) == q4.size(0) && scales.size(1) == q4.size(1) && scales.size(2) == 2 &&
              scales.size(3) == 16, "scales: float32 [N/16, K/32, 2, 16]");
#if defined(PAGELLM_AMX_Q4)
  const bool has_bias = bias.has_value() && bias->defined();
  Gemm g{x.data_ptr<bf16>(), x.stride(0), x.size(0), nullptr, q4.size(1), out.size(1), silu_mul ? out.size(1) / 16 : 0,
         has_bias ? bias->data_ptr<bf16>() : nullptr, out.data_ptr<bf16>(), out.stride(0), 0};
  g.q4 = q4.data_ptr<uint8_t>(), g.q4_scales = scales.data_ptr<float>();
  run(g);
#endif
}

TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("amx_q4_linear(Tensor x, Tensor q4, Tensor scales, Tensor? bias, Tensor(a!) out, bool silu_mul) -> ()");
  m.impl("amx_q4_linear", c10::DispatchKey::CPU, &amx_q4_linear);
  m.def("amx_q4_linear_supported() -> bool", [] { return amx_q4_linear_supported(); });
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias, Tensor(a!) out) -> ()");
  m.impl("amx_linear", c10::DispatchKey::CPU, &amx_linear);
  m.def("amx_linear_silu_mul(Tensor x, Tensor packed, Tensor? bias, Tensor(a!) out) -> ()");
  m.impl("amx_linear_silu_mul", c10::DispatchKey::CPU, &amx_linear_silu_mul);
  m.def("amx_linear_argmax(Tensor x, Tensor packed, int n, Tensor(a!) out) -> ()");
  m.impl("amx_linear_argmax", c10::DispatchKey::CPU, &amx_linear_argmax);
  m.def("amx_linear_supported() -> bool", [] { return amx_linear_supported(); });
}
