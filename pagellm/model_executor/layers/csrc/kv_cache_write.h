// The KV-cache writer: this step's K/V rows into their slots of the paged cache (layout in
// paged_attention_cpu.cpp), as its own op (write_kv_cache) or row by row inside the attention kernel's tasks,
// just before a task reads the same blocks (paged_attention's k_new / v_new).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

#include "attention_common.h"

namespace pagellm::paged {

// One token of one kv head into 16-bit caches: K as D/2 whole 32-bit words (one per dim pair, B words apart),
// V into its half (odd: upper) of each of the D words of its token-pair row, 16 dims per masked store.
template <typename T>
inline void write_pairs(const T* ks, T* kd, const T* vs, T* vd, int64_t D, int64_t B, int64_t odd) {
  for (int64_t j = 0; j < D / 2; ++j) std::memcpy(kd + j * B * 2, ks + j * 2, 4);
  vd -= odd;  // the word row's start
  int64_t d = 0;
#if defined(__AVX512BW__)
  const __mmask32 half = odd ? 0xAAAAAAAAu : 0x55555555u;
  for (; d + 16 <= D; d += 16) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vs + d)));
    if (odd) w = _mm512_slli_epi32(w, 16);
    _mm512_mask_storeu_epi16(vd + 2 * d, half, w);
  }
#endif
  for (; d < D; ++d) vd[2 * d + odd] = vs[d];
}

// One token of one kv head into fp8 caches (converted as to_fp8): K as D/4 words (dims 4j .. 4j+3), B words
// apart; V into byte `off` (0-3) of each of the D words of its row of four tokens.
template <typename T, typename KV>
inline void write_quads(const T* ks, KV* kd, const T* vs, KV* vd, int64_t D, int64_t B, int64_t off) {
  uint8_t* k8 = reinterpret_cast<uint8_t*>(kd);
  uint8_t* v8 = reinterpret_cast<uint8_t*>(vd) - off;  // the word row's start
  int64_t d = 0;
#if defined(__AVX512BW__)
  const __mmask64 byte = 0x1111111111111111ull << off;
  for (; d + 16 <= D; d += 16) {
    alignas(16) uint8_t kb[16];  // dims d .. d+15: four words
    _mm_store_si128(reinterpret_cast<__m128i*>(kb), cvt_fp8(load16(ks + d), static_cast<const KV*>(nullptr)));
    for (int w = 0; w < 4; ++w) std::memcpy(k8 + (d / 4 + w) * B * 4, kb + 4 * w, 4);
    const __m512i vw = _mm512_slli_epi32(_mm512_cvtepu8_epi32(cvt_fp8(load16(vs + d), static_cast<const KV*>(nullptr))),
                                         8 * static_cast<int>(off));
    _mm512_mask_storeu_epi8(v8 + 4 * d, byte, vw);
  }
#endif
  for (; d < D; ++d) {
    k8[(d / 4) * B * 4 + d % 4] = to_fp8<KV>(to_float(ks[d])).x;
    v8[4 * d + off] = to_fp8<KV>(to_float(vs[d])).x;
  }
}

// This step's K/V rows [N, Hkv, D] (T) and their slots (block * B + offset; negative: not written), to be written
// into a layer's cache (KV: T, or fp8 converted by to_fp8).
template <typename T, typename KV>
struct KVRows {
  const T *k = nullptr, *v = nullptr;
  int64_t k_s0 = 0, k_s1 = 0, v_s0 = 0, v_s1 = 0;
  const int64_t* slots = nullptr;
  KV *kc = nullptr, *vc = nullptr;
  int64_t k_sb = 0, k_sh = 0, v_sb = 0, v_sh = 0, D = 0, B = 0;

  KVRows() = default;
  KVRows(const at::Tensor& kt, const at::Tensor& vt, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& s)
      : k(kt.data_ptr<T>()), v(vt.data_ptr<T>()), k_s0(kt.stride(0)), k_s1(kt.stride(1)), v_s0(vt.stride(0)),
        v_s1(vt.stride(1)), slots(s.data_ptr<int64_t>()), kc(static_cast<KV*>(k_cache.data_ptr())),
        vc(static_cast<KV*>(v_cache.data_ptr())), k_sb(k_cache.stride(0)), k_sh(k_cache.stride(1)),
        v_sb(v_cache.stride(0)), v_sh(v_cache.stride(1)), D(kt.size(2)), B(v_cache.size(2) * pack_x<KV>()) {}

  // Row t's kv heads [h0, h1) into its slot.
  void write(int64_t t, int64_t h0, int64_t h1) const {
    constexpr int x = pack_x<KV>();
    const int64_t slot = slots[t];
    if (slot < 0) return;
    const int64_t blk = slot / B, off = slot % B;
    for (int64_t h = h0; h < h1; ++h) {
      const T* ks = k + t * k_s0 + h * k_s1;
      const T* vs = v + t * v_s0 + h * v_s1;
      KV* kd = kc + blk * k_sb + h * k_sh + off * x;
      KV* vd = vc + blk * v_sb + h * v_sh + (off / x) * D * x + off % x;
      if constexpr (x == 4) {
        write_quads(ks, kd, vs, vd, D, B, off % 4);
      } else if constexpr (x == 2) {
        write_pairs(ks, kd, vs, vd, D, B, off % 2);
      } else {
        for (int64_t j = 0; j < D / x; ++j)
          for (int e = 0; e < x; ++e) kd[j * B * x + e] = ks[j * x + e];
        for (int64_t d = 0; d < D; ++d) vd[d * x] = vs[d];
      }
    }
  }
};

// Every kv head of rows[i] for i in [0, n) (all N rows when rows is null), in parallel. A grain of 16 rows: a
// decode step's 64 rows go to both threads (with 64, one thread wrote them all). Each row's K touches 32 cache
// lines that miss (the block was evicted since the last step), and two cores wait on twice the misses at once: 38
// against 64 us per layer at 64 decode rows (10-step profiles of workload_64).
template <typename T, typename KV>
void write_rows(const KVRows<T, KV>& w, int64_t n, const int64_t* rows, int64_t Hkv) {
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) w.write(rows ? rows[i] : i, 0, Hkv);
  });
}

}  // namespace pagellm::paged
