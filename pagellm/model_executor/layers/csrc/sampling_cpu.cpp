// Random sampling under top-k / top-p, without sorting the vocabulary:
//   top_k_top_p_probs  each row's unnormalised probabilities exp(logit - max), 0 for the tokens min-p, top-k and top-p
//                      remove
//                      (the cut alone: what the tests hold against the full-sort reference)
//   sample_rows        the same cut on logits / temperature, then one draw per row: the first token (in id order)
//                      whose cumulative probability passes u * the kept total (sampler._inverse_cdf's draw)
//   logprobs_rows      the sampled token's log-probability and rank, and the k most likely tokens', in two passes
//                      over each row (torch: log_softmax, a compare over the row and topk, ~10 ms at [64, 49152])
//
// Semantics (those of sampler.apply_top_k_top_p_min_p, vLLM's): min-p first removes the tokens whose probability
// is below min_p times the largest; then order a row's tokens by logit descending (ties: token id ascending);
// top-k keeps the first k; top-p then keeps each token whose mass strictly before it, as a share of what top-k
// kept, is at most p (so the first token always stays).
//
// Only the tokens near a cut need ordering. A histogram of each token's distance below the row's maximum logit
// (kBucketsPerUnit buckets per unit of logit) gives, per bucket, the tokens and the mass it holds; the cut lies in
// the first bucket whose cumulative count reaches k (top-k) or whose cumulative mass passes p (top-p). Tokens in
// the buckets before it are all kept, those after it all removed, and only the cut bucket's tokens (for top-k: the
// buckets up to it, k tokens or a few more) are sorted. On [64, 49152] logits a full sort takes ~100-170 ms in
// torch; this takes a few ms.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "vec.h"

namespace {
using namespace pagellm;

constexpr int kBuckets = 512;
constexpr float kBucketsPerUnit = 16.f;  // buckets cover logits down to 32 below the maximum; the last takes the rest
constexpr int kNear = 256;               // the buckets within 16 of the maximum

struct Scratch {
  std::vector<int32_t> bucket;  // [V] each token's bucket
  std::vector<int32_t> ids;     // tokens to order
};

// Sorts ids by logit descending, then id ascending.
void order(std::vector<int32_t>& ids, const float* l) {
  std::sort(ids.begin(), ids.end(), [l](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
}

#if defined(__AVX512F__)
// Appends the lanes of v that m selects to out[n ..); returns the new count. The callers list tokens below j + 16
// with n <= j, so the full vector's store stays within their V slots. VPCOMPRESSD into a register, then a plain
// store: its form that stores to memory is slow on Zen 4, 21.4 against 1.5 ns a vector in a loop of each
// (one core), which made sample_rows take 7.3 ms at [64, 49,152] on two threads against 2.4 ms this way.
inline int64_t append_lanes(int32_t* out, int64_t n, __mmask16 m, __m512i v) {
  _mm512_storeu_si512(out + n, _mm512_maskz_compress_epi32(m, v));
  return n + __builtin_popcount(m);
}
#elif defined(PAGELLM_HAS_AVX2)
// AVX2 has no compress: tokens j .. j + 7 whose bit is set in m (movemask's), appended without a branch (each lane
// writes out[n]: the callers list tokens below j + 8 <= V with n <= j, so every write stays within their V slots).
inline int64_t append_lanes8(int32_t* out, int64_t n, int m, int64_t j) {
  for (int k = 0; k < 8; ++k) out[n] = static_cast<int32_t>(j + k), n += (m >> k) & 1;
  return n;
}

inline float sum8(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
#endif

// Branch-free (the buckets of neighbouring tokens are unrelated, a branch per token mispredicts often): sets
// e = 0 for the tokens in buckets after `last`, and lists in w.ids the tokens in buckets [first, last].
void split(const int32_t* bk, int64_t V, int first, int last, float* e, Scratch& w) {
  w.ids.resize(V);
  int32_t* out = w.ids.data();
  int64_t n = 0, j = 0;
#if defined(__AVX512F__)
  const __m512i vf = _mm512_set1_epi32(first), vl = _mm512_set1_epi32(last);
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; j + 16 <= V; j += 16) {
    const __m512i b = _mm512_loadu_si512(bk + j);
    const __mmask16 after = _mm512_cmpgt_epi32_mask(b, vl);
    _mm512_mask_storeu_ps(e + j, after, _mm512_setzero_ps());
    const __mmask16 in = _mm512_mask_cmpge_epi32_mask(static_cast<__mmask16>(~after), b, vf);
    n = append_lanes(out, n, in, _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int32_t>(j))));
  }
#elif defined(PAGELLM_HAS_AVX2)
  const __m256i vf = _mm256_set1_epi32(first), vl = _mm256_set1_epi32(last);
  for (; j + 8 <= V; j += 8) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bk + j));
    const __m256i after = _mm256_cmpgt_epi32(b, vl);
    _mm256_maskstore_ps(e + j, after, _mm256_setzero_ps());
    const __m256i before = _mm256_cmpgt_epi32(vf, b);
    n = append_lanes8(out, n, ~_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_or_si256(after, before))) & 0xff, j);
  }
#endif
  for (; j < V; ++j) {
    if (bk[j] > last) e[j] = 0.f;
    else if (bk[j] >= first) out[n++] = static_cast<int32_t>(j);
  }
  w.ids.resize(n);
}

// min_p: tokens with e = exp(l - max) below min_p (their probability below min_p times the largest) are removed
// first, as -inf logits are: e = 0, the last bucket.
void cut_row(const float* l, int64_t V, int64_t k, float p, float min_p, float* e, Scratch& w) {
  // The maximum, then e = exp(l - max) (exactly 0 for -inf logits: masked tokens) and each token's bucket.
  const float mx = max_of(l, V);
  w.bucket.resize(V);
  w.ids.resize(V);
  int32_t* bk = w.bucket.data();
  int32_t* near = w.ids.data();  // the tokens in the first kNear buckets
  int64_t n_near = 0;
  float total = 0.f, near_mass = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 vmx = _mm512_set1_ps(mx), vscale = _mm512_set1_ps(kBucketsPerUnit);
  const __m512 vlast = _mm512_set1_ps(static_cast<float>(kBuckets - 1)), vnear = _mm512_set1_ps(float(kNear));
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), vminp = _mm512_set1_ps(min_p);
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 acc = _mm512_setzero_ps(), acc_near = _mm512_setzero_ps();
  for (; i + 16 <= V; i += 16) {
    const __m512 x = _mm512_loadu_ps(l + i);
    const __m512 ex = exp16(_mm512_sub_ps(x, vmx));
    const __mmask16 live = _mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ) & _mm512_cmp_ps_mask(ex, vminp, _CMP_GE_OQ);
    const __m512 v = _mm512_maskz_mov_ps(live, ex);
    _mm512_storeu_ps(e + i, v);
    acc = _mm512_add_ps(acc, v);
    // min() before the conversion: a -inf logit's distance is +inf
    const __m512 b = _mm512_mask_mov_ps(vlast, live, _mm512_min_ps(_mm512_mul_ps(_mm512_sub_ps(vmx, x), vscale), vlast));
    _mm512_storeu_si512(bk + i, _mm512_cvttps_epi32(b));
    const __mmask16 in = _mm512_cmp_ps_mask(b, vnear, _CMP_LT_OQ);
    acc_near = _mm512_mask_add_ps(acc_near, in, acc_near, v);
    n_near = append_lanes(near, n_near, in, _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int32_t>(i))));
  }
  total = _mm512_reduce_add_ps(acc);
  near_mass = _mm512_reduce_add_ps(acc_near);
#elif defined(PAGELLM_HAS_AVX2)
  // as above on 8 lanes (exp8 is exp16's reduction and polynomial)
  const __m256 vmx = _mm256_set1_ps(mx), vscale = _mm256_set1_ps(kBucketsPerUnit);
  const __m256 vlast = _mm256_set1_ps(static_cast<float>(kBuckets - 1)), vnear = _mm256_set1_ps(float(kNear));
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), vminp = _mm256_set1_ps(min_p);
  __m256 acc = _mm256_setzero_ps(), acc_near = _mm256_setzero_ps();
  for (; i + 8 <= V; i += 8) {
    const __m256 x = _mm256_loadu_ps(l + i);
    const __m256 ex = v8::exp8(_mm256_sub_ps(x, vmx));
    const __m256 live = _mm256_and_ps(_mm256_cmp_ps(x, ninf, _CMP_NEQ_OQ), _mm256_cmp_ps(ex, vminp, _CMP_GE_OQ));
    const __m256 v = _mm256_and_ps(live, ex);
    _mm256_storeu_ps(e + i, v);
    acc = _mm256_add_ps(acc, v);
    const __m256 b = _mm256_blendv_ps(vlast, _mm256_min_ps(_mm256_mul_ps(_mm256_sub_ps(vmx, x), vscale), vlast), live);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(bk + i), _mm256_cvttps_epi32(b));
    const __m256 in = _mm256_cmp_ps(b, vnear, _CMP_LT_OQ);
    acc_near = _mm256_add_ps(acc_near, _mm256_and_ps(in, v));
    n_near = append_lanes8(near, n_near, _mm256_movemask_ps(in), i);
  }
  total = sum8(acc);
  near_mass = sum8(acc_near);
#endif
  for (; i < V; ++i) {
    const float ex = std::exp(l[i] - mx);
    const bool live = l[i] != -std::numeric_limits<float>::infinity() && ex >= min_p;
    e[i] = live ? ex : 0.f;
    total += e[i];
    bk[i] = live ? static_cast<int32_t>(std::min((mx - l[i]) * kBucketsPerUnit, float(kBuckets - 1))) : kBuckets - 1;
    if (bk[i] < kNear) {
      near[n_near++] = static_cast<int32_t>(i);
      near_mass += e[i];
    }
  }
  if (k >= V && p >= 1.f) return;  // no cut: every token keeps its e
  // When the cut falls among the near tokens (k of them, or more than p of the mass: as a rule with real text,
  // where a few hundred tokens lie within 16 of the maximum), only they are counted; the buckets after stay empty,
  // and every token there is past the cut anyway.
  const bool near_only = k < V ? n_near >= k : near_mass > p * total;
  // Four partial histograms by turns: consecutive tokens often share a bucket, and one histogram would chain
  // every update on the previous one's store.
  int32_t count4[4][kBuckets] = {};
  float mass4[4][kBuckets] = {};
  const int64_t n = near_only ? n_near : V;
  auto at = [&](int64_t j) -> int64_t { return near_only ? near[j] : j; };
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    for (int t = 0; t < 4; ++t) {
      const int64_t id = at(j + t);
      ++count4[t][bk[id]];
      mass4[t][bk[id]] += e[id];
    }
  }
  for (; j < n; ++j) {
    ++count4[0][bk[at(j)]];
    mass4[0][bk[at(j)]] += e[at(j)];
  }
  int32_t count[kBuckets];
  float mass[kBuckets];
  for (int b = 0; b < kBuckets; ++b) {
    count[b] = count4[0][b] + count4[1][b] + count4[2][b] + count4[3][b];
    mass[b] = (mass4[0][b] + mass4[1][b]) + (mass4[2][b] + mass4[3][b]);
  }

  if (k < V) {
    // The first bucket whose cumulative count reaches k; the k first of the tokens up to it, in order, stay.
    int b = 0;
    for (int64_t seen = count[0]; seen < k && b < kBuckets - 1;) seen += count[++b];
    split(bk, V, 0, b, e, w);
    order(w.ids, l);
    for (size_t j = k; j < w.ids.size(); ++j) e[w.ids[j]] = 0.f;
    w.ids.resize(k);
    if (p < 1.f) {
      float kept = 0.f;
      for (int32_t id : w.ids) kept += e[id];
      const float limit = p * kept;
      float before = 0.f;
      for (int32_t id : w.ids) {
        const float x = e[id];
        if (before > limit) e[id] = 0.f;
        before += x;
      }
    }
    return;
  }
  // The first bucket whose cumulative mass passes p: tokens before it stay, after it go, inside it in order.
  const float limit = p * total;
  // counting near tokens only, the cut is among them: should the buckets' sum fall short of near_mass by a
  // rounding, stop at the last near bucket (its tokens are walked in order below), never in the uncounted ones
  const int last = near_only ? kNear - 1 : kBuckets - 1;
  int b = 0;
  float below = 0.f;  // the mass of the buckets before b
  while (b < last && below + mass[b] <= limit) below += mass[b++];
  split(bk, V, b, b, e, w);
  order(w.ids, l);
  float before = below;
  for (int32_t id : w.ids) {
    const float x = e[id];
    if (before > limit) e[id] = 0.f;
    before += x;
  }
}

// The first token whose cumulative e (id order) passes u * total, in blocks of W (16 values on AVX-512, 8 on AVX2)
// then token by token; total sums the same blocks in the same order, so the blocks' running sum reaches it and
// u < 1 keeps the target below it.
// A token with e = 0 never passes: the sum does not move there.
int64_t draw(const float* e, int64_t V, float u) {
  float total = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__) || defined(PAGELLM_HAS_AVX2)
#if defined(__AVX512F__)
  constexpr int64_t W = 16;
  auto block_sum = [](const float* x) { return _mm512_reduce_add_ps(_mm512_loadu_ps(x)); };
#else
  constexpr int64_t W = 8;
  auto block_sum = [](const float* x) { return sum8(_mm256_loadu_ps(x)); };
#endif
  // each block's sum once, kept for the second walk (its horizontal sums again took ~5% of a row's time)
  static thread_local std::vector<float> block;
  block.resize(static_cast<size_t>(V / W));
  for (; i + W <= V; i += W) total += block[i / W] = block_sum(e + i);
#endif
  for (; i < V; ++i) total += e[i];
  const float target = u * total;
  float run = 0.f;
  i = 0;
#if defined(__AVX512F__) || defined(PAGELLM_HAS_AVX2)
  for (; i + W <= V; i += W) {
    const float s = block[i / W];
    if (run + s > target) break;
    run += s;
  }
#endif
  for (; i < V; ++i) {
    run += e[i];
    if (run > target) return i;
  }
  for (i = V - 1; i > 0 && e[i] == 0.f; --i) {}  // rounding left the target unpassed: the last kept token
  return i;
}

// One row's log-probabilities as torch's log_softmax gives them, (x - max) - log(sum exp(x - max)), for the
// sampled token and the k most likely (logit descending, then id ascending), and the sampled token's rank: 1 + the
// tokens with a higher log-probability. Two passes: the maximum and the top k (only logits above the k-th best so
// far are inserted), then the sum and the rank count.
void logprobs_row(const float* l, int64_t V, int64_t chosen, int64_t k, float* chosen_lp, int64_t* rank,
                  int64_t* top_ids, float* top_lp) {
  std::vector<std::pair<float, int64_t>> best;  // sorted: logit descending, id ascending
  best.reserve(k + 1);
  auto insert = [&](float x, int64_t id) {
    auto it = std::upper_bound(best.begin(), best.end(), std::make_pair(x, id), [](const auto& a, const auto& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    best.insert(it, {x, id});
    if (static_cast<int64_t>(best.size()) > k) best.pop_back();
  };
  const float ninf = -std::numeric_limits<float>::infinity();
  float mx = ninf;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(ninf);
  for (; i + 16 <= V; i += 16) {
    const __m512 x = _mm512_loadu_ps(l + i);
    vm = _mm512_max_ps(vm, x);
    if (k == 0) continue;
    // a token enters the top k only above the k-th best so far (or while fewer than k are held)
    const float floor = static_cast<int64_t>(best.size()) < k ? ninf : best.back().first;
    __mmask16 above = _mm512_cmp_ps_mask(x, _mm512_set1_ps(floor), _CMP_GT_OQ);  // a tie comes later: higher id
    if (static_cast<int64_t>(best.size()) < k) above = 0xFFFF;
    while (above) {
      const int j = __builtin_ctz(above);
      above &= above - 1;
      const float v = l[i + j];
      if (static_cast<int64_t>(best.size()) < k || v > best.back().first ||
          (v == best.back().first && i + j < best.back().second))
        insert(v, i + j);
    }
  }
  mx = _mm512_reduce_max_ps(vm);
#endif
  for (; i < V; ++i) {
    mx = std::max(mx, l[i]);
    if (k > 0 && (static_cast<int64_t>(best.size()) < k || l[i] > best.back().first)) insert(l[i], i);
  }
  float sum = 0.f;
  i = 0;
#if defined(__AVX512F__)
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= V; i += 16) acc = _mm512_add_ps(acc, exp16(_mm512_sub_ps(_mm512_loadu_ps(l + i), vmx)));
  sum = _mm512_reduce_add_ps(acc);
#endif
  double tail = 0.0;  // without AVX-512 this is the whole row: a float sum of 49k terms drifts by ~1e-5
  for (; i < V; ++i) tail += std::exp(l[i] - mx);
  const float logsum = std::log(static_cast<float>(sum + tail));
  auto lp = [&](float x) { return (x - mx) - logsum; };
  const float c = lp(l[chosen]);
  int64_t higher = 0;
  i = 0;
#if defined(__AVX512F__)
  const __m512 vls = _mm512_set1_ps(logsum), vc = _mm512_set1_ps(c);
  for (; i + 16 <= V; i += 16) {
    const __m512 v = _mm512_sub_ps(_mm512_sub_ps(_mm512_loadu_ps(l + i), vmx), vls);
    higher += __builtin_popcount(_mm512_cmp_ps_mask(v, vc, _CMP_GT_OQ));
  }
#endif
  for (; i < V; ++i) higher += lp(l[i]) > c;
  *chosen_lp = c;
  *rank = higher + 1;
  for (int64_t j = 0; j < k; ++j) {
    top_ids[j] = best[j].second;
    top_lp[j] = lp(best[j].first);
  }
}

}  // namespace

// logits: fp32 [R, V] (rows contiguous); sampled: int64 [R]; k >= 0 (< V); outputs: chosen_lp fp32 [R], rank int64
// [R], top_ids int64 [R, k], top_lp fp32 [R, k].
void logprobs_rows(const at::Tensor& logits, const at::Tensor& sampled, int64_t k, at::Tensor chosen_lp,
                   at::Tensor rank, at::Tensor top_ids, at::Tensor top_lp) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "logits: float32 [rows, vocab] with contiguous rows");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(k >= 0 && k <= V, "k out of range");
  TORCH_CHECK(sampled.scalar_type() == at::kLong && sampled.is_contiguous() && sampled.numel() == R,
              "sampled: int64 [rows]");
  TORCH_CHECK(chosen_lp.scalar_type() == at::kFloat && chosen_lp.is_contiguous() && chosen_lp.numel() == R &&
              rank.scalar_type() == at::kLong && rank.is_contiguous() && rank.numel() == R,
              "chosen_lp: float32 [rows], rank: int64 [rows]");
  TORCH_CHECK(top_ids.scalar_type() == at::kLong && top_ids.is_contiguous() && top_ids.numel() == R * k &&
              top_lp.scalar_type() == at::kFloat && top_lp.is_contiguous() && top_lp.numel() == R * k,
              "top_ids: int64 [rows, k], top_lp: float32 [rows, k]");
  const float* lp = logits.data_ptr<float>();
  const int64_t* sp = sampled.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(sp[r] >= 0 && sp[r] < V, "sampled token out of range");
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      logprobs_row(lp + r * logits.stride(0), V, sp[r], k, chosen_lp.data_ptr<float>() + r,
                   rank.data_ptr<int64_t>() + r, top_ids.data_ptr<int64_t>() + r * k, top_lp.data_ptr<float>() + r * k);
  });
}

// logits: fp32 [R, V] (rows contiguous); top_k: int64 [R] (0: off); top_p, min_p: fp32 [R] (1, 0: off); out: fp32
// [R, V].
void top_k_top_p_probs(const at::Tensor& logits, const at::Tensor& top_k, const at::Tensor& top_p,
                       const at::Tensor& min_p, at::Tensor out) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "logits: float32 [rows, vocab] with contiguous rows");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0 && V < std::numeric_limits<int32_t>::max(), "vocab size out of range");
  TORCH_CHECK(top_k.scalar_type() == at::kLong && top_k.is_contiguous() && top_k.numel() == R, "top_k: int64 [rows]");
  for (const at::Tensor* t : {&top_p, &min_p})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == R, "top_p, min_p: float32 [rows]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == R && out.size(1) == V &&
              out.stride(1) == 1, "out: float32 [rows, vocab] with contiguous rows");
  const float* lp = logits.data_ptr<float>();
  const int64_t* kp = top_k.data_ptr<int64_t>();
  const float *pp = top_p.data_ptr<float>(), *mp = min_p.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    static thread_local Scratch w;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t k = kp[r] > 0 ? std::min(kp[r], V) : V;
      cut_row(lp + r * logits.stride(0), V, k, pp[r], mp[r], op + r * out.stride(0), w);
    }
  });
}

// logits: fp32 [R, V] (rows contiguous); temperature, top_p, min_p, u: fp32 [R] (temperature > 0, u in [0, 1)); top_k:
// int64 [R]; out: int64 [R]. min-p applies to the distribution after the temperature, as top-k and top-p do.
void sample_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                 const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& u, at::Tensor out) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "logits: float32 [rows, vocab] with contiguous rows");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0 && V < std::numeric_limits<int32_t>::max(), "vocab size out of range");
  for (const at::Tensor* t : {&temperature, &top_p, &min_p, &u})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == R,
                "temperature, top_p, min_p, u: float32 [rows]");
  TORCH_CHECK(top_k.scalar_type() == at::kLong && top_k.is_contiguous() && top_k.numel() == R, "top_k: int64 [rows]");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous() && out.numel() == R, "out: int64 [rows]");
  const float* lp = logits.data_ptr<float>();
  const float *tp = temperature.data_ptr<float>(), *pp = top_p.data_ptr<float>(), *up = u.data_ptr<float>();
  const float* mp = min_p.data_ptr<float>();
  const int64_t* kp = top_k.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    static thread_local Scratch w;
    static thread_local std::vector<float> scaled, e;
    scaled.resize(V);
    e.resize(V);
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = lp + r * logits.stride(0);
      const float t = tp[r];
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 vt = _mm512_set1_ps(t);
      for (; i + 16 <= V; i += 16) _mm512_storeu_ps(scaled.data() + i, _mm512_div_ps(_mm512_loadu_ps(x + i), vt));
#endif
      for (; i < V; ++i) scaled[i] = x[i] / t;  // a division, as the torch path's logits / temperature
      const int64_t k = kp[r] > 0 ? std::min(kp[r], V) : V;
      cut_row(scaled.data(), V, k, pp[r], mp[r], e.data(), w);
      op[r] = draw(e.data(), V, up[r]);
    }
  });
}

TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("logprobs_rows(Tensor logits, Tensor sampled, int k, Tensor(a!) chosen_lp, Tensor(b!) rank, "
        "Tensor(c!) top_ids, Tensor(d!) top_lp) -> ()");
  m.impl("logprobs_rows", c10::DispatchKey::CPU, &logprobs_rows);
  m.def("sample_rows(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, Tensor u, "
        "Tensor(a!) out) -> ()");
  m.impl("sample_rows", c10::DispatchKey::CPU, &sample_rows);
  m.def("top_k_top_p_probs(Tensor logits, Tensor top_k, Tensor top_p, Tensor min_p, Tensor(a!) out) -> ()");
  m.impl("top_k_top_p_probs", c10::DispatchKey::CPU, &top_k_top_p_probs);
}
