// Paged attention for CPU: the KV-cache layout, the cache writer and one attention kernel for a whole step
// (prefill chunks and decode rows mixed), reading K/V in place from the blocks.
//
// Cache layout of one layer, with x = 4 / sizeof(T) elements per 32-bit word (2 for bf16/fp16, 1 for fp32):
//   k_cache [NB, Hkv, D/x, B, x]  one word row per pair of dims: dims (2j, 2j+1) of the block's B tokens
//   v_cache [NB, Hkv, B/x, D, x]  one word row per pair of tokens: tokens (2i, 2i+1) for all D dims
// With K "pair-major", q.k for 16 tokens is a chain of FMAs into one 16-lane accumulator (token i in lane i),
// so no per-token horizontal sum is needed; splitting a word into its two bf16 halves is a shift and a mask.
// With V "token-pair-major", one load feeds two tokens' weights into 16 output dims. Every (block, kv head)
// is one contiguous run of B*D elements for K and for V, which the hardware prefetcher streams well.
//
// paged_attention: q [T, H, D] (rows may be strided); request r owns rows query_start[r] .. query_start[r+1]-1,
// the last positions of its context of seq_lens[r] tokens held in block_tables[r]. A task is (request, kv
// head, up to 16 consecutive query rows), or with many requests (request, all kv heads, rows): it reads the
// keys and values once for all its rows and the G = H/Hkv query heads sharing each kv head (GQA), block by
// block, computes every score (fp32), a causal (and sliding-window) softmax
// per row, then the weighted sum of values (fp32). A decode row is simply a task of one row. Threads take
// tasks, largest first, from a shared counter. Requests with more than max_query_len rows are skipped: for long
// prefill chunks the caller's AMX-backed flash attention is faster than these FMA loops (measured crossover
// ~32 rows per request on this machine), so they are left to it.
// Cascade attention's suffix part: with kv_start, request r attends only to keys kv_start[r] onwards (the shared
// prefix before it is attended once for all requests, by prefix_attention_amx), and lse receives each row's
// log-sum-exp so the caller can merge the two parts.
// Tasks of at most 8 query vectors (decode rows) over a bf16 cache run on AMX tiles where the CPU has them
// (decode_attention_amx.h). With k_new / v_new / slot_mapping the call first writes this step's K/V rows into the
// cache, a decode row's inside its own tasks just before they read its blocks (kv_cache_write.h).
// fp16_sums (bf16/fp16 queries, CPUs with AVX512-FP16): prefill chunks run on an fp16 copy of their blocks with
// fp16 partial sums, attention_fp16.h. CPUs with AVX2 and FMA but no AVX-512: tasks over a bf16 cache take the
// same loops on 8-lane vectors, attention_avx2.h (other caches the portable loop). On AMD CPUs with AVX512-BF16
// (Args::dot) a bf16 cache's scores and weighted sums take VDPBF16PS, the weights rounded to bf16 for it.
// The AVX-512 loops of a task are attention_avx512.h; an fp8 cache's prefill chunks read a bf16 copy of their
// blocks made once per call, fp8_staging.h.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <numeric>
#include <utility>
#include <vector>

#include "attention_avx2.h"
#include "attention_avx512.h"
#include "attention_common.h"
#include "attention_fp16.h"
#include "decode_attention_amx.h"
#include "fp8_staging.h"
#include "kv_cache_write.h"
#include "ops.h"
#include "paged_attention_task.h"
#include "split_work.h"

namespace {
using namespace pagellm;
using namespace pagellm::paged;

// The portable loops (CPUs without AVX-512 or AVX2, or a head_dim the vectorised loops do not cover).
template <typename T>
void attend_generic(const Args& a, const Task& t, const float* qf, const T* kc, const T* vc, float* S,
                    float* of) {
  const Span s = span_of(a, t);
  const int64_t nv = t.nrows * a.G, D = a.D, B = a.B, base = s.b0 * B;
  for (int64_t tok = s.klo; tok < s.khi; ++tok) {
    const T* kb = kc + a.bt[t.r * a.MB + tok / B] * a.k_sb + t.h * a.k_sh;
    for (int64_t v = 0; v < nv; ++v) {
      float acc = 0.f;
      for (int64_t d = 0; d < D; ++d) acc += qf[v * D + d] * k_at(kb, B, tok % B, d);
      S[v * s.ns + tok - base] = acc;
    }
  }
  softmax_rows(a, t, s, S);
  std::fill(of, of + nv * D, 0.f);
  for (int64_t tok = s.klo; tok < s.khi; ++tok) {
    const T* vb = vc + a.bt[t.r * a.MB + tok / B] * a.v_sb + t.h * a.v_sh;
    for (int64_t v = 0; v < nv; ++v) {
      const float p = S[v * s.ns + tok - base];
      if (p == 0.f) continue;
      for (int64_t d = 0; d < D; ++d) of[v * D + d] += p * v_at(vb, D, tok % B, d);
    }
  }
}


// true when the vectorised kernel covers this head_dim (else the portable path runs)
inline bool vectorised(int64_t D) {
#if defined(__AVX512F__)
  return D == 16 || D == 32 || D == 64 || D == 96 || D == 128 || D == 256;
#else
  return false;
#endif
}

// A worker's buffers, kept between its tasks.
struct Scratch {
  std::vector<float> qf, S, of, qinv;
  std::vector<uint16_t> P;
  std::vector<uint16_t> q16;  // fp16 bits
  ReadAhead stream;           // decode tasks' (attention_avx512.h)
#if defined(PAGELLM_AMX_DECODE)
  AmxDecode amx;
#endif
};

// q, out: T; the cache: KV (T itself, or fp8). st: the requests read from a bf16 copy (see Staged); st16: the
// requests on the fp16 path, from its fp16 copy (attention_fp16.h). next: the thread's next task, or null.
template <typename T, typename KV>
void run_task(const Args& a, const Task& t, const T* qp, const KV* kc, const KV* vc, T* op, const Staged& st,
              const Staged16& st16, Scratch& w, const Task* next) {
  const Span s = span_of(a, t);
  const int64_t nv = t.nrows * a.G, D = a.D;
  w.of.resize(t.nh * nv * D);
  const int64_t row0 = a.qs[t.r] + t.i0;
  bool done = false;
#if defined(PAGELLM_AMX_DECODE)
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<KV, c10::BFloat16>)
    if (amx_decode_fits(a, nv)) {
      if (D == 64) attend_amx<2>(a, t, qp, kc, vc, w.of.data(), w.amx);
      else attend_amx<4>(a, t, qp, kc, vc, w.of.data(), w.amx);
      done = true;
    }
#endif
  w.qf.resize(t.nh * nv * D);
  // the scores, and with Args::dot one head's bf16 weights and the inverses of their sums
  w.S.resize(t.nh * nv * s.ns + nv * s.ns / 2 + nv);
  // fp8: a staged request's tasks run on the bf16 copy of its blocks; otherwise the vectorised kernel reads e4m3
  // keys scaled down (fp8_read_scale) and q takes the factor, exactly.
  const bool half = !st16.on.empty() && st16.on[t.r];
  const bool stage = !st.on.empty() && st.on[t.r];
  const float q_scale = a.scale * (vectorised(D) && !stage && !half ? fp8_read_scale<KV>() : 1.f);
  // the score dot products (Args::dot): qf then holds q's bf16 pairs as they are, at its even floats
  const bool dot = a.dot && !half && !stage && vectorised(D);
  // Head j of the task's kv heads holds its vectors j * nv .. j * nv + nv - 1 in qf, S and of.
  for (int64_t j = 0; j < t.nh && !done; ++j)
    for (int64_t i = 0; i < t.nrows; ++i)
      for (int64_t g = 0; g < a.G; ++g) {
        const T* q = qp + (row0 + i) * a.q_s0 + ((t.h + j) * a.G + g) * a.q_s1;
        float* f = w.qf.data() + ((j * t.nrows + i) * a.G + g) * D;
        if constexpr (sizeof(T) == 2)
          if (dot) {
            for (int64_t d = 0; d < D; d += 2) std::memcpy(f + d, q + d, 4);
            continue;
          }
        for (int64_t d = 0; d < D; ++d) f[d] = to_float(q[d]) * q_scale;
      }
#if defined(__AVX512FP16__)
  if (half && !done) {
    w.P.resize(t.nh * nv * s.ns), w.q16.resize(t.nh * nv * D), w.qinv.resize(t.nh * nv);
    done = attend16_dims(st16, t, w.qf.data(), w.S.data(), w.P.data(), reinterpret_cast<_Float16*>(w.q16.data()),
                         w.qinv.data(), w.of.data());
  }
#endif
#if defined(__AVX512F__)
  NextBlocks none(a, nullptr, kc, vc);
  if (!done && stage)
    done = attend_dims<c10::BFloat16>(st.a, t, w.qf.data(), st.k, st.v, w.S.data(), w.of.data(), none);
  if (!done && vectorised(D)) {
    Args ad = a;
    ad.dot = dot;
    // the next task's blocks only where it reads the cache itself (not a staged copy)
    const bool direct = next && !(!st.on.empty() && st.on[next->r]) && !(!st16.on.empty() && st16.on[next->r]);
    NextBlocks ahead(a, direct ? next : nullptr, kc, vc, qp);
    ahead.stream = &w.stream;
    done = attend_dims<KV>(ad, t, w.qf.data(), kc, vc, w.S.data(), w.of.data(), ahead);
  }
#elif defined(PAGELLM_HAS_AVX2)
  if constexpr (std::is_same_v<KV, c10::BFloat16>)
    if (!done && !stage) done = attend_avx2(a, t, w.qf.data(), kc, vc, w.S.data(), w.of.data());
#endif
  if (!done)
    for (int64_t j = 0; j < t.nh; ++j)
      attend_generic<KV>(a, one_head(t, j), w.qf.data() + j * nv * D, kc, vc, w.S.data() + j * nv * s.ns,
                        w.of.data() + j * nv * D);
  for (int64_t j = 0; j < t.nh; ++j)
    for (int64_t i = 0; i < t.nrows; ++i)
      for (int64_t g = 0; g < a.G; ++g) {
        T* o = op + (row0 + i) * a.o_s0 + ((t.h + j) * a.G + g) * a.o_s1;
        const float* f = w.of.data() + ((j * t.nrows + i) * a.G + g) * D;
        int64_t d = 0;
#if defined(__AVX512F__)
        if constexpr (!std::is_same_v<T, c10::Half>)  // store16: c10's rounding, bit for bit
          for (; d + 16 <= D; d += 16) store16(o + d, _mm512_loadu_ps(f + d));
#endif
        for (; d < D; ++d) o[d] = static_cast<T>(f[d]);
      }
}

template <typename T, typename KV>
void attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& bt,
               const at::Tensor& seq_lens, const at::Tensor& query_start, at::Tensor& out, double scale,
               int64_t window, int64_t max_query_len, const int64_t* kv_start, float* lse, int64_t lse_s0,
               bool fp16_sums, const KVRows<T, KV>* kw) {
  Args a;
  a.H = q.size(1), a.Hkv = k_cache.size(1), a.G = a.H / a.Hkv, a.D = q.size(2);
  a.B = v_cache.size(2) * v_cache.size(4), a.MB = bt.size(1);
  a.q_s0 = q.stride(0), a.q_s1 = q.stride(1), a.o_s0 = out.stride(0), a.o_s1 = out.stride(1);
  a.k_sb = k_cache.stride(0), a.k_sh = k_cache.stride(1), a.v_sb = v_cache.stride(0), a.v_sh = v_cache.stride(1);
  a.bt = bt.data_ptr<int64_t>(), a.seq = seq_lens.data_ptr<int64_t>(), a.qs = query_start.data_ptr<int64_t>();
  a.scale = static_cast<float>(scale), a.window = window;
  // bf16 scores and weighted sums by VDPBF16PS where the linears take it (AMD: at the FMA's rate, fma_linear_cpu.cpp)
  a.dot = std::is_same_v<T, c10::BFloat16> && std::is_same_v<KV, c10::BFloat16> && fma_linear_dot_default();
  a.kv_start = kv_start, a.lse = lse, a.lse_s0 = lse_s0;
  const int64_t R = seq_lens.size(0);
  // One task per request and kv head, or per request over all its kv heads when there are requests enough to
  // keep every thread busy: then each block's keys are read as one run of Hkv heads. 64 decodes x 30 layers,
  // ~360-token contexts, alternating in one process: 0.97-0.98x the time (blocks in order or shuffled).
  const int64_t heads_per_task = R >= 4 * at::get_num_threads() ? a.Hkv : 1;

  std::vector<Task> tasks;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t qlen = a.qs[r + 1] - a.qs[r];
    TORCH_CHECK(qlen >= 0 && qlen <= a.seq[r], "request ", r, ": ", qlen, " query rows for a context of ", a.seq[r]);
    TORCH_CHECK(!a.kv_start || (a.kv_start[r] >= 0 && a.kv_start[r] <= a.seq[r] - qlen), "request ", r,
                ": kv_start ", a.kv_start ? a.kv_start[r] : 0, " past its first query position ", a.seq[r] - qlen);
    if (qlen > max_query_len) continue;  // left to the caller
    for (int64_t i0 = 0; i0 < qlen; i0 += kTileRows)
      for (int64_t h = 0; h < a.Hkv; h += heads_per_task) {
        Task t{r, h, i0, std::min(kTileRows, qlen - i0), 0, heads_per_task};
        const Span s = span_of(a, t);
        t.cost = heads_per_task * t.nrows * (s.khi - s.klo) + 64;
        tasks.push_back(t);
      }
  }
  const T* qp = q.data_ptr<T>();
  const KV* kc = static_cast<const KV*>(k_cache.data_ptr());
  const KV* vc = static_cast<const KV*>(v_cache.data_ptr());
  T* op = out.data_ptr<T>();
  // Requests whose blocks are copied once per call: with fp16 sums (bf16/fp16 queries; fp32 keeps fp32 sums,
  // HF-exact) chunks of kFp16MinRows rows or more into fp16, else over an fp8 cache long chunks into bf16.
  Staged st;
  Staged16 st16;
  bool half = false;
#if defined(__AVX512FP16__)
  if constexpr (!std::is_same_v<T, float>) half = fp16_sums && fp16_dims(a.D);
#endif
  std::vector<char> want(R, 0);
  bool any = false;
  if (half || (is_fp8<KV>() && vectorised(a.D)))
    for (int64_t r = 0; r < R; ++r) {
      const int64_t qlen = a.qs[r + 1] - a.qs[r];
      want[r] = is_fp8<KV>() ? wants_staging(a, qlen, max_query_len) : qlen >= kFp16MinRows && qlen <= max_query_len;
      any = any || want[r];
    }
  // This step's K/V rows (kw): a request whose rows all fall in one row tile has them written by its own tasks,
  // each for its kv heads, right before it reads the same blocks (a decode row's key lands in its last block's
  // word rows, the lines its scores read next), so the writes' misses are the reads' misses; a separate pass over
  // all rows missed on every line twice a step. The other rows (longer chunks, staged requests, rows left to the
  // caller) are written first, in one pass, and so are a request's rows when another request of this call reads
  // a block they go to (a prefix-cache hit on a block filled in this very step).
  std::vector<char> fused;
  if (kw) {
    fused.assign(R, 0);
    std::vector<int32_t> writer(k_cache.size(0), -1);  // per block: the fused request writing it, -1: none
    for (int64_t r = 0; r < R; ++r) {
      const int64_t qlen = a.qs[r + 1] - a.qs[r];
      fused[r] = qlen > 0 && qlen <= kTileRows && qlen <= max_query_len && !want[r];
      for (int64_t i = a.qs[r]; i < a.qs[r + 1] && fused[r]; ++i) {
        if (kw->slots[i] < 0) continue;
        int32_t& w = writer[kw->slots[i] / a.B];
        if (w >= 0 && w != r) fused[w] = fused[r] = 0;  // two writers of one block: both first (the caller's odd
        w = static_cast<int32_t>(r);                      // batch; the engine's requests never share a block's tail)
      }
    }
    for (int64_t r = 0; r < R; ++r)
      if (a.qs[r + 1] - a.qs[r] <= max_query_len)  // read by this call's tasks
        for (int64_t b = 0; b * a.B < a.seq[r]; ++b) {
          const int32_t w = writer[a.bt[r * a.MB + b]];
          if (w >= 0 && w != r) fused[w] = 0;
        }
    std::vector<int64_t> rest;
    for (int64_t r = 0; r < R; ++r)
      if (!fused[r])
        for (int64_t i = a.qs[r]; i < a.qs[r + 1]; ++i) rest.push_back(i);
    for (int64_t i = a.qs[R]; i < q.size(0); ++i) rest.push_back(i);
    if (!rest.empty()) write_rows(*kw, static_cast<int64_t>(rest.size()), rest.data(), a.Hkv);
  }
  if (any) {
#if defined(__AVX512FP16__)
    if constexpr (!std::is_same_v<T, float>)
      if (half) stage_fp16<KV>(a, want, kc, vc, st16);
#endif
#if defined(__AVX512F__)
    if constexpr (is_fp8<KV>())
      if (!half) stage_requests<KV>(a, want, kc, vc, st);
#endif
  }
  run_largest_first(tasks, [&](auto next) {
    Scratch w;
    const Task* t = next();
    while (t) {
      const Task* ahead = next(true);  // claimed now, so that its first blocks come in during t's value pass
      if (kw && fused[t->r])
        for (int64_t i = a.qs[t->r]; i < a.qs[t->r + 1]; ++i) kw->write(i, t->h, t->h + t->nh);
      run_task<T, KV>(a, *t, qp, kc, vc, op, st, st16, w, ahead);
      t = ahead ? ahead : next();
    }
  });
}

// Copy the first ctx tokens of a block table out of the cache (KV) as T: k, v [Hkv, ctx, D] contiguous.
template <typename T, typename KV>
void gather_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& blocks, at::Tensor& k,
                  at::Tensor& v) {
  constexpr int x = pack_x<KV>();
  const int64_t Hkv = k.size(0), L = k.size(1), D = k.size(2), B = v_cache.size(2) * x;
  const KV* kc = static_cast<const KV*>(k_cache.data_ptr());
  const KV* vc = static_cast<const KV*>(v_cache.data_ptr());
  const int64_t* bt = blocks.data_ptr<int64_t>();
  T* kp = k.data_ptr<T>();
  T* vp = v.data_ptr<T>();
  at::parallel_for(0, Hkv * ((L + B - 1) / B), 8, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t nb = (L + B - 1) / B, h = task / nb, b = task % nb, n = std::min(B, L - b * B);
      const KV* kb = kc + bt[b] * k_cache.stride(0) + h * k_cache.stride(1);
      const KV* vb = vc + bt[b] * v_cache.stride(0) + h * v_cache.stride(1);
      T* kd = kp + (h * L + b * B) * D;
      T* vd = vp + (h * L + b * B) * D;
      for (int64_t t = 0; t < n; ++t)
        for (int64_t j = 0; j < D / x; ++j)
          for (int e = 0; e < x; ++e) kd[t * D + j * x + e] = static_cast<T>(to_float(kb[j * B * x + t * x + e]));
      for (int64_t i = 0; i < (n + x - 1) / x; ++i)
        for (int64_t d = 0; d < D; ++d)
          for (int e = 0; e < x && i * x + e < n; ++e)
            vd[(i * x + e) * D + d] = static_cast<T>(to_float(vb[(i * D + d) * x + e]));
    }
  });
}

void check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t D) {
  TORCH_CHECK(k_cache.dim() == 5 && v_cache.dim() == 5, "caches must be 5-d [NB, Hkv, ., ., x]");
  const int64_t x = k_cache.size(4), B = v_cache.size(2) * x;
  TORCH_CHECK(x * k_cache.element_size() == 4 && v_cache.size(4) == x, "x must pack 4 bytes");
  TORCH_CHECK(k_cache.size(2) * x == D && k_cache.size(3) == B && v_cache.size(3) == D, "cache / head_dim mismatch");
  TORCH_CHECK(k_cache.stride(4) == 1 && k_cache.stride(3) == x && k_cache.stride(2) == B * x &&
              v_cache.stride(4) == 1 && v_cache.stride(3) == x && v_cache.stride(2) == D * x,
              "each (block, head) of the cache must be contiguous");
  TORCH_CHECK(B % x == 0, "block size must be a multiple of ", x);
}

// This step's K/V rows for the cache: k, v [N, Hkv, D], slot_mapping int64 [N] (negative: skipped, else a slot
// of the cache).
void check_new_rows(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1, "k/v: [N, Hkv, D]");
  check_cache(k_cache, v_cache, k.size(2));
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k.scalar_type(), "dtype mismatch");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.numel() == k.size(0), "slot_mapping: int64 [N]");
  const int64_t slots = k_cache.size(0) * k_cache.size(3);
  const int64_t* sp = slot_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < k.size(0); ++i)
    TORCH_CHECK(sp[i] < slots, "slot_mapping[", i, "] = ", sp[i], " is past the cache's ", slots, " slots");
}

// Calls f(KV{}) for a cache of dtype t holding K/V for queries of type T: T itself, or fp8 (e4m3fn, e5m2).
template <typename T, typename F>
void dispatch_cache(c10::ScalarType t, c10::ScalarType q, const char* name, F&& f) {
  if (t == q) return f(T{});
  switch (t) {
    case c10::ScalarType::Float8_e4m3fn: return f(c10::Float8_e4m3fn{});
    case c10::ScalarType::Float8_e5m2: return f(c10::Float8_e5m2{});
    default: TORCH_CHECK(false, name, ": a ", t, " cache does not go with ", q, " (the same dtype, or fp8)");
  }
}

}  // namespace

void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start,
                     at::Tensor out, double scale, int64_t window, int64_t max_query_len,
                     const c10::optional<at::Tensor>& kv_start, c10::optional<at::Tensor> lse, bool fp16_sums,
                     const c10::optional<at::Tensor>& k_new, const c10::optional<at::Tensor>& v_new,
                     const c10::optional<at::Tensor>& slot_mapping) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && out.sizes() == q.sizes() && out.stride(2) == 1,
              "q/out: [T, H, D], last dim contiguous");
  const bool has_start = kv_start.has_value() && kv_start->defined(), has_lse = lse.has_value() && lse->defined();
  if (has_start)
    TORCH_CHECK(kv_start->scalar_type() == at::kLong && kv_start->is_contiguous() &&
                kv_start->numel() == seq_lens.numel(), "kv_start: contiguous int64 [R]");
  if (has_lse)
    TORCH_CHECK(lse->scalar_type() == at::kFloat && lse->dim() == 2 && lse->size(0) == q.size(0) &&
                lse->size(1) == q.size(1) && lse->stride(1) == 1, "lse: float32 [T, H]");
  check_cache(k_cache, v_cache, q.size(2));
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && out.scalar_type() == q.scalar_type(), "dtype mismatch");
  for (const at::Tensor* t : {&block_tables, &seq_lens, &query_start})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "indices must be contiguous int64");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == seq_lens.size(0) &&
              query_start.numel() == seq_lens.numel() + 1, "block_tables [R, MB], seq_lens [R], query_start [R+1]");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "heads must be a multiple of kv heads");
  const bool write = k_new.has_value() && k_new->defined();
  TORCH_CHECK(write == (v_new.has_value() && v_new->defined()) &&
              write == (slot_mapping.has_value() && slot_mapping->defined()),
              "k_new, v_new and slot_mapping go together");
  if (write) {
    check_new_rows(*k_new, *v_new, k_cache, v_cache, *slot_mapping);
    TORCH_CHECK(k_new->size(0) == q.size(0) && k_new->size(1) == k_cache.size(1) && k_new->scalar_type() == q.scalar_type(),
                "k_new/v_new: [T, Hkv, D] of q's rows and dtype");
  }
  // the cache is written in place (k_new); the tensors' handles stay const for the reading call sites
  at::Tensor kc = k_cache, vc = v_cache;
  pagellm::dispatch_float(q.scalar_type(), "paged_attention", [&](auto tag) {
    using T = decltype(tag);
    dispatch_cache<T>(k_cache.scalar_type(), q.scalar_type(), "paged_attention", [&](auto kv) {
      using KV = decltype(kv);
      const KVRows<T, KV> rows = write ? KVRows<T, KV>(*k_new, *v_new, kc, vc, *slot_mapping) : KVRows<T, KV>();
      attention<T, KV>(q, k_cache, v_cache, block_tables, seq_lens, query_start, out, scale, window, max_query_len,
                       has_start ? kv_start->data_ptr<int64_t>() : nullptr, has_lse ? lse->data_ptr<float>() : nullptr,
                       has_lse ? lse->stride(0) : 0, fp16_sums && kHasFp16Attention, write ? &rows : nullptr);
    });
  });
}

bool paged_attention_fp16_supported() { return kHasFp16Attention; }

void write_kv_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                    const at::Tensor& slot_mapping) {
  check_new_rows(k, v, k_cache, v_cache, slot_mapping);
  pagellm::dispatch_float(k.scalar_type(), "write_kv_cache", [&](auto tag) {
    using T = decltype(tag);
    dispatch_cache<T>(k_cache.scalar_type(), k.scalar_type(), "write_kv_cache", [&](auto kv) {
      using KV = decltype(kv);
      write_rows(KVRows<T, KV>(k, v, k_cache, v_cache, slot_mapping), k.size(0), nullptr, k.size(1));
    });
  });
}

void gather_kv_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& blocks, at::Tensor k,
                     at::Tensor v) {
  TORCH_CHECK(k.dim() == 3 && k.is_contiguous() && v.is_contiguous() && v.sizes() == k.sizes(), "k/v: [Hkv, L, D]");
  check_cache(k_cache, v_cache, k.size(2));
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k.scalar_type(), "dtype mismatch");
  const int64_t B = v_cache.size(2) * v_cache.size(4);
  TORCH_CHECK(blocks.scalar_type() == at::kLong && blocks.is_contiguous() && blocks.numel() * B >= k.size(1),
              "blocks: int64, enough for the context");
  pagellm::dispatch_float(k.scalar_type(), "gather_kv_cache", [&](auto tag) {
    using T = decltype(tag);
    dispatch_cache<T>(k_cache.scalar_type(), k.scalar_type(), "gather_kv_cache", [&](auto kv) {
      gather_cache<T, decltype(kv)>(k_cache, v_cache, blocks, k, v);
    });
  });
}

// Registered as torch.ops.pagellm.* (no pybind11: the build stays small and fast).
TORCH_LIBRARY(pagellm, m) {
  m.def("paged_attention(Tensor q, Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start, Tensor(a!) out, float scale, int window, int max_query_len, Tensor? kv_start=None, "
        "Tensor(b!)? lse=None, bool fp16_sums=False, Tensor? k_new=None, Tensor? v_new=None, "
        "Tensor? slot_mapping=None) -> ()");
  m.impl("paged_attention", c10::DispatchKey::CPU, &paged_attention);
  m.def("paged_attention_fp16_supported() -> bool", [] { return paged_attention_fp16_supported(); });
  m.def("write_kv_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.impl("write_kv_cache", c10::DispatchKey::CPU, &write_kv_cache);
  m.def("gather_kv_cache(Tensor k_cache, Tensor v_cache, Tensor blocks, Tensor(a!) k, Tensor(b!) v) -> ()");
  m.impl("gather_kv_cache", c10::DispatchKey::CPU, &gather_kv_cache);
}
