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

// The first blocks (keys, then values, each of the task's kv heads) of the task a thread runs next, brought into L2 a
// few lines at a time while the thread's current task runs its softmax and value pass, on data already in the caches
// (decode rows on VDPBF16PS take ReadAhead below instead). Without it a decode step's attention did its memory reads
// and its arithmetic one after the other: 64 decode rows x 30 layers over 362-token contexts took about the time of a
// sum over the cache plus that of the same kernel on blocks held in L2. With it (Zen 4, 2026-12-04, alternating in one
// process, 10 rounds, medians): 25.7-27.3 against 28.7-29.2 ms, blocks in order or shuffled (32 to 192 KiB ahead
// alike); workload_64, 3 alternating process pairs: 20.8 / 21.7 / 20.9 against 21.7 / 21.0 / 21.8 s. What is left is
// the reads' own pattern: the kernel's loads alone, without its arithmetic, take about as long (and 2 MiB pages, or 64-
// and 128-token blocks, did not change it measurably end to end).
struct NextBlocks {
  static constexpr int64_t kBytes = 96 * 1024;  // about what the memory delivers to a core during one value pass
  static constexpr int kMaxRegions = 64;
  const char* at[kMaxRegions];
  int64_t regions = 0, lines = 0, next = 0;  // lines: per region
  const Task* task = nullptr;          // the next task
  struct ReadAhead* stream = nullptr;  // a decode task's read-ahead (the thread's), which replaces issue() there

  // q (optional): the queries, whose rows of the next task are prefetched at once (their loads at a task's start
  // missed: half of the samples of a prefill task's set-up, the scores' queries copied out)
  template <typename KV, typename T = KV>
  NextBlocks(const Args& a, const Task* t, const KV* kc, const KV* vc, const T* q = nullptr) {
    task = t;
    if (!t) return;
    if (q) {
      const int64_t bytes = ((t->nh * a.G - 1) * a.q_s1 + a.D) * static_cast<int64_t>(sizeof(T));  // a row's heads
      for (int64_t i = 0; i < t->nrows; ++i) {
        const char* row = reinterpret_cast<const char*>(q + (a.qs[t->r] + t->i0 + i) * a.q_s0 + t->h * a.G * a.q_s1);
        for (int64_t l = 0; l < bytes; l += 64) __builtin_prefetch(row + l, 0, 2);
        __builtin_prefetch(row + bytes - 1, 0, 2);  // the last line, where the row starts mid-line
      }
    }
    const Span s = span_of(a, *t);
    lines = (a.B * a.D * static_cast<int64_t>(sizeof(KV)) + 63) / 64;
    for (int64_t b = s.b0; b <= s.b1; ++b)
      for (int64_t h = t->h; h < t->h + t->nh; ++h) {
        if (regions + 2 > kMaxRegions || (regions + 2) * lines * 64 > kBytes) return;
        const int64_t blk = a.bt[t->r * a.MB + b];
        at[regions++] = reinterpret_cast<const char*>(kc + blk * a.k_sb + h * a.k_sh);
        at[regions++] = reinterpret_cast<const char*>(vc + blk * a.v_sb + h * a.v_sh);
      }
  }
  int64_t total() const { return regions * lines; }
  // The next n lines (into L2: prefetcht1 on x86).
  void issue(int64_t n) {
    for (const int64_t end = std::min(total(), next + n); next < end; ++next)
      __builtin_prefetch(at[next / lines] + (next % lines) * 64, 0, 2);
  }
};

// A decode task's read-ahead: the (block, kv head) regions of keys and values a thread reads, in the order it reads
// them (the task's keys block by block, its values head by head, then its next task's), brought into L2 a fixed
// distance ahead of the reads, as they go: take() hands the attention loops the region to prefetch alongside the
// one they read (score_block32's pk, pv_block's pf), so the memory streams at one steady rate through both passes
// and across tasks. It replaced, for decode rows, the next block's keys and this block's values prefetched during
// the scores and the next task's first blocks during the value pass (NextBlocks::issue), whose bursts stalled the
// core: the prefetches themselves held ~13% of the kernel's samples, the value pass's loads most of the rest of
// its stalls. Zen 4 (2026-12-06), decode steps' attention, 30 layers, two threads, alternating in one process, 15
// rounds, min / median: 64 rows over 362-token contexts 22.1 / 23.2 against 23.4 / 24.6 ms (10 prompt blocks each,
// then decode blocks interleaved as the engine hands them out; shuffled blocks 22.5 / 23.3 against 23.6 / 24.2);
// 8 rows over 2,000 tokens 14.4 / 15.0 against 17.1 / 17.9 ms, 2 over 8,000 15.8 / 16.7 against 18.2 / 19.3 ms.
// The outputs are the same bits. 16 KiB ahead did about as well as 32 and 64 KiB.
struct ReadAhead {
  static constexpr int64_t kBytes = 32 * 1024;
  std::vector<const char*> regions;
  int64_t own = 0, pos = 0;         // the task's regions; the next one to prefetch
  int64_t carried = 0;              // regions of `expected` prefetched by the task before it
  const Task* expected = nullptr;   // the thread's next task, as the last task saw it

  template <typename KV>
  void add(const Args& a, const Task& t, const KV* kc, const KV* vc) {
    const Span s = span_of(a, t);
    for (int64_t b = s.b0; b <= s.b1; ++b)
      for (int64_t h = t.h; h < t.h + t.nh; ++h)
        regions.push_back(reinterpret_cast<const char*>(kc + a.bt[t.r * a.MB + b] * a.k_sb + h * a.k_sh));
    for (int64_t h = t.h; h < t.h + t.nh; ++h)
      for (int64_t b = s.b0; b <= s.b1; ++b)
        regions.push_back(reinterpret_cast<const char*>(vc + a.bt[t.r * a.MB + b] * a.v_sb + h * a.v_sh));
  }
  // At task t's start: its regions and those of the thread's next task; those the task before did not prefetch
  // up to the distance go now.
  template <typename KV>
  void begin(const Args& a, const Task& t, const Task* next, const KV* kc, const KV* vc) {
    regions.clear();
    add(a, t, kc, vc);
    own = static_cast<int64_t>(regions.size());
    if (next) add(a, *next, kc, vc);
    const int64_t bytes = a.B * a.D * static_cast<int64_t>(sizeof(KV));
    const int64_t ahead = std::min<int64_t>(std::max<int64_t>(1, kBytes / bytes), regions.size());
    for (int64_t i = &t == expected ? carried : 0; i < ahead; ++i)
      for (int64_t l = 0; l < bytes; l += 64) __builtin_prefetch(regions[i] + l, 0, 2);
    pos = ahead;
    expected = next;
  }
  const char* take() { return pos < static_cast<int64_t>(regions.size()) ? regions[pos++] : nullptr; }
  void end() { carried = std::max<int64_t>(0, pos - own); }
};

// Causal softmax of each vector's row of scores over its own key range, in place; zero elsewhere in [klo, khi). P16
// (kDot): instead the weights exp(s - max) rounded to bf16 (exp_range_bf16), zero elsewhere in [klo, khi), in rows of
// ns values like S's, and inv[v] = 1 / their row's sum, by which values_for scales vector v's weighted sum. Of S's row
// only the first and the last token of [klo, khi) are then read (pv_block's pairs cut by the span's ends): they get the
// rounded weights as fp32, so a row's bits do not depend on where its chunk ends.
inline void softmax_rows(const Args& a, const Task& t, const Span& s, float* S, uint16_t* P16 = nullptr,
                         float* inv = nullptr) {
  const int64_t base = s.b0 * a.B;
  for (int64_t i = 0; i < t.nrows; ++i) {
    const int64_t p = s.p0 + i, lo = key_lo(a, t.r, p);
    for (int64_t g = 0; g < a.G; ++g) {
      float* row = S + (i * a.G + g) * s.ns - base;  // row[token]
      float* lse = a.lse ? a.lse + (a.qs[t.r] + t.i0 + i) * a.lse_s0 + t.h * a.G + g : nullptr;
      if (P16) {
        uint16_t* row16 = P16 + (i * a.G + g) * s.ns - base;
        inv[i * a.G + g] = 1.f / exp_range_bf16(row, row16, lo, p + 1, lse);
        std::fill(row16 + s.klo, row16 + lo, uint16_t{0});
        std::fill(row16 + p + 1, row16 + s.khi, uint16_t{0});
        for (const int64_t end : {s.klo, s.khi - 1})
          row[end] = to_float(c10::BFloat16(row16[end], c10::BFloat16::from_bits()));
        continue;
      }
      softmax_range(row, lo, p + 1, lse);
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
