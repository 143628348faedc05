// Throughput of fp16 FMAs (AVX512-FP16) by how the broadcast operand arrives, one thread: why the fp16 kernels
// (layers/csrc/attention_fp16.h, fma_linear_cpu.cpp) broadcast 32-bit pairs or embed the broadcast, never
// vpbroadcastw.
//   g++ -O2 -march=native bench/fma_broadcast.cpp -o /tmp/fma_broadcast && taskset -c 0 /tmp/fma_broadcast
// On the project's AMX-less VM (2026-12-02, both cores): registers 5.5-5.7; an embedded {1to32} broadcast 5.3-5.7;
// vpbroadcastd per 2 FMAs 5.0-5.7; a vector load and a vpbroadcastd per 4 FMAs 4.9-5.8; vpbroadcastw per 2 FMAs
// 3.4-3.6 (it is a load and a shuffle, and the shuffle takes a port the FMAs need). 5.6 G/s is 2 FMAs a cycle.
// Each loop keeps 16 independent accumulators in registers; figures are G FMA instructions per second. Every FMA
// is an asm statement: written as intrinsics, the compiler merges accumulators that see the same updates (a first
// version of this file timed 1, 8 and 4 FMAs per iteration where it counted 16).
#include <immintrin.h>

#include <chrono>
#include <cstdio>

alignas(64) static _Float16 mem[4096];

#define ACCS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)

template <int MODE>
double run(long iters) {
#define DECL(j) __m512h a##j = _mm512_setzero_ph();
  ACCS(DECL)
  const __m512h k = _mm512_set1_ph(static_cast<_Float16>(0.001f));
#define FMA(acc, x, y) asm volatile("vfmadd231ph %2, %1, %0" : "+v"(acc) : "v"(x), "v"(y))
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < iters; ++i) {
    const _Float16* q = mem + (i & 63) * 16;
    if constexpr (MODE == 0) {  // register operands only
#define REG(j) FMA(a##j, k, k);
      ACCS(REG)
    } else if constexpr (MODE == 1) {  // a 16-bit embedded broadcast per FMA ({1to32})
#define EMB(j) asm volatile("vfmadd231ph %c2(%1)%{1to32%}, %3, %0" : "+v"(a##j) : "r"(q), "i"(2 * j), "v"(k));
      ACCS(EMB)
    } else if constexpr (MODE == 2 || MODE == 3) {  // vpbroadcastw / vpbroadcastd from memory, one per 2 FMAs
#define BC(j, x, y)                                                                        \
  {                                                                                        \
    __m512h b;                                                                             \
    if constexpr (MODE == 2) asm volatile("vpbroadcastw %c1(%2), %0" : "=v"(b) : "i"(2 * j), "r"(q)); \
    else asm volatile("vpbroadcastd %c1(%2), %0" : "=v"(b) : "i"(4 * j), "r"(q));         \
    FMA(x, b, k);                                                                          \
    FMA(y, b, k);                                                                          \
  }
      BC(0, a0, a1) BC(1, a2, a3) BC(2, a4, a5) BC(3, a6, a7) BC(4, a8, a9) BC(5, a10, a11) BC(6, a12, a13)
      BC(7, a14, a15)
    } else {  // a vector load and a vpbroadcastd per 4 FMAs, as the kernel's score and value loops
#define LB(j, w, x, y, z)                                                             \
  {                                                                                   \
    __m512h v, b;                                                                     \
    asm volatile("vmovdqu16 %c1(%2), %0" : "=v"(v) : "i"(64 * j), "r"(q));            \
    asm volatile("vpbroadcastd %c1(%2), %0" : "=v"(b) : "i"(4 * j), "r"(q));          \
    FMA(w, b, v); FMA(x, b, v);                                                       \
    FMA(y, b, v); FMA(z, b, v);                                                       \
  }
      LB(0, a0, a1, a2, a3) LB(1, a4, a5, a6, a7) LB(2, a8, a9, a10, a11) LB(3, a12, a13, a14, a15)
    }
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
#define SUM(j) t = _mm512_add_ph(t, a##j);
  __m512h t = _mm512_setzero_ph();
  ACCS(SUM)
  volatile float sink = static_cast<float>(_mm512_reduce_add_ph(t));
  (void)sink;
  return iters * 16 / s / 1e9;
}

int main() {
  const long n = 200000000;
  for (int r = 0; r < 3; ++r)
    std::printf("registers %.2f  16-bit embedded %.2f  vpbroadcastw %.2f  vpbroadcastd %.2f  "
                "load + vpbroadcastd per 4 FMAs %.2f  (G FMA/s)\n",
                run<0>(n), run<1>(n), run<2>(n), run<3>(n), run<4>(n));
}
