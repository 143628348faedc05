// Prefill attention on AMX tiles, reading K/V in place from the paged cache (bf16; layout in
// paged_attention_cpu.cpp). It takes the requests whose chunk is longer than the FMA kernel's (> min_query_len
// rows); SDPA's CPU flash kernel did these at 250-300 GFLOP/s here.
//
// The cache layout is already what AMX multiplies: a block's keys of one kv head are [D/2 word rows][B tokens]
// words, i.e. for 16 tokens and 32 dims one B tile (16 rows of 64 bytes, row stride B words), read in place.
// Its values are [B/2 token pairs][D dims] words: with blocks of 32 tokens or more, 32 keys and 16 dims of them are
// one B tile in place too; with 16-token blocks each pass copies them end to end first (a tile then spans two
// blocks). Reading them in place took 12-16% off a 2,048-row chunk after 4,952 tokens (32-token blocks, paired
// alternating calls in one process: the copy was re-made by every task of the request, 172 MB per layer there).
// A task is (request, kv head, up to 32 query rows: two 16-row tiles that share every key tile they load), and
// walks its keys in passes of 512 (flash-style, so a pass's scores, probabilities and values stay in L2). In a
// pass, for each of the G query heads sharing the kv head:
//   1. scores S [32 rows][keys] = Q K^T, 16 x 16 fp32 tiles, 2 row tiles x 2 key tiles at a time;
//   2. the pass of each row's online softmax (running max and sum, causal and sliding-window bounds), in fp32,
//      written as bf16 P = exp(score - running max), exact zeros outside the row's keys (as in SDPA's flash
//      kernel, the probabilities meet the values in bf16);
//   3. O = alpha O + P V: 16 rows x 64 dims in tiles 0-3 per tile pass, 32 keys per multiply; alpha rescales
//      the running output when the row's maximum grew.
// Slots past the context (never written, so possibly stale or NaN) would poison P V even with P = 0, so the
// copied values are zeroed there; the keys' stale slots only give scores that the softmax never reads.
// ``python bench/kernels.py`` (bf16, 2 cores, medians): 4 prompts of 300, 2 of 512, a 512- and a 2048-row chunk
// after ~5-6.5k tokens take 2.1, 2.2, 19.1, 62.8 ms against SDPA's 4.1, 3.5, 28.0, 108.5 ms. The softmax's
// exponentials, not the tile multiplies, bound it (as they bound SDPA), hence the short exp below.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "amx.h"
#include "attention_common.h"
#include "split_work.h"

#if defined(PAGELLM_AMX) && defined(__AVX512BF16__)
#define PAGELLM_AMX_ATTENTION 1
#endif

namespace {
using namespace pagellm;
using bf16 = c10::BFloat16;

#if defined(PAGELLM_AMX_ATTENTION)
constexpr int64_t kRows = 32;  // query rows per task: two 16-row tiles share each key tile they load

// Tiles (configure_tiles, 16 x 64 bytes each). Scores: Q (the two row tiles' same 32 dims) 0-1, K 5-6 (two
// 16-key tiles), S 2-3 and 4, 7 (2 x 2 in flight). Values: O 0-3, P 4, V 5-6.

// The index of a tile in an AMX instruction is an immediate: these dispatch a runtime index 0-3.
#define PAGELLM_TILE_CASES(OP) \
  switch (c) {                 \
    case 0: OP(0); break;      \
    case 1: OP(1); break;      \
    case 2: OP(2); break;      \
    default: OP(3); break;     \
  }

struct Args {
  int64_t H, Hkv, G, D, B, MB;
  int64_t q_s0, q_s1, o_s0, o_s1, k_sb, k_sh, v_sb, v_sh;
  const int64_t *bt, *seq, *qs;
  float scale;
  int64_t window;
  bool causal = true;     // false: every row attends to the whole context (cascade attention's shared prefix)
  float* lse = nullptr;   // [T, H] log-sum-exp of each row's scores, or null
  int64_t lse_s0 = 0;
};

struct Task {
  int64_t r, h, i0, rows, cost;  // request, kv head, first query row of the request's chunk, rows (<= kRows)
};

constexpr int64_t kHeadMajor = int64_t(1) << 40;  // a task's cost per kv head (prefill_attention_amx)
constexpr int64_t kKeyChunk = 512;  // keys per pass: a pass's scores, probabilities and values stay in L2

struct Scratch {
  std::vector<float> S;                       // [32][chunk]: one query head's scores for the pass
  std::vector<bf16> P;                        // [32][chunk]: exp(score - running row max), unnormalised
  std::vector<bf16> V;                        // [chunk / 2][D][2]: the pass's values end to end, slots past the
                                              // context and padding zeroed
  std::vector<bf16> q;                        // [32][D], rows past the task's zero
  std::vector<float> O;                       // [G][32][D] running outputs (unnormalised)
  std::vector<float> m, l;                    // [G][32] running row max and sum
  float alpha[kRows];                         // this pass's rescale of each row's running output
  alignas(64) float o[16 * 128];
};

// 2^x for the softmax's x <= 0 (its exponent in base 2: the scores' scale and the row maximum carry the log2(e)
// factor, which saves a multiply), to ~4e-5 relative: 2^n * (degree-4 Taylor polynomial of 2^f), |f| <= 1/2.
// Its result is rounded to bf16 (2^-9 relative) right after, so the short polynomial moves a probability by one
// bf16 step at most, and rarely; it is about half the instructions of vec.h's exp16, and the exponentials bound
// this kernel. (SDPA's CPU flash kernel also uses a reduced-precision exp.) The clamp keeps results normal:
// without it, scores far below the row maximum made denormals, each a slow microcode assist (measured slower).
inline __m512 exp2_for_bf16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-125.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(9.61812911e-3f);  // ln2^4 / 24
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.55041087e-2f));  // ln2^3 / 6
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40226507e-1f));  // ln2^2 / 2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93147181e-1f));  // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// One pass of a row's online softmax: p[0, np) = exp(s * scale - m') over [lo, hi) as bf16, zero elsewhere, where
// m' = max(m, the pass's scores); l = l * alpha + the sum of those terms (in fp32 before rounding, as SDPA's flash
// kernel sums them); returns alpha = exp(m - m'),
// the factor the row's running output is rescaled by. An empty range leaves m, l as they are (alpha 1).
float softmax_pass(const float* s, bf16* p, int64_t np, int64_t lo, int64_t hi, float scale, float& m, float& l) {
  if (lo >= hi) {
    std::memset(p, 0, np * sizeof(bf16));
    return 1.f;
  }
  // Two accumulators in each loop below: one would chain every vector on the previous one's latency.
  float cm = -std::numeric_limits<float>::infinity();
  int64_t j = lo;
  __m512 vmax = _mm512_set1_ps(cm), vmax2 = vmax;
  for (; j + 32 <= hi; j += 32) {
    vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + j));
    vmax2 = _mm512_max_ps(vmax2, _mm512_loadu_ps(s + j + 16));
  }
  for (; j + 16 <= hi; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + j));
  // The last hi - j < 16 scores under a mask: a causal row ends anywhere, and a scalar tail (one std::exp per
  // score) cost more than the vector part on prompts of a few hundred tokens.
  const __mmask16 tail = static_cast<__mmask16>((1u << (hi - j)) - 1);
  if (tail) vmax2 = _mm512_mask_max_ps(vmax2, tail, vmax2, _mm512_maskz_loadu_ps(tail, s + j));
  cm = _mm512_reduce_max_ps(_mm512_max_ps(vmax, vmax2));
  const float mn = std::max(m, cm * scale);  // scale > 0
  const float alpha = std::exp(m - mn);      // m = -inf on the first pass: 0
  constexpr float kLog2e = 1.44269504f;
  const __m512 vs = _mm512_set1_ps(scale * kLog2e), vm = _mm512_set1_ps(mn * kLog2e);
  // p[j..j+15] as bf16; returns the terms in fp32 for the sum
  auto term = [&](int64_t j) {
    const __m512 e = exp2_for_bf16(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), vs, vm));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), (__m256i)_mm512_cvtneps_pbh(e));
    return e;
  };
  __m512 acc = _mm512_setzero_ps(), acc2 = _mm512_setzero_ps();
  std::memset(p, 0, lo * sizeof(bf16));
  for (j = lo; j + 32 <= hi; j += 32) {
    acc = _mm512_add_ps(acc, term(j));
    acc2 = _mm512_add_ps(acc2, term(j + 16));
  }
  for (; j + 16 <= hi; j += 16) acc = _mm512_add_ps(acc, term(j));
  if (tail) {  // the same last scores as above (j ran the same steps from lo); lanes past hi zeroed before the sum
    const __m512 x = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(tail, s + j), vs, vm);
    const __m512 e = _mm512_maskz_mov_ps(tail, exp2_for_bf16(x));
    _mm256_mask_storeu_epi16(p + j, tail, (__m256i)_mm512_cvtneps_pbh(e));
    acc2 = _mm512_add_ps(acc2, e);
  }
  const float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc, acc2));
  std::memset(p + hi, 0, (np - hi) * sizeof(bf16));
  m = mn;
  l = l * alpha + sum;
  return alpha;
}

void run_task(const Args& a, const Task& t, const bf16* qp, const bf16* kc, const bf16* vc, bf16* op, Scratch& w) {
  const int64_t B = a.B, D = a.D, G = a.G, L = a.seq[t.r], qlen = a.qs[t.r + 1] - a.qs[t.r];
  const int64_t p0 = L - qlen + t.i0, khi = a.causal ? p0 + t.rows : L;
  const int64_t klo = a.window > 0 ? std::max<int64_t>(0, p0 - a.window + 1) : 0;
  const int64_t b0 = klo / B, b1 = (khi - 1) / B, base = b0 * B;
  const int64_t n = (b1 - b0 + 1) * B;  // keys from base, in whole blocks
  const int64_t* bt = a.bt + t.r * a.MB;
  const int64_t row0 = a.qs[t.r] + t.i0, qc = D / 32;
  const bool in_place = B % 32 == 0;
  w.S.resize(kRows * kKeyChunk);
  w.P.resize(kRows * kKeyChunk);
  w.V.resize(kKeyChunk * D);
  w.q.resize(G * kRows * D);
  std::memset(w.q.data(), 0, w.q.size() * sizeof(bf16));  // (a vector's fill of 2-byte elements: one at a time)
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < t.rows; ++i)
      std::memcpy(w.q.data() + (g * kRows + i) * D, qp + (row0 + i) * a.q_s0 + (t.h * G + g) * a.q_s1,
                  D * sizeof(bf16));
  w.O.assign(G * kRows * D, 0.f);
  w.m.assign(G * kRows, -std::numeric_limits<float>::infinity());
  w.l.assign(G * kRows, 0.f);
  for (int64_t c0 = 0; c0 < n; c0 += kKeyChunk) {
    const int64_t cn = std::min(kKeyChunk, n - c0), cp = (cn + 31) / 32 * 32, tiles = cn / 16;
    const int64_t valid = std::max<int64_t>(0, std::min(cn, L - base - c0));  // the pass's keys in the context
    // With blocks of 32 keys or more, the values of 32 keys (16 token pairs) are one B tile in place, except the
    // tile holding the context's end: it is copied (k_end, at most one per task), so slots past the end are 0.
    const int64_t k_end = in_place && valid < cp ? valid / 32 * 32 : -1;
    if (!in_place) {  // the pass's values end to end, so 32 keys are one B tile even across blocks
      for (int64_t b = (base + c0) / B; b < (base + c0 + cn) / B; ++b)
        std::memcpy(w.V.data() + (b * B - base - c0) * D, vc + bt[b] * a.v_sb + t.h * a.v_sh, B * D * sizeof(bf16));
    } else if (k_end >= 0) {
      const int64_t tok = base + c0 + k_end;
      std::memcpy(w.V.data(), vc + bt[tok / B] * a.v_sb + t.h * a.v_sh + (tok % B) * D, 32 * D * sizeof(bf16));
    }
    const int64_t v0 = in_place ? std::max<int64_t>(k_end, 0) : 0;  // the pass's first key held in w.V (even)
    if (valid < cp) {  // past the context: the second token of a pair left in use, then whole pairs
      int64_t tok = valid;
      if (tok % 2)
        for (int64_t d = 0; d < D; ++d) w.V[((tok - v0) / 2) * D * 2 + d * 2 + 1] = bf16(0.f);
      tok += tok % 2;
      std::memset(w.V.data() + ((tok - v0) / 2) * D * 2, 0, (cp - tok) * D * sizeof(bf16));
    }
    for (int64_t g = 0; g < G; ++g) {
      const bf16* q = w.q.data() + g * kRows * D;
      // 1. scores: 2 row tiles x 2 key tiles per step, each key tile loaded once for both row tiles
      for (int64_t k = 0; k < tiles; k += 2) {
        const bool two = k + 1 < tiles;
        const int64_t ta = c0 + k * 16, tb = ta + 16;
        const bf16* kA = kc + bt[b0 + ta / B] * a.k_sb + t.h * a.k_sh + (ta % B) * 2;
        const bf16* kB = two ? kc + bt[b0 + tb / B] * a.k_sb + t.h * a.k_sh + (tb % B) * 2 : kA;
        _tile_zero(2);
        _tile_zero(3);
        if (two) {
          _tile_zero(4);
          _tile_zero(7);
        }
        for (int64_t c = 0; c < qc; ++c) {
          _tile_loadd(0, q + c * 32, D * 2);
          _tile_loadd(1, q + 16 * D + c * 32, D * 2);
          _tile_loadd(6, kA + c * 16 * B * 2, B * 4);
          _tile_dpbf16ps(2, 0, 6);
          _tile_dpbf16ps(3, 1, 6);
          if (two) {
            _tile_loadd(5, kB + c * 16 * B * 2, B * 4);
            _tile_dpbf16ps(4, 0, 5);
            _tile_dpbf16ps(7, 1, 5);
          }
        }
        _tile_stored(2, w.S.data() + k * 16, cp * 4);
        _tile_stored(3, w.S.data() + 16 * cp + k * 16, cp * 4);
        if (two) {
          _tile_stored(4, w.S.data() + (k + 1) * 16, cp * 4);
          _tile_stored(7, w.S.data() + 16 * cp + (k + 1) * 16, cp * 4);
        }
      }
      // 2. this pass of each row's softmax, over its own keys within the pass
      float* m = w.m.data() + g * kRows;
      float* l = w.l.data() + g * kRows;
      for (int64_t i = 0; i < kRows; ++i) {
        bf16* p = w.P.data() + i * cp;
        if (i >= t.rows) {
          std::memset(p, 0, cp * sizeof(bf16));
          continue;
        }
        const int64_t pos = a.causal ? p0 + i : L - 1, lo = a.window > 0 ? std::max<int64_t>(0, pos - a.window + 1) : 0;
        const int64_t from = std::max<int64_t>(lo - base - c0, 0), to = std::min<int64_t>(pos + 1 - base - c0, cn);
        w.alpha[i] = softmax_pass(w.S.data() + i * cp, p, cp, from, std::max(from, to), a.scale, m[i], l[i]);
      }
      // 3. values: per 16-row half, 64 dims per tile pass, 32 keys per multiply; then O = alpha O + P V
      float* O = w.O.data() + g * kRows * D;
      for (int64_t r0 = 0; r0 < t.rows; r0 += 16) {
        const bf16* ph = w.P.data() + r0 * cp;
        for (int64_t dg = 0; dg < D; dg += 64) {
          const int64_t nd = std::min<int64_t>(4, (D - dg) / 16);
#define PAGELLM_ZERO(T) _tile_zero(T)
          for (int64_t c = 0; c < nd; ++c) PAGELLM_TILE_CASES(PAGELLM_ZERO)
#undef PAGELLM_ZERO
          for (int64_t k = 0; k < cp; k += 32) {
            _tile_loadd(4, ph + k, cp * 2);
            const bf16* vk;
            if (!in_place) {
              vk = w.V.data() + (k / 2) * D * 2 + dg * 2;
            } else if (k == k_end) {
              vk = w.V.data() + dg * 2;
            } else {
              const int64_t tok = base + c0 + k;
              vk = vc + bt[tok / B] * a.v_sb + t.h * a.v_sh + (tok % B) * D + dg * 2;
            }
#define PAGELLM_PV(T)                     \
  if ((T) % 2) {                          \
    _tile_loadd(5, vk + (T) * 32, D * 4); \
    _tile_dpbf16ps(T, 4, 5);              \
  } else {                                \
    _tile_loadd(6, vk + (T) * 32, D * 4); \
    _tile_dpbf16ps(T, 4, 6);              \
  }
            for (int64_t c = 0; c < nd; ++c) PAGELLM_TILE_CASES(PAGELLM_PV)
#undef PAGELLM_PV
          }
#define PAGELLM_STORE_O(T) _tile_stored(T, w.o + dg + (T) * 16, D * 4)
          for (int64_t c = 0; c < nd; ++c) PAGELLM_TILE_CASES(PAGELLM_STORE_O)
#undef PAGELLM_STORE_O
        }
        for (int64_t i = r0; i < std::min(t.rows, r0 + 16); ++i) {
          const __m512 al = _mm512_set1_ps(w.alpha[i]);
          float* oi = O + i * D;
          for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_ps(oi + d, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(oi + d), al),
                                                   _mm512_loadu_ps(w.o + (i - r0) * D + d)));
        }
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < t.rows; ++i) {
      bf16* o = op + (row0 + i) * a.o_s0 + (t.h * G + g) * a.o_s1;
      const float* oi = w.O.data() + (g * kRows + i) * D;
      const __m512 inv = _mm512_set1_ps(1.f / w.l[g * kRows + i]);
      for (int64_t d = 0; d < D; d += 16) store16(o + d, _mm512_mul_ps(_mm512_loadu_ps(oi + d), inv));
      if (a.lse) a.lse[(row0 + i) * a.lse_s0 + t.h * G + g] = w.m[g * kRows + i] + std::log(w.l[g * kRows + i]);
    }
}

void run_tasks(const Args& a, std::vector<Task>& tasks, const at::Tensor& q, const at::Tensor& k_cache,
               const at::Tensor& v_cache, at::Tensor& out) {
  const auto* qp = q.data_ptr<bf16>();
  const auto* kc = k_cache.data_ptr<bf16>();
  const auto* vc = v_cache.data_ptr<bf16>();
  auto* op = out.data_ptr<bf16>();
  run_largest_first(tasks, [&](auto next) {
    configure_tiles();  // tile state is per thread
    static thread_local Scratch w;  // kept between calls: growing a vector of bf16 fills it element by element
    while (const Task* t = next()) run_task(a, *t, qp, kc, vc, op, w);
    _tile_release();
  });
}

Args make_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& out,
               double scale, int64_t window) {
  Args a;
  a.H = q.size(1), a.Hkv = k_cache.size(1), a.G = a.H / a.Hkv, a.D = q.size(2), a.B = v_cache.size(2) * 2;
  a.q_s0 = q.stride(0), a.q_s1 = q.stride(1), a.o_s0 = out.stride(0), a.o_s1 = out.stride(1);
  a.k_sb = k_cache.stride(0), a.k_sh = k_cache.stride(1), a.v_sb = v_cache.stride(0), a.v_sh = v_cache.stride(1);
  a.scale = static_cast<float>(scale), a.window = window;
  return a;
}
#endif

void check_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && out.sizes() == q.sizes() && out.stride(2) == 1,
              "q/out: [T, H, D], last dim contiguous");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
              out.scalar_type() == at::kBFloat16, "bfloat16 only");
  TORCH_CHECK(k_cache.dim() == 5 && v_cache.dim() == 5 && k_cache.size(4) == 2 && v_cache.size(4) == 2,
              "caches: the paged layout [NB, Hkv, ., ., 2]");
  const int64_t D = q.size(2), B = v_cache.size(2) * 2;
  TORCH_CHECK(k_cache.size(2) * 2 == D && k_cache.size(3) == B && v_cache.size(3) == D && k_cache.stride(3) == 2 &&
              k_cache.stride(2) == B * 2 && v_cache.stride(3) == 2 && v_cache.stride(2) == D * 2,
              "each (block, head) of the cache must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "heads must be a multiple of kv heads");
}

}  // namespace

// True when this build and CPU can run the kernel for this head_dim and block size.
bool prefill_attention_amx_supported(int64_t head_dim, int64_t block_size) {
#if defined(PAGELLM_AMX_ATTENTION)
  return request_amx() && head_dim % 32 == 0 && head_dim <= 128 && block_size % 16 == 0;
#else
  (void)head_dim, (void)block_size;
  return false;
#endif
}

// Attention for the rows of every request with more than min_query_len query rows (others are left untouched).
// q [T, H, D], caches in the paged layout, block_tables [R, MB], seq_lens [R], query_start [R + 1]; bf16.
void prefill_attention_amx(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start,
                           at::Tensor out, double scale, int64_t window, int64_t min_query_len) {
  check_inputs(q, k_cache, v_cache, out);
  const int64_t D = q.size(2), B = v_cache.size(2) * 2;
  TORCH_CHECK(prefill_attention_amx_supported(D, B), "prefill_attention_amx: needs AMX, head_dim % 32 == 0 "
              "(at most 128) and block_size % 16 == 0; got head_dim ", D, ", block_size ", B);
  for (const at::Tensor* t : {&block_tables, &seq_lens, &query_start})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "indices must be contiguous int64");
#if defined(PAGELLM_AMX_ATTENTION)
  Args a = make_args(q, k_cache, v_cache, out, scale, window);
  a.MB = block_tables.size(1);
  a.bt = block_tables.data_ptr<int64_t>(), a.seq = seq_lens.data_ptr<int64_t>(), a.qs = query_start.data_ptr<int64_t>();
  std::vector<Task> tasks;
  for (int64_t r = 0; r < seq_lens.size(0); ++r) {
    const int64_t qlen = a.qs[r + 1] - a.qs[r];
    TORCH_CHECK(qlen >= 0 && qlen <= a.seq[r], "request ", r, ": ", qlen, " query rows for a context of ", a.seq[r]);
    if (qlen <= min_query_len) continue;
    // Cost: kv head major, then largest first. A core's next task then mostly reads the same head's keys and
    // values, still in its L2 (the three heads' K/V of a 7,000-token context, 5.4 MB, are more than an L2 holds):
    // 2% off the case in the header with the values in place.
    for (int64_t i0 = 0; i0 < qlen; i0 += kRows)
      for (int64_t h = 0; h < a.Hkv; ++h)
        tasks.push_back({r, h, i0, std::min(kRows, qlen - i0),
                         (a.Hkv - h) * kHeadMajor + a.seq[r] - qlen + i0 + kRows});
  }
  run_tasks(a, tasks, q, k_cache, v_cache, out);
#endif
}

// Cascade attention's shared part: every row of q [R, H, D] (one decode token of each request sharing the
// prefix) attends to all keys of the prefix held in blocks, without a mask -> out, and each row's log-sum-exp
// -> lse [R, H] (fp32) for merging with the rest of its context.
void prefix_attention_amx(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& blocks, at::Tensor out, at::Tensor lse, double scale) {
  check_inputs(q, k_cache, v_cache, out);
  const int64_t D = q.size(2), B = v_cache.size(2) * 2;
  TORCH_CHECK(prefill_attention_amx_supported(D, B), "prefix_attention_amx: needs AMX, head_dim % 32 == 0 "
              "(at most 128) and block_size % 16 == 0; got head_dim ", D, ", block_size ", B);
  TORCH_CHECK(blocks.scalar_type() == at::kLong && blocks.is_contiguous() && blocks.numel() > 0,
              "blocks: contiguous int64, at least one");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.dim() == 2 && lse.size(0) == q.size(0) &&
              lse.size(1) == q.size(1) && lse.stride(1) == 1, "lse: float32 [R, H]");
#if defined(PAGELLM_AMX_ATTENTION)
  Args a = make_args(q, k_cache, v_cache, out, scale, 0);
  const int64_t R = q.size(0), L = blocks.numel() * B, qs[2] = {0, R};
  a.MB = blocks.numel(), a.bt = blocks.data_ptr<int64_t>(), a.seq = &L, a.qs = qs;
  a.causal = false, a.lse = lse.data_ptr<float>(), a.lse_s0 = lse.stride(0);
  std::vector<Task> tasks;
  for (int64_t i0 = 0; i0 < R; i0 += kRows)
    for (int64_t h = 0; h < a.Hkv; ++h) tasks.push_back({0, h, i0, std::min(kRows, R - i0), L});
  run_tasks(a, tasks, q, k_cache, v_cache, out);
#endif
}

// Cascade attention for the rows sharing a prefix: out[rows] holds each row's attention over the rest of its
// context (its log-sum-exp in lse [T, H]); this attends the shared prefix's blocks for all those rows at once and
// merges the two parts, the prefix weighing sigmoid(lse_prefix - lse_rest), its share of the softmax mass.
void cascade_prefix_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& blocks, const at::Tensor& rows, at::Tensor out, const at::Tensor& lse,
                              double scale) {
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "rows: int64 [R]");
  const at::Tensor qr = q.index_select(0, rows);
  at::Tensor o1 = at::empty_like(qr), lse1 = at::empty({qr.size(0), qr.size(1)}, lse.options());
  prefix_attention_amx(qr, k_cache, v_cache, blocks, o1, lse1, scale);
  const at::Tensor w1 = at::sigmoid(lse1 - lse.index_select(0, rows)).unsqueeze(-1);
  const at::Tensor merged = out.index_select(0, rows).to(at::kFloat).lerp_(o1.to(at::kFloat), w1);
  out.index_copy_(0, rows, merged.to(out.scalar_type()));
}

TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("cascade_prefix_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor blocks, Tensor rows, "
        "Tensor(a!) out, Tensor lse, float scale) -> ()");
  m.impl("cascade_prefix_attention", c10::DispatchKey::CPU, &cascade_prefix_attention);
  m.def("prefill_attention_amx(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start, Tensor(a!) out, float scale, int window, int min_query_len) -> ()");
  m.impl("prefill_attention_amx", c10::DispatchKey::CPU, &prefill_attention_amx);
  m.def("prefix_attention_amx(Tensor q, Tensor k_cache, Tensor v_cache, Tensor blocks, Tensor(a!) out, "
        "Tensor(b!) lse, float scale) -> ()");
  m.impl("prefix_attention_amx", c10::DispatchKey::CPU, &prefix_attention_amx);
  m.def("prefill_attention_amx_supported(int head_dim, int block_size) -> bool",
        [](int64_t d, int64_t b) { return prefill_attention_amx_supported(d, b); });
}
