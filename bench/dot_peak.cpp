// Peak rates of one core's vector multiply-adds, to judge how near the linear kernels run to the machine: fp32 FMA
// (zmm) and AVX512-BF16's VDPBF16PS (zmm and ymm; each does twice an fp32 FMA's flops per lane). 16 independent
// accumulators; every instruction is an asm statement, so the compiler cannot merge chains.
//   g++ -O2 -march=native bench/dot_peak.cpp -o /tmp/dot_peak && taskset -c 0 /tmp/dot_peak
// Zen 4 (EPYC family 25 model 17, 2026-12-04): VDPBF16PS zmm 3.45-3.57 G/s (221-229 GFLOP/s), ymm 3.5 G/s (half
// the flops), FMA zmm 3.5-3.6 G/s (111-115 GFLOP/s): the dot product retires at the FMA's rate, twice its work.
#include <immintrin.h>

#include <chrono>
#include <cstdio>

#define ACCS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)

int main() {
  const char* names[] = {"vdpbf16ps zmm", "vfmadd231ps zmm", "vdpbf16ps ymm"};
  const double flops[] = {64, 32, 32};  // per instruction
  for (int mode = 0; mode < 3; ++mode) {
    __m512 a = _mm512_set1_ps(1e-3f), b = _mm512_set1_ps(1e-3f);
    __m256 a8 = _mm512_castps512_ps256(a), b8 = _mm512_castps512_ps256(b);
#define DECL(i) __m512 c##i = _mm512_setzero_ps(); __m256 y##i = _mm256_setzero_ps();
    ACCS(DECL)
    const long n = 200000000 / 16;
    const auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < n; ++i) {
      if (mode == 0) {
#define DOT(i) asm volatile("vdpbf16ps %2, %1, %0" : "+v"(c##i) : "v"(a), "v"(b));
        ACCS(DOT)
      } else if (mode == 1) {
#define FMA(i) asm volatile("vfmadd231ps %2, %1, %0" : "+v"(c##i) : "v"(a), "v"(b));
        ACCS(FMA)
      } else {
#define DOTY(i) asm volatile("vdpbf16ps %2, %1, %0" : "+v"(y##i) : "v"(a8), "v"(b8));
        ACCS(DOTY)
      }
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
#define SUM(i) a = _mm512_add_ps(a, _mm512_add_ps(c##i, _mm512_castps256_ps512(y##i)));
    ACCS(SUM)
    volatile float sink = _mm512_reduce_add_ps(a);
    (void)sink;
    const double rate = n * 16 / s / 1e9;
    std::printf("%-16s %.2f G instructions/s  %.0f GFLOP/s\n", names[mode], rate, rate * flops[mode]);
  }
}
