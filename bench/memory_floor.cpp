// The machine's memory floor, for judging how close a decode step is to it (docs/performance-log.md, "The decode
// step against the memory floor"). Prints:
//   1. read bandwidth on 1 and 2 threads: sequential, and in chunks of 4 / 12 / 64 KiB taken in random order (a
//      paged KV cache read per (block, kv head) is the 4 KiB case with 32-token bf16 blocks and head_dim 64),
//      with and without software prefetch of the next chunk;
//   2. AMX tile loads (16 rows x 64 bytes) by where the data lies (L1 / L2 / L3 / memory), alone and feeding the
//      2 x 2 block of tile multiplies that the AMX linear kernel runs.
// Build and run (Linux; part 2 needs a CPU with AMX-BF16; about a minute):
//   g++ -O2 -march=native -fopenmp bench/memory_floor.cpp -o /tmp/memory_floor && /tmp/memory_floor
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <random>
#include <vector>

namespace {

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// GB/s reading `order` chunks of `chunk` bytes from buf on `threads` threads; prefetch: the next chunk's lines.
double read_rate(const char* buf, const std::vector<int64_t>& order, int64_t chunk, bool prefetch, int threads) {
  const auto t0 = std::chrono::steady_clock::now();
  float total = 0.f;
  const int64_t n = static_cast<int64_t>(order.size());
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
    const int tid = omp_get_thread_num();
    const int64_t lo = n * tid / threads, hi = n * (tid + 1) / threads;
    for (int64_t i = lo; i < hi; ++i) {
      const char* p = buf + order[i] * chunk;
      if (prefetch && i + 1 < hi)
        for (int64_t o = 0; o < chunk; o += 64) _mm_prefetch(buf + order[i + 1] * chunk + o, _MM_HINT_T0);
      for (int64_t o = 0; o < chunk; o += 128) {
        a = _mm512_add_ps(a, _mm512_load_ps(reinterpret_cast<const float*>(p + o)));
        b = _mm512_add_ps(b, _mm512_load_ps(reinterpret_cast<const float*>(p + o + 64)));
      }
    }
    total += _mm512_reduce_add_ps(_mm512_add_ps(a, b));
  }
  const double s = seconds_since(t0);
  volatile float sink = total;
  (void)sink;
  return static_cast<double>(n) * chunk / s / 1e9;
}

void memory_reads() {
  const int64_t size = int64_t(1) << 30;  // 1 GiB: far past any cache share
  char* buf = static_cast<char*>(std::aligned_alloc(4096, size));
  std::memset(buf, 1, size);
  std::mt19937 rng(1);
  std::printf("reads from a 1 GiB buffer, GB/s (threads 1 / 2):\n");
  for (int64_t chunk : {int64_t(4096), int64_t(12288), int64_t(65536)}) {
    const int64_t n = size / chunk;
    std::vector<int64_t> seq(n), rnd(n);
    for (int64_t i = 0; i < n; ++i) seq[i] = rnd[i] = i;
    std::shuffle(rnd.begin(), rnd.end(), rng);
    if (chunk == 4096)
      std::printf("  sequential                         %5.1f / %5.1f\n", read_rate(buf, seq, chunk, false, 1),
                  read_rate(buf, seq, chunk, false, 2));
    std::printf("  %3lld KiB chunks, random order       %5.1f / %5.1f   prefetching the next: %5.1f / %5.1f\n",
                static_cast<long long>(chunk / 1024), read_rate(buf, rnd, chunk, false, 1),
                read_rate(buf, rnd, chunk, false, 2), read_rate(buf, rnd, chunk, true, 1),
                read_rate(buf, rnd, chunk, true, 2));
  }
  std::free(buf);
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void tile_loads() {
#if !defined(__AMX_TILE__) || !defined(__AMX_BF16__)
  std::printf("AMX: not available (-march=native on a CPU without AMX-BF16)\n");
#else
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) {
    std::printf("AMX: not available\n");
    return;
  }
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) cfg.rows[i] = 16, cfg.colsb[i] = 64;
  _tile_loadconfig(&cfg);
  std::printf("AMX tile loads (1 KiB each) cycling through a buffer, one thread:\n");
  for (int64_t kib : {int64_t(32), int64_t(256), int64_t(1024), int64_t(8192), int64_t(65536)}) {
    const int64_t bytes = kib * 1024, tiles = bytes / 1024, reps = 400000000 / bytes + 1;
    char* buf = static_cast<char*>(std::aligned_alloc(4096, bytes));
    std::memset(buf, 0, bytes);
    auto t = std::chrono::steady_clock::now();
    for (int64_t r = 0; r < reps; ++r)
      for (int64_t i = 0; i + 4 <= tiles; i += 4) {
        _tile_loadd(4, buf + i * 1024, 64);
        _tile_loadd(5, buf + (i + 1) * 1024, 64);
        _tile_loadd(6, buf + (i + 2) * 1024, 64);
        _tile_loadd(7, buf + (i + 3) * 1024, 64);
      }
    const double load_ns = seconds_since(t) / (reps * static_cast<double>(tiles)) * 1e9;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    t = std::chrono::steady_clock::now();
    for (int64_t r = 0; r < reps; ++r)
      for (int64_t i = 0; i + 4 <= tiles; i += 4) {  // the AMX linear kernel's 2 x 2 block: 4 loads, 4 multiplies
        _tile_loadd(4, buf + i * 1024, 64);
        _tile_loadd(6, buf + (i + 2) * 1024, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, buf + (i + 3) * 1024, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, buf + (i + 1) * 1024, 64);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    const double tdp_ns = seconds_since(t) / (reps * static_cast<double>(tiles)) * 1e9;
    std::printf("  %6lld KiB: %5.1f ns per load (%5.1f GB/s); 2 x 2 block %5.1f ns per multiply (%.2f TFLOP/s)\n",
                static_cast<long long>(kib), load_ns, 1024 / load_ns, tdp_ns, 16384 / tdp_ns / 1e3);
    std::free(buf);
  }
  _tile_release();
#endif
}

}  // namespace

int main() {
  memory_reads();
  tile_loads();
  return 0;
}
