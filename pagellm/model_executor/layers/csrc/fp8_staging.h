// fp8 caches: the per-call bf16 copy of the blocks of requests whose tasks have many query vectors (prefill
// chunks), which the paged kernel (paged_attention_cpu.cpp) then reads as a bf16 cache.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention_common.h"
#include "paged_attention_task.h"

namespace pagellm::paged {


// fp8 requests whose tasks have more query vectors than one pass of the value loop takes (prefill chunks): the
// kernel reads every element once per group of vectors, and converting fp8 each time costs more than the
// multiply-adds it feeds. So their blocks are first converted once per call into bf16 (which holds every e4m3
// and e5m2 value exactly) in the bf16 layout, and their tasks run the bf16 kernel on that copy.
struct Staged {
  Args a;                            // addresses the copy: block table [R, MB] into it, its strides
  const c10::BFloat16 *k = nullptr, *v = nullptr;
  std::vector<char> on;              // per request: its tasks read the copy
};

inline bool wants_staging(const Args& a, int64_t qlen, int64_t max_query_len) {
  return qlen <= max_query_len && std::min(qlen, kTileRows) * a.G > values_per_pass(a.D / 16);
}

#if defined(__AVX512F__)
// (bits of a) >> 16 | (bits of b) & 0xffff0000: two fp32 values that bf16 holds exactly, as one word of bf16.
inline __m512i pack_bf16(__m512 lo, __m512 hi) {
  return _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(lo), 16),
                         _mm512_and_si512(_mm512_castps_si512(hi), _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// One (block, kv head) of fp8 into bf16: K word row j (dims 4j .. 4j+3 of B tokens) -> rows 2j, 2j + 1; V word
// row i (tokens 4i .. 4i+3, D dims) -> rows 2i, 2i + 1.
template <typename KV>
void fp8_block_to_bf16(const int32_t* kw, const int32_t* vw, int32_t* ko, int32_t* vo, int64_t B, int64_t D) {
  const KV* tag = nullptr;
  const __m512 undo = _mm512_set1_ps(fp8_read_scale<KV>());
  auto lanes = [&](__m512i w, __m512 (&e)[4]) {
    e[0] = _mm512_mul_ps(fp8_lane<0>(w, tag), undo), e[1] = _mm512_mul_ps(fp8_lane<1>(w, tag), undo);
    e[2] = _mm512_mul_ps(fp8_lane<2>(w, tag), undo), e[3] = _mm512_mul_ps(fp8_lane<3>(w, tag), undo);
  };
  __m512 e[4];
  for (int64_t j = 0; j < D / 4; ++j)
    for (int64_t t0 = 0; t0 < B; t0 += 16) {
      const __mmask16 m = static_cast<__mmask16>((1u << std::min<int64_t>(16, B - t0)) - 1);
      lanes(_mm512_maskz_loadu_epi32(m, kw + j * B + t0), e);
      _mm512_mask_storeu_epi32(ko + 2 * j * B + t0, m, pack_bf16(e[0], e[1]));
      _mm512_mask_storeu_epi32(ko + (2 * j + 1) * B + t0, m, pack_bf16(e[2], e[3]));
    }
  for (int64_t i = 0; i < B / 4; ++i)
    for (int64_t d = 0; d < D; d += 16) {
      lanes(_mm512_loadu_si512(vw + i * D + d), e);
      _mm512_storeu_si512(vo + 2 * i * D + d, pack_bf16(e[0], e[1]));
      _mm512_storeu_si512(vo + (2 * i + 1) * D + d, pack_bf16(e[2], e[3]));
    }
}

// Fills st for the requests with want[r] (called when at least one has). The copy lives in per-thread buffers
// that keep their size between calls, so a step's 30 layers do not each map and fault in fresh pages.
template <typename KV>
void stage_requests(const Args& a, const std::vector<char>& want, const KV* kc, const KV* vc, Staged& st) {
  thread_local std::vector<c10::BFloat16> kbuf, vbuf;
  thread_local std::vector<int64_t> table;
  const auto blocks = staged_blocks(a, want, table);
  st.on = want;
  const int64_t per = a.B * a.D, n = static_cast<int64_t>(blocks.size()) * a.Hkv * per;
  if (static_cast<int64_t>(kbuf.size()) < n) kbuf.resize(n), vbuf.resize(n);
  // (the workers must not name the thread_locals: each would see its own, empty)
  c10::BFloat16* kout = kbuf.data();
  c10::BFloat16* vout = vbuf.data();
  at::parallel_for(0, static_cast<int64_t>(blocks.size()) * a.Hkv, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto [r, b] = blocks[i / a.Hkv];
      const int64_t h = i % a.Hkv, src = a.bt[r * a.MB + b];
      fp8_block_to_bf16<KV>(reinterpret_cast<const int32_t*>(kc + src * a.k_sb + h * a.k_sh),
                            reinterpret_cast<const int32_t*>(vc + src * a.v_sb + h * a.v_sh),
                            reinterpret_cast<int32_t*>(kout + i * per), reinterpret_cast<int32_t*>(vout + i * per),
                            a.B, a.D);
    }
  });
  st.a = a;
  st.a.bt = table.data();
  st.a.k_sb = st.a.v_sb = a.Hkv * per, st.a.k_sh = st.a.v_sh = per;
  st.k = kout, st.v = vout;
}
#endif

}  // namespace pagellm::paged
