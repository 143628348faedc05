// Fused element-wise ops of the decoder layer for CPU. Each replaces a chain of small torch ops (one pass over
// memory instead of 4-10, no temporaries) and rounds exactly where the HF reference rounds, so in bf16 the
// results equal the unfused torch ops bit for bit (up to the last ulp of exp in silu):
//   rms_norm           out = w * T(x * rsqrt(mean(x^2) + eps))               (statistics in fp32)
//   add_rms_norm       residual = T(x + residual); x = rms_norm(residual)    (in place)
//   silu_and_mul       out = T(T(silu(gate)) * up)  with gate_up = [gate | up]
//   rotary_embedding   q, k = T(T(q * cos) + T(rotate_half(q) * sin)) in place, cos/sin rows by position
//   argmax_rows        greedy sampling straight from the logits in the model's dtype (no fp32 copy)
// Rows are split across threads; each row is read and written once.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "vec.h"
#include "vec8.h"

namespace {
using namespace pagellm;

// Rows per parallel chunk: enough work per task to amortise the thread hand-off.
inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elems, 1)); }

template <typename T>
inline float sum_squares(const T* x, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load16(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  s = _mm512_reduce_add_ps(acc);
#elif defined(PAGELLM_HAS_AVX2)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 v = v8::load8(x + i);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    alignas(32) float part[8];
    _mm256_store_ps(part, acc);
    for (float p : part) s += p;
  }
#endif
  for (; i < n; ++i) s += to_float(x[i]) * to_float(x[i]);
  return s;
}

// out[i] = T(w[i] * T(x[i] * r))
template <typename T>
inline void scale_row(const T* x, const T* w, float r, T* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 vr = _mm512_set1_ps(r);
  for (; i + 16 <= n; i += 16) {
    const __m512 h = round_to(_mm512_mul_ps(load16(x + i), vr), x);
    store16(out + i, _mm512_mul_ps(load16(w + i), h));
  }
#elif defined(PAGELLM_HAS_AVX2)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256 vr = _mm256_set1_ps(r);
    for (; i + 8 <= n; i += 8) {
      const __m256 h = v8::round_bf16(_mm256_mul_ps(v8::load8(x + i), vr));
      v8::store8(out + i, _mm256_mul_ps(v8::load8(w + i), h));
    }
  }
#endif
  for (; i < n; ++i) out[i] = static_cast<T>(to_float(w[i]) * to_float(static_cast<T>(to_float(x[i]) * r)));
}

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, double eps) {
  const int64_t N = x.size(0), H = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, N, grain(H), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const T* xr = xp + i * x.stride(0);
      const float r = 1.f / std::sqrt(sum_squares(xr, H) / H + static_cast<float>(eps));
      scale_row(xr, wp, r, op + i * out.stride(0), H);
    }
  });
}

template <typename T>
void add_rms_norm_impl(at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps) {
  const int64_t N = x.size(0), H = x.size(1);
  T* xp = x.data_ptr<T>();
  T* rp = residual.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  at::parallel_for(0, N, grain(H), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      T* xr = xp + i * x.stride(0);
      T* rr = rp + i * residual.stride(0);
      int64_t j = 0;
#if defined(__AVX512F__)
      for (; j + 16 <= H; j += 16) store16(rr + j, _mm512_add_ps(load16(xr + j), load16(rr + j)));
#elif defined(PAGELLM_HAS_AVX2)
      if constexpr (std::is_same_v<T, c10::BFloat16>)
        for (; j + 8 <= H; j += 8) v8::store8(rr + j, _mm256_add_ps(v8::load8(xr + j), v8::load8(rr + j)));
#endif
      for (; j < H; ++j) rr[j] = static_cast<T>(to_float(xr[j]) + to_float(rr[j]));
      const float r = 1.f / std::sqrt(sum_squares(rr, H) / H + static_cast<float>(eps));
      scale_row(rr, wp, r, xr, H);
    }
  });
}

template <typename T>
void silu_and_mul_impl(const at::Tensor& gu, at::Tensor& out) {
  const int64_t N = gu.size(0), I = gu.size(1) / 2;
  const T* gp = gu.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, N, grain(I), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const T* g = gp + i * gu.stride(0);
      const T* u = g + I;
      T* o = op + i * out.stride(0);
      int64_t j = 0;
#if defined(__AVX512F__)
      for (; j + 16 <= I; j += 16) {
        const __m512 s = round_to(silu16(load16(g + j)), g);
        store16(o + j, _mm512_mul_ps(s, load16(u + j)));
      }
#elif defined(PAGELLM_HAS_AVX2)
      if constexpr (std::is_same_v<T, c10::BFloat16>)  // the AVX2 linear's fused epilogue computes the same
        for (; j + 8 <= I; j += 8)
          v8::store8(o + j, _mm256_mul_ps(v8::round_bf16(v8::silu8(v8::load8(g + j))), v8::load8(u + j)));
#endif
      for (; j < I; ++j) {
        const float x = to_float(g[j]);
        const float s = to_float(static_cast<T>(x / (1.f + std::exp(-x))));
        o[j] = static_cast<T>(s * to_float(u[j]));
      }
    }
  });
}

// x [N, heads, D] rotated in place; cs [N, 2, D] holds cos and sin already rounded to T (as HF's cos.to(dtype)).
// Dims j and half + j are computed together, from both old values, so no copy of the row is needed.
template <typename T>
inline void rotate_row(T* x, const T* cos, const T* sin, int64_t D) {
  const int64_t half = D / 2;
  int64_t j = 0;
#if defined(__AVX512F__)
  if (half % 16 == 0) {
    for (; j < half; j += 16) {
      const __m512 x1 = load16(x + j), x2 = load16(x + half + j);
      const __m512 c1 = load16(cos + j), c2 = load16(cos + half + j);
      const __m512 s1 = load16(sin + j), s2 = load16(sin + half + j);
      // out[j] = x1*c1 + (-x2)*s1 ; out[half+j] = x2*c2 + x1*s2, each product and the sum rounded to T
      const __m512 a1 = round_to(_mm512_mul_ps(x1, c1), x);
      const __m512 b1 = round_to(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), s1), x);
      const __m512 a2 = round_to(_mm512_mul_ps(x2, c2), x), b2 = round_to(_mm512_mul_ps(x1, s2), x);
      store16(x + j, _mm512_add_ps(a1, b1));
      store16(x + half + j, _mm512_add_ps(a2, b2));
    }
    return;
  }
#elif defined(PAGELLM_HAS_AVX2)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // the same roundings, 8 lanes: SmolLM2's q and k at 2,048 rows 0.47-0.62x the scalar loop's time (haswell build)
    for (; half % 8 == 0 && j < half; j += 8) {
      const __m256 x1 = v8::load8(x + j), x2 = v8::load8(x + half + j);
      const __m256 a1 = v8::round_bf16(_mm256_mul_ps(x1, v8::load8(cos + j)));
      const __m256 b1 = v8::round_bf16(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), x2), v8::load8(sin + j)));
      const __m256 a2 = v8::round_bf16(_mm256_mul_ps(x2, v8::load8(cos + half + j)));
      const __m256 b2 = v8::round_bf16(_mm256_mul_ps(x1, v8::load8(sin + half + j)));
      v8::store8(x + j, _mm256_add_ps(a1, b1));
      v8::store8(x + half + j, _mm256_add_ps(a2, b2));
    }
  }
#endif
  for (; j < half; ++j) {
    const float x1 = to_float(x[j]), x2 = to_float(x[half + j]);
    const float a1 = to_float(static_cast<T>(x1 * to_float(cos[j])));
    const float b1 = to_float(static_cast<T>(-x2 * to_float(sin[j])));
    const float a2 = to_float(static_cast<T>(x2 * to_float(cos[half + j])));
    const float b2 = to_float(static_cast<T>(x1 * to_float(sin[half + j])));
    x[j] = static_cast<T>(a1 + b1);
    x[half + j] = static_cast<T>(a2 + b2);
  }
}

template <typename T>
void rotary_impl(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t N = q.size(0), Hq = q.size(1), Hk = k.size(1), D = q.size(2);
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  at::parallel_for(0, N, grain((Hq + Hk) * D), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const T* c = cp + i * cos.stride(0);
      const T* s = sp + i * sin.stride(0);
      for (int64_t h = 0; h < Hq; ++h) rotate_row(qp + i * q.stride(0) + h * q.stride(1), c, s, D);
      for (int64_t h = 0; h < Hk; ++h) rotate_row(kp + i * k.stride(0) + h * k.stride(1), c, s, D);
    }
  });
}

// Index of each row's maximum: the first one on ties, the first NaN if there is one (as torch.argmax).
template <typename T>
void argmax_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t R = x.size(0), V = x.size(1);
  const T* xp = x.data_ptr<T>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* row = xp + r * x.stride(0);
      float best = -std::numeric_limits<float>::infinity();
      int64_t arg = 0, i = 0;
      bool nan = false;
#if defined(__AVX512F__)
      __m512 vbest = _mm512_set1_ps(best);
      __m512i vidx = _mm512_setzero_si512();
      const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      __mmask16 unordered = 0;
      for (; i + 16 <= V; i += 16) {
        const __m512 v = load16(row + i);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, vbest, _CMP_GT_OQ);  // strict: a lane keeps its first maximum
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        vbest = _mm512_mask_mov_ps(vbest, gt, v);
        vidx = _mm512_mask_mov_epi32(vidx, gt, _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(i))));
      }
      nan = unordered != 0;
      alignas(64) float bv[16];
      alignas(64) int32_t bi[16];
      _mm512_store_ps(bv, vbest);
      _mm512_store_si512(bi, vidx);
      for (int l = 0; l < 16; ++l)
        if (bv[l] > best || (bv[l] == best && bi[l] < arg)) best = bv[l], arg = bi[l];
      if (best == -std::numeric_limits<float>::infinity()) arg = 0;  // all -inf so far: the first element
#endif
      for (; i < V; ++i) {
        const float v = to_float(row[i]);
        if (std::isnan(v)) nan = true;
        if (v > best) best = v, arg = i;
      }
      if (nan)
        for (int64_t j = 0; j < V; ++j)
          if (std::isnan(to_float(row[j]))) { arg = j; break; }
      op[r] = arg;
    }
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": expected [N, H] with contiguous rows");
}

}  // namespace

void rms_norm(const at::Tensor& x, const at::Tensor& weight, at::Tensor out, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight: [H] of x's dtype");
  dispatch_float(x.scalar_type(), "rms_norm", [&](auto tag) { rms_norm_impl<decltype(tag)>(x, weight, out, eps); });
}

void add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(), "residual like x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight: [H] of x's dtype");
  dispatch_float(x.scalar_type(), "add_rms_norm",
                 [&](auto tag) { add_rms_norm_impl<decltype(tag)>(x, residual, weight, eps); });
}

void silu_and_mul(const at::Tensor& gate_up, at::Tensor out) {
  check_rows(gate_up, "gate_up");
  check_rows(out, "out");
  TORCH_CHECK(gate_up.size(1) == 2 * out.size(1) && gate_up.size(0) == out.size(0), "out: [N, gate_up.size(1) / 2]");
  dispatch_float(gate_up.scalar_type(), "silu_and_mul",
                 [&](auto tag) { silu_and_mul_impl<decltype(tag)>(gate_up, out); });
}

void rotary_embedding(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1, "q, k: [N, heads, D]");
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.stride(1) == 1 && sin.stride(1) == 1 &&
              cos.size(0) == q.size(0) && cos.size(1) == q.size(2) && k.size(2) == q.size(2), "cos, sin: [N, D]");
  TORCH_CHECK(q.size(2) % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.scalar_type() == q.scalar_type() && k.scalar_type() == q.scalar_type(), "dtype mismatch");
  dispatch_float(q.scalar_type(), "rotary_embedding", [&](auto tag) { rotary_impl<decltype(tag)>(q, k, cos, sin); });
}

void argmax_rows(const at::Tensor& x, at::Tensor out) {
  check_rows(x, "x");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous() && out.numel() == x.size(0) && x.size(1) > 0,
              "out: int64 [rows]");
  dispatch_float(x.scalar_type(), "argmax_rows", [&](auto tag) { argmax_impl<decltype(tag)>(x, out); });
}

TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("argmax_rows(Tensor x, Tensor(a!) out) -> ()");
  m.impl("argmax_rows", c10::DispatchKey::CPU, &argmax_rows);
  m.def("rms_norm(Tensor x, Tensor weight, Tensor(a!) out, float eps) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, &add_rms_norm);
  m.def("silu_and_mul(Tensor gate_up, Tensor(a!) out) -> ()");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
  m.def("rotary_embedding(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.impl("rotary_embedding", c10::DispatchKey::CPU, &rotary_embedding);
}
