// Paged decode attention for CPU: one query token per request, K/V read in place from the block pool.
//
// q            [R, H, D]            (any float dtype; rows may be strided)
// k/v cache    [NB, B, Hkv, D]      (same dtype as q)
// block_tables [R, MB] int64,  seq_lens [R] int64  (context length including the current token)
// out          [R, H, D]
//
// Work is split over (request, kv head) pairs; each pair reads its keys/values exactly once and serves the G
// query heads that share that kv head (GQA). Two passes over the context: scores (q.k, fp32), softmax, then
// the weighted sum of values. No gathered copy of the cache is ever made.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(double x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline void row_to_float(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

template <typename T>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& out, double scale,
            int64_t window) {
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t B = k_cache.size(1), Hkv = k_cache.size(2), MB = block_tables.size(1);
  const int64_t G = H / Hkv;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  const int64_t q_sr = q.stride(0), q_sh = q.stride(1);
  const int64_t o_sr = out.stride(0), o_sh = out.stride(1);
  const int64_t c_sb = k_cache.stride(0), c_st = k_cache.stride(1), c_sh = k_cache.stride(2);
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, R * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), row(D), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / Hkv, h = task % Hkv;
      const int64_t L = sl[r];
      const int64_t start = window > 0 ? std::max<int64_t>(0, L - window) : 0;
      const int64_t n = L - start;
      scores.resize(G * n);
      for (int64_t g = 0; g < G; ++g) {
        row_to_float(qp + r * q_sr + (h * G + g) * q_sh, qf.data() + g * D, D);
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] *= fscale;
      }
      // Pass 1: scores[g][i] = q_g . k_i
      for (int64_t i = 0; i < n; ++i) {
        const int64_t pos = start + i;
        const T* kr = kp + bt[r * MB + pos / B] * c_sb + (pos % B) * c_st + h * c_sh;
        row_to_float(kr, row.data(), D);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qg[d] * row[d];
          scores[g * n + i] = s;
        }
      }
      // Softmax per query head.
      std::vector<float> inv_sum(G);
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * n;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < n; ++i) m = std::max(m, sg[i]);
        float sum = 0.f;
        for (int64_t i = 0; i < n; ++i) {
          sg[i] = std::exp(sg[i] - m);
          sum += sg[i];
        }
        inv_sum[g] = 1.f / sum;
      }
      // Pass 2: acc_g = sum_i p_gi v_i
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t pos = start + i;
        const T* vr = vp + bt[r * MB + pos / B] * c_sb + (pos % B) * c_st + h * c_sh;
        row_to_float(vr, row.data(), D);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * n + i];
          float* ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += p * row[d];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        T* o = op + r * o_sr + (h * G + g) * o_sh;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[g * D + d] * inv_sum[g]);
      }
    }
  });
}

}  // namespace

void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& out,
                            double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1, "last dim must be contiguous");
  TORCH_CHECK(k_cache.strides() == v_cache.strides(), "k and v caches must share strides");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 indices");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous(), "contiguous indices");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "heads must be a multiple of kv heads");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode<scalar_t>(q, k_cache, v_cache, block_tables, seq_lens, out, scale, window);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU)");
}
