// The task structure of the CPU paged-attention kernel (paged_attention_cpu.cpp): the call's arguments, a task
// (request, kv heads, up to 16 query rows), the key span it reads and its causal softmax. Shared by the kernel's
// fp32-sum path and its fp16-sum path (attention_fp16.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "attention_common.h"

namespace pagellm::paged {

constexpr int64_t kTileRows = 16;

struct Args {
  int64_t H, Hkv, G, D, B, MB;
  int64_t q_s0, q_s1, o_s0, o_s1, k_sb, k_sh, v_sb, v_sh;  // strides in elements
  const int64_t *bt, *seq, *qs;
  float scale;
  int64_t window;
  bool dot = false;  // bf16 q and cache: scores and weighted sums by VDPBF16PS (kDot: score_tile, pv_pair_dot)
  const int64_t* kv_start;  // per request, or null: keys before it are left out (cascade attention's suffix part)
  float* lse;               // [T, H] log-sum-exp of each row's scores, or null
  int64_t lse_s0;
};

// First key a row at position p of request r attends to: its window's start, or the request's kv_start.
inline int64_t key_lo(const Args& a, int64_t r, int64_t p) {
  const int64_t lo = a.window > 0 ? std::max<int64_t>(0, p - a.window + 1) : 0;
  return a.kv_start ? std::max(lo, a.kv_start[r]) : lo;
}

struct Task {
  int64_t r, h, i0, nrows;  // request, first kv head, first query row (relative to the request), rows
  int64_t cost;
  int64_t nh = 1;           // kv heads h .. h + nh - 1
};

// The part of task t for its j-th kv head alone.
inline Task one_head(const Task& t, int64_t j) {
  Task th = t;
  th.h = t.h + j, th.nh = 1;
  return th;
}

// Query vectors per pass of the value loop (their accumulators, NV x C registers, stay in registers); C = D / 16.
constexpr int values_per_pass(int64_t C) { return C >= 8 ? (C >= 16 ? 1 : 2) : 4; }

// Query vectors of a task: v = i * G + g for row i, head g. Keys [klo, khi) cover every row's window; row i at
// position p_i attends to [row_lo(i), p_i].
struct Span {
  int64_t p0, klo, khi, b0, b1, ns;
};

inline Span span_of(const Args& a, const Task& t) {
  Span s;
  const int64_t L = a.seq[t.r], qlen = a.qs[t.r + 1] - a.qs[t.r];
  s.p0 = L - qlen + t.i0;
  s.khi = s.p0 + t.nrows;
  s.klo = key_lo(a, t.r, s.p0);
  s.b0 = s.klo / a.B;
  s.b1 = (s.khi - 1) / a.B;
  s.ns = (s.b1 - s.b0 + 1) * a.B;  // scores are indexed by token - b0 * B
  return s;
}

// Causal softmax of each vector's row of scores over its own key range; zero elsewhere in [klo, khi).
inline void softmax_rows(const Args& a, const Task& t, const Span& s, float* S) {
  const int64_t base = s.b0 * a.B;
  for (int64_t i = 0; i < t.nrows; ++i) {
    const int64_t p = s.p0 + i, lo = key_lo(a, t.r, p);
    for (int64_t g = 0; g < a.G; ++g) {
      float* row = S + (i * a.G + g) * s.ns - base;  // row[token]
      const float lse = softmax_range(row, lo, p + 1);
      if (a.lse) a.lse[(a.qs[t.r] + t.i0 + i) * a.lse_s0 + t.h * a.G + g] = lse;
      std::fill(row + s.klo, row + lo, 0.f);
      std::fill(row + p + 1, row + s.khi, 0.f);
    }
  }
}

// The blocks of the requests with want[r], as a list for a per-call copy of them: table [R, MB] maps each
// request's block b to its index in the list (the copy's block table); returns (request, b) per index.
inline std::vector<std::pair<int64_t, int64_t>> staged_blocks(const Args& a, const std::vector<char>& want,
                                                              std::vector<int64_t>& table) {
  const int64_t R = static_cast<int64_t>(want.size());
  std::vector<std::pair<int64_t, int64_t>> blocks;
  table.assign(R * a.MB, 0);
  for (int64_t r = 0; r < R; ++r)
    if (want[r])
      for (int64_t b = 0; b * a.B < a.seq[r]; ++b) {
        table[r * a.MB + b] = static_cast<int64_t>(blocks.size());
        blocks.emplace_back(r, b);
      }
  return blocks;
}

}  // namespace pagellm::paged
