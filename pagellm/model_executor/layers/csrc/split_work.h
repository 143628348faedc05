// Work split for kernels whose threads may run at different speeds: items taken one at a time, largest first
// (run_largest_first: attention tasks of very different sizes), or runs of neighbouring items claimed from both
// ends (claim_from_both_ends: the linears' column blocks).
//
// On a shared machine the cores do not keep one speed: on the project's 2-core VM one core measured 0.6-1.5x the
// other's time on the same linears, pinned one thread to each in turn, the ratio changing within seconds (the
// host's other load, presumably). A static split (at::parallel_for's equal ranges, oneDNN's) then waits for the
// slow core while the fast one spins (libgomp's spin-wait: 8.5% of a decode step's perf samples).
// claim_from_both_ends hands out [0, n) in shrinking claims instead: even threads take from the front, ascending,
// odd threads from the back, descending, each claim about a 2T-th of what is left (but at least min_claim), so
// a fast thread ends up with more, a handful of atomic operations per call, and each thread still walks
// neighbouring items in order (what lets a kernel prefetch its next item).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace pagellm {

// Runs the tasks on all threads, largest cost first, each thread taking the next from a shared counter (tasks of
// one step differ a lot in size). thread_loop(next) is one thread's loop: it calls next() until that returns null;
// its per-thread set-up and scratch go around the loop. next(true) claims a task ahead, while the thread still
// runs one (to prefetch its data): null, without claiming, once fewer tasks are left than threads, so the last
// ones still go to whichever thread is free first.
template <typename Task, typename ThreadLoop>
void run_largest_first(std::vector<Task>& tasks, ThreadLoop&& thread_loop) {
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& x, const Task& y) { return x.cost > y.cost; });
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(tasks.size());
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    thread_loop([&](bool ahead = false) -> const Task* {
      if (ahead && next.load(std::memory_order_relaxed) + threads > n) return nullptr;
      const int64_t i = next++;
      return i < n ? &tasks[i] : nullptr;
    });
  });
}

// body(lo, hi, ascending) runs items [lo, hi) in the given direction; body is called from several threads.
template <typename Body>
void claim_from_both_ends(int64_t n, int64_t min_claim, Body&& body) {
  if (n <= 0) return;
  const int64_t T = std::min<int64_t>(at::get_num_threads(), (n + min_claim - 1) / min_claim);
  if (T <= 1 || at::in_parallel_region()) {
    body(int64_t{0}, n, true);
    return;
  }
  // Claimed counts from the front (low 32 bits) and from the back (high 32 bits) in one word, so one atomic add
  // both claims and sees every claim before it: a claim clamped to what the other end has not taken never
  // overlaps it (the counts may run past n; what lies past the other end's claims is not handed out).
  std::atomic<int64_t> claimed{0};
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t tid = t0; tid < t1; ++tid) {
      const bool front = tid % 2 == 0;
      while (true) {
        const int64_t seen = claimed.load(std::memory_order_relaxed);
        const int64_t left = n - (seen & 0xffffffff) - (seen >> 32);
        if (left <= 0) break;
        const int64_t size = std::max(min_claim, left / (2 * T));
        const int64_t old = claimed.fetch_add(front ? size : size << 32);
        const int64_t f = old & 0xffffffff, b = old >> 32;
        if (front) {
          const int64_t lo = f, hi = std::min(f + size, n - b);
          if (lo >= hi) break;
          body(lo, hi, true);
        } else {
          const int64_t hi = n - b, lo = std::max(n - b - size, f);
          if (lo >= hi) break;
          body(lo, hi, false);
        }
      }
    }
  });
}

}  // namespace pagellm
