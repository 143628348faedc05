// y [M, N] = x [M, K] @ w[N, K]^T (+ bias) for a handful of rows (M <= 4: decode with a few requests), bf16.
//
// With so few rows a linear layer is a pass over its weight: the work is to stream w from memory once at full
// bandwidth. oneDNN's path for this shape re-blocks and runs AMX tiles that are mostly empty; here each thread
// walks its share of w's rows in order, 4 rows at a time, with AVX512-BF16 dot products (bf16 pairs multiplied
// exactly, accumulated in fp32) against the M activation rows, which stay in L1.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec.h"

namespace {
using namespace pagellm;

#if defined(__AVX512BF16__)
constexpr int kRowsPerStep = 4;

inline __m512bh load_bf16(const c10::BFloat16* p, __mmask32 m) {
  return reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(m, p));
}

// Output columns [n0, n1) for all M rows of x.
template <int M>
void gemv_block(const c10::BFloat16* x, int64_t xs, const c10::BFloat16* w, int64_t ws, int64_t K, int64_t n0,
                int64_t n1, const c10::BFloat16* bias, c10::BFloat16* y, int64_t ys) {
  for (int64_t n = n0; n < n1; n += kRowsPerStep) {
    const int nr = static_cast<int>(std::min<int64_t>(kRowsPerStep, n1 - n));
    __m512 acc[M][kRowsPerStep];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < kRowsPerStep; ++r) acc[m][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      if (n + 2 * kRowsPerStep <= n1)  // the rows after next: keep several streams in flight
        for (int r = 0; r < kRowsPerStep; ++r) _mm_prefetch(w + (n + 2 * kRowsPerStep + r) * ws + k, _MM_HINT_T0);
      const __mmask32 mk = K - k >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1ull << (K - k)) - 1);
      __m512bh wv[kRowsPerStep];
      for (int r = 0; r < kRowsPerStep; ++r)
        wv[r] = r < nr ? load_bf16(w + (n + r) * ws + k, mk) : reinterpret_cast<__m512bh>(_mm512_setzero_si512());
      for (int m = 0; m < M; ++m) {
        const __m512bh xv = load_bf16(x + m * xs + k, mk);
        for (int r = 0; r < kRowsPerStep; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < nr; ++r) {
        float v = _mm512_reduce_add_ps(acc[m][r]);
        if (bias) v += to_float(bias[n + r]);
        y[m * ys + n + r] = static_cast<c10::BFloat16>(v);
      }
  }
}
#endif

}  // namespace

bool small_m_linear_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

void small_m_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, at::Tensor out) {
  TORCH_CHECK(small_m_linear_supported(), "small_m_linear needs AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2 && x.size(1) == w.size(1) && out.size(0) == x.size(0) &&
              out.size(1) == w.size(0), "x [M, K], w [N, K], out [M, N]");
  TORCH_CHECK(x.stride(1) == 1 && w.stride(1) == 1 && out.stride(1) == 1, "rows must be contiguous");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 &&
              out.scalar_type() == at::kBFloat16, "bfloat16 only");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 4, "1 to 4 rows");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) TORCH_CHECK(bias->is_contiguous() && bias->numel() == w.size(0) &&
                            bias->scalar_type() == at::kBFloat16, "bias: bfloat16 [N]");
#if defined(__AVX512BF16__)
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* wp = w.data_ptr<c10::BFloat16>();
  const auto* bp = has_bias ? bias->data_ptr<c10::BFloat16>() : nullptr;
  auto* yp = out.data_ptr<c10::BFloat16>();
  const int64_t groups = (N + kRowsPerStep - 1) / kRowsPerStep;
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    const int64_t n0 = g0 * kRowsPerStep, n1 = std::min(N, g1 * kRowsPerStep);
    switch (M) {
      case 1: return gemv_block<1>(xp, x.stride(0), wp, w.stride(0), K, n0, n1, bp, yp, out.stride(0));
      case 2: return gemv_block<2>(xp, x.stride(0), wp, w.stride(0), K, n0, n1, bp, yp, out.stride(0));
      case 3: return gemv_block<3>(xp, x.stride(0), wp, w.stride(0), K, n0, n1, bp, yp, out.stride(0));
      default: return gemv_block<4>(xp, x.stride(0), wp, w.stride(0), K, n0, n1, bp, yp, out.stride(0));
    }
  });
#endif
}

TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("small_m_linear(Tensor x, Tensor w, Tensor? bias, Tensor(a!) out) -> ()");
  m.impl("small_m_linear", c10::DispatchKey::CPU, &small_m_linear);
  m.def("small_m_linear_supported() -> bool", [] { return small_m_linear_supported(); });
}
