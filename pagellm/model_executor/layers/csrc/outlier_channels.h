// The outlier channels of the int8 linears (vnni_int8_linear_cpu.cpp, gguf_int8_linear_cpu.cpp): a few input
// channels of x kept out of its int8 values and taken exactly, chosen once per weight on its first call.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace pagellm {

// chan[0, P): the P channels of largest |x| over x's M rows (K values each, rows ldx apart; NaN counting as
// infinite, ties to the lower index), ascending. Once per weight, so plain scalar code.
inline void choose_outlier_channels(const c10::BFloat16* x, int64_t ldx, int64_t M, int64_t K, int64_t P,
                                    int32_t* chan) {
  std::vector<float> top(K, 0.f);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t k = 0; k < K; ++k) {
      const float v = static_cast<float>(x[r * ldx + k]);
      top[k] = std::max(top[k], std::isnan(v) ? std::numeric_limits<float>::infinity() : std::fabs(v));
    }
  std::vector<int32_t> order(K);
  for (int64_t k = 0; k < K; ++k) order[k] = static_cast<int32_t>(k);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return top[a] > top[b]; });
  std::sort(order.begin(), order.begin() + P);
  std::copy(order.begin(), order.begin() + P, chan);
}

}  // namespace pagellm
