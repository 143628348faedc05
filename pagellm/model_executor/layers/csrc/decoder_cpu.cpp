// The decoder layer stack of a Llama-family model in one C++ call: bf16 on a CPU with AMX, or with AVX-512 or AVX2
// and FMA but no AMX (where the AMX prefill kernel is missing, the paged kernel takes chunks of any length:
// cpu_attention.py).
//
// Why: a layer is ten kernel calls, and at a few rows each kernel takes only tens of microseconds. Driven from
// Python every call also pays the interpreter, nn.Module and the dispatcher: one request decoded 15.2-16.3 ms per
// token that way against 10.4-10.7 ms with this loop (in-process, alternating). Here the loop over layers and the
// calls run in C++, straight to the kernels' entry points (ops.h). The kernels and the routing between them are
// the Python path's (models/llama.py with layers/linear.py and layers/cpu_attention.py), which stays for fp32,
// CPUs without AMX, Qwen3's q/k norms and the tests that hold the two paths equal.
//
// Per layer, with the residual stream kept apart so each skip-add fuses into the next norm:
//   h = add_rms_norm(h, residual)  (layer 0: rms_norm of the embeddings, which become the residual)
//   qkv = linear(h); rotary(q, k) in place; o = attention(q, cache) after writing k, v into the paged cache (the
//   attention kernel writes each decode row just before reading its blocks)
//   h = linear(o); h = add_rms_norm(h, residual); h = linear(silu(gate) * up), [gate | up] = linear(h) with the
//   product in the tile GEMM's epilogue (amx_linear_silu_mul, fma_linear_silu_mul)
// A linear takes the tile kernel on its pre-packed weight up to amx_max_rows rows (by default every row count, see
// layers/linear.py), oneDNN (at::mm) above: AMX's, else the FMA one above gemv_max_rows rows and the streaming
// kernel on the plain weight up to it, except with the FMA kernel's dot products, which take every row count (the
// routing of layers/linear.py's CPULinear, so the two loops agree); a linear
// with a GGUF file's blocks takes them up to gemv_max_rows rows, with AMX too (gguf_linear_cpu.cpp; a 4-bit one
// with x in int8, gguf_int8_linear_cpu.cpp).
// Attention: the paged kernel for decode rows and short chunks (without AMX, every chunk), the AMX prefill kernel
// for longer chunks, and for a cascade step the shared prefix once for all its requests, merged by log-sum-exp.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "ops.h"

namespace {

// A profiler range (what `pagellm bench throughput --profile` reads); nearly free when no profiler runs.
#define PAGELLM_RANGE(name) RECORD_FUNCTION(name, c10::ArrayRef<const c10::IValue>{})

struct Linear {
  at::Tensor packed, weight;  // AMX B-tile order (layers/linear.py: pack_amx, or pack_fp16), and plain [N, K]
  c10::optional<at::Tensor> bias;
  double w_inv = 1.0;  // an fp16 packed weight's scale (pack_fp16), for the FMA kernel
  // a GGUF's quants (layers/quantized.py: GGUFWeight), none if empty; several parts for a fused weight of mixed
  // layouts (GGUFParts), each into the next columns of the output
  std::vector<at::Tensor> gguf_qs, gguf_scales;
  // per part: a 4-bit part's regrouped blocks, outlier channels and values for gguf_int8_linear, undefined for
  // gguf_linear
  std::vector<at::Tensor> gguf_i8_qs, gguf_i8_scales, gguf_channels, gguf_wc;
  at::Tensor q4, q4_scales;  // a 4-bit GGUF weight's nibbles for AMX (amx_q4_panels.h), undefined if none
  // its quants for the int8 dot products and their outlier channels (vnni_int8_linear_cpu.cpp), undefined if none
  at::Tensor q8, q8_scales, q8_channels, q8_wc;
};

struct Layer {
  at::Tensor input_norm, post_norm;
  Linear qkv, o, gate_up, down;
  int64_t window = 0;  // sliding window (0: none)
  at::Tensor k_cache, v_cache;  // the paged views of this layer's cache (bind_cache)
};

class LlamaDecoder : public torch::CustomClassHolder {
 public:
  LlamaDecoder(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate, double eps,
               double scale, int64_t amx_max_rows, int64_t kernel_max_query, int64_t gemv_max_rows,
               bool attention_fp16_sums, bool fma_dot, int64_t amx_q4_max_rows)
      : H_(num_heads), Hkv_(num_kv_heads), D_(head_dim), I_(intermediate), eps_(eps), scale_(scale),
        amx_max_rows_(amx_max_rows), kernel_max_query_(kernel_max_query),
        fp16_sums_(attention_fp16_sums), fma_dot_(fma_dot), amx_(amx_linear_supported()),
        gemv_max_rows_(!amx_ && !fma_dot && small_m_linear_supported() ? gemv_max_rows : 0),
        gguf_max_rows_(gemv_max_rows), amx_q4_max_rows_(amx_ ? amx_q4_max_rows : 0) {
    TORCH_CHECK(amx_ || fma_linear_supported(), "LlamaDecoder needs AMX-BF16, AVX-512 or AVX2 with FMA");
  }

  // weights: input_norm, post_norm, then (packed, plain, bias, GGUF qs, GGUF scales) for qkv, o, gate_up, down;
  // an empty bias: none, empty GGUF tensors: none, an empty packed weight: none (a 4-bit weight whose int8 kernels
  // take every row count, layers/linear.py: CPULinear.set_gguf). w_inv: the four packed weights' scales (1 but for the FMA
  // kernel's fp16 copies, which it needs AVX512-FP16 for).
  void add_layer(std::vector<at::Tensor> w, int64_t window, std::vector<double> w_inv) {
    TORCH_CHECK(w.size() == 22 && w_inv.size() == 4, "add_layer: 22 tensors and 4 scales, got ", w.size(), ", ",
                w_inv.size());
    TORCH_CHECK(w[0].scalar_type() == at::kBFloat16 && w[1].scalar_type() == at::kBFloat16, "bfloat16 norms only");
    auto linear = [&](size_t i) {
      TORCH_CHECK(w[i].scalar_type() == at::kBFloat16 || (!amx_ && w[i].scalar_type() == at::kHalf),
                  "LlamaDecoder: bfloat16 weights only (the FMA kernel's packed copies may be fp16)");
      TORCH_CHECK(w[i + 1].scalar_type() == at::kBFloat16 && w[i + 2].scalar_type() == at::kBFloat16,
                  "LlamaDecoder: bfloat16 weights and biases only");
      Linear l{w[i], w[i + 1], c10::nullopt, w_inv[(i - 2) / 5]};
      if (w[i + 2].numel() > 0) l.bias = w[i + 2];
      if (w[i + 3].numel() > 0) l.gguf_qs = {w[i + 3]}, l.gguf_scales = {w[i + 4]};
      return l;
    };
    Layer layer{w[0], w[1], linear(2), linear(7), linear(12), linear(17), window};
    TORCH_CHECK(layer.qkv.weight.size(0) == (H_ + 2 * Hkv_) * D_ && layer.gate_up.weight.size(0) == 2 * I_,
                "add_layer: weight shapes do not match the model's");
    layers_.push_back(std::move(layer));
  }

  // A further part of linear `which` (0-3: qkv, o, gate_up, down) of the last layer added: its rows follow the
  // previous parts' in the output (layers/quantized.py: GGUFParts).
  void add_gguf_part(int64_t which, at::Tensor qs, at::Tensor scales) {
    TORCH_CHECK(!layers_.empty() && which >= 0 && which < 4, "add_gguf_part: a linear (0-3) of an added layer");
    Layer& L = layers_.back();
    Linear& l = which == 0 ? L.qkv : which == 1 ? L.o : which == 2 ? L.gate_up : L.down;
    TORCH_CHECK(!l.gguf_qs.empty(), "add_gguf_part: the linear has no first part");
    l.gguf_qs.push_back(qs), l.gguf_scales.push_back(scales);
  }

  // Part `part` of linear `which` (0-3) of the last layer added takes gguf_int8_linear on these regrouped blocks,
  // outlier channels and values (layers/linear.py: CPULinear.gguf_int8, gguf_int8_form; the same tensors, so both
  // loops share the first call's choice).
  void set_gguf_int8(int64_t which, int64_t part, at::Tensor qs, at::Tensor scales, at::Tensor channels,
                     at::Tensor wc) {
    TORCH_CHECK(!layers_.empty() && which >= 0 && which < 4, "set_gguf_int8: a linear (0-3) of an added layer");
    Layer& L = layers_.back();
    Linear& l = which == 0 ? L.qkv : which == 1 ? L.o : which == 2 ? L.gate_up : L.down;
    TORCH_CHECK(part >= 0 && part < static_cast<int64_t>(l.gguf_qs.size()), "set_gguf_int8: no such GGUF part");
    const size_t parts = l.gguf_qs.size();
    l.gguf_i8_qs.resize(parts), l.gguf_i8_scales.resize(parts), l.gguf_channels.resize(parts), l.gguf_wc.resize(parts);
    l.gguf_i8_qs[part] = qs, l.gguf_i8_scales[part] = scales, l.gguf_channels[part] = channels, l.gguf_wc[part] = wc;
  }

  // Linear `which` (0-3) of the last layer added takes amx_q4_linear on these nibbles and scales past
  // gguf_max_rows rows, up to amx_q4_max_rows (layers/linear.py: CPULinear.amx_q4).
  void set_amx_q4(int64_t which, at::Tensor q4, at::Tensor scales) {
    TORCH_CHECK(!layers_.empty() && which >= 0 && which < 4, "set_amx_q4: a linear (0-3) of an added layer");
    Layer& L = layers_.back();
    Linear& l = which == 0 ? L.qkv : which == 1 ? L.o : which == 2 ? L.gate_up : L.down;
    l.q4 = q4, l.q4_scales = scales;
  }

  // Linear `which` (0-3) of the last layer added takes vnni_int8_linear on these quants, scales and outlier channels
  // past gguf_max_rows rows (layers/linear.py: CPULinear.vnni_int8; the same tensors, so both loops share the
  // channels the first call chooses).
  void set_vnni_int8(int64_t which, at::Tensor q8, at::Tensor scales, at::Tensor channels, at::Tensor wc) {
    TORCH_CHECK(!layers_.empty() && which >= 0 && which < 4, "set_vnni_int8: a linear (0-3) of an added layer");
    Layer& L = layers_.back();
    Linear& l = which == 0 ? L.qkv : which == 1 ? L.o : which == 2 ? L.gate_up : L.down;
    l.q8 = q8, l.q8_scales = scales, l.q8_channels = channels, l.q8_wc = wc;
  }

  // The per-layer views of the KV cache, [NB, Hkv, D/x, B, x] and [NB, Hkv, B/x, D, x] (cpu_attention.views; x = 2
  // for bf16, 4 for an fp8 cache).
  void bind_cache(std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches) {
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(), "one cache per layer");
    for (size_t l = 0; l < layers_.size(); ++l) layers_[l].k_cache = k_caches[l], layers_[l].v_cache = v_caches[l];
    // as cpu_attention.py decides: without the AMX prefill kernel (no AMX, a head_dim / block size it does not
    // take, or an fp8 cache) the paged kernel runs every chunk (the caller passes kernel_max_query without limit)
    amx_prefill_ = !v_caches.empty() && v_caches[0].scalar_type() == at::kBFloat16 &&
                   prefill_attention_amx_supported(D_, v_caches[0].size(2) * v_caches[0].size(4));
  }

  // x: the embeddings [T, hidden] (taken over as the residual stream). Returns (last layer's output, residual);
  // the caller adds them in the final norm. prefill: some request has more than one query row.
  // keep_rows (optional): the only rows whose output the caller uses (those it takes logits of), each with its
  // request (keep_req) and its context length, position + 1 (keep_seq). The last layer then computes K and V for
  // every row, which the cache needs, but attention, O and the MLP only for these rows, and returns just them, in
  // keep_rows' order: in a prefill step all but a few rows are dropped after that layer anyway.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor slot_mapping,
                                             at::Tensor block_tables, at::Tensor seq_lens, at::Tensor query_start,
                                             bool prefill, c10::optional<at::Tensor> cascade_blocks,
                                             c10::optional<at::Tensor> cascade_rows,
                                             c10::optional<at::Tensor> cascade_kv_start,
                                             c10::optional<at::Tensor> keep_rows, c10::optional<at::Tensor> keep_req,
                                             c10::optional<at::Tensor> keep_seq) {
    TORCH_CHECK(!layers_.empty() && layers_[0].k_cache.defined(), "LlamaDecoder: no layers or no bound cache");
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "x: bf16 [T, hidden]");
    const int64_t T = x.size(0), q_size = H_ * D_, kv_size = Hkv_ * D_;
    const auto opts = x.options();
    at::Tensor residual = x, h = at::empty_like(x);
    at::Tensor qkv = at::empty({T, q_size + 2 * kv_size}, opts), attn = at::empty({T, H_, D_}, opts);
    at::Tensor act = activation_buffer(T, opts);
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({T, H_, D_});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, Hkv_, D_});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, Hkv_, D_});
    const bool cascade = cascade_blocks.has_value() && cascade_blocks->defined();
    at::Tensor lse = cascade ? at::empty({T, H_}, opts.dtype(at::kFloat)) : at::Tensor();

    const bool prune = keep_rows.has_value() && keep_rows->defined();
    TORCH_CHECK(!prune || (keep_req.has_value() && keep_seq.has_value() && keep_req->size(0) == keep_rows->size(0) &&
                           keep_seq->size(0) == keep_rows->size(0)), "keep_rows, keep_req, keep_seq: one entry each");
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& L = layers_[l];
      {
        PAGELLM_RANGE("pagellm.layer.attention");
        norm(l == 0, residual, h, L.input_norm);
        linear(h, L.qkv, qkv);
        {
          PAGELLM_RANGE("pagellm::rotary_embedding");
          rotary_embedding(q, k, cos, sin);
        }
        {
          PAGELLM_RANGE("pagellm.attention_backend");
          if (prune && l + 1 == layers_.size()) {
            {
              PAGELLM_RANGE("pagellm::write_kv_cache");
              write_kv_cache(k, v, L.k_cache, L.v_cache, slot_mapping);
            }
            return kept_rows_rest(L, residual, h, q, block_tables, *keep_rows, *keep_req, *keep_seq);
          }
          const bool casc = cascade && L.window == 0;
          {
            PAGELLM_RANGE("pagellm::paged_attention");  // writes this step's k, v into the cache first
            paged_attention(q, L.k_cache, L.v_cache, block_tables, seq_lens, query_start, attn, scale_, L.window,
                            kernel_max_query_, casc ? cascade_kv_start : c10::nullopt,
                            casc ? c10::optional<at::Tensor>(lse) : c10::nullopt, fp16_sums_, k, v, slot_mapping);
          }
          if (casc) {
            PAGELLM_RANGE("pagellm::cascade_prefix_attention");
            cascade_prefix_attention(q, L.k_cache, L.v_cache, *cascade_blocks, *cascade_rows, attn, lse, scale_);
          }
          if (prefill && amx_prefill_) {
            PAGELLM_RANGE("pagellm::prefill_attention_amx");
            prefill_attention_amx(q, L.k_cache, L.v_cache, block_tables, seq_lens, query_start, attn, scale_,
                                  L.window, kernel_max_query_);
          }
        }
        linear(attn.view({T, q_size}), L.o, h);
      }
      PAGELLM_RANGE("pagellm.layer.mlp");
      norm(false, residual, h, L.post_norm);
      gate_up_act(h, L.gate_up, act);
      linear(act, L.down, h);
    }
    return {h, residual};
  }

 private:
  // The last layer past its K/V write, for the kept rows only (forward's keep_rows): each kept row attends as a
  // request of one row whose context ends at its own position, so any set of rows works (several of one request).
  std::tuple<at::Tensor, at::Tensor> kept_rows_rest(const Layer& L, const at::Tensor& residual, const at::Tensor& h,
                                                    const at::Tensor& q, const at::Tensor& block_tables,
                                                    const at::Tensor& rows, const at::Tensor& req,
                                                    const at::Tensor& seq) const {
    PAGELLM_RANGE("pagellm.layer.last_kept_rows");
    const int64_t n = rows.size(0), hidden = h.size(1);
    at::Tensor hk = at::empty({n, hidden}, h.options()), rk = residual.index_select(0, rows);
    if (n == 0) return {hk, rk};
    const at::Tensor qk = q.index_select(0, rows);
    at::Tensor attn = at::empty_like(qk);
    paged_attention(qk, L.k_cache, L.v_cache, block_tables.index_select(0, req), seq,
                    at::arange(n + 1, seq.options()), attn, scale_, L.window, kernel_max_query_, c10::nullopt,
                    c10::nullopt);
    linear(attn.view({n, H_ * D_}), L.o, hk);
    norm(false, rk, hk, L.post_norm);
    at::Tensor act = activation_buffer(n, h.options());
    gate_up_act(hk, L.gate_up, act);
    linear(act, L.down, hk);
    return {hk, rk};
  }

  // first: h = rms_norm(residual); else residual += h, h = rms_norm(residual) (in place)
  void norm(bool first, at::Tensor& residual, at::Tensor& h, const at::Tensor& weight) const {
    PAGELLM_RANGE("pagellm::add_rms_norm");
    if (first) rms_norm(residual, weight, h, eps_);
    else add_rms_norm(h, residual, weight, eps_);
  }

  static const at::Tensor& packed(const Linear& l) {
    TORCH_CHECK(l.packed.numel() > 0, "LlamaDecoder: a linear without its packed weight took the tile kernels");
    return l.packed;
  }
  bool takes_gguf(const Linear& l, int64_t rows) const { return !l.gguf_qs.empty() && rows <= gguf_max_rows_; }
  bool takes_q4(const Linear& l, int64_t rows) const {
    return l.q4.defined() && rows > gguf_max_rows_ && rows <= amx_q4_max_rows_;
  }
  bool takes_q8(const Linear& l, int64_t rows) const { return l.q8.defined() && rows > gguf_max_rows_; }

  void linear(const at::Tensor& x, const Linear& l, at::Tensor out) const {
    if (takes_gguf(l, x.size(0))) {
      int64_t col = 0;
      for (size_t p = 0; p < l.gguf_qs.size(); ++p) {
        const int64_t n = l.gguf_qs[p].size(0);
        c10::optional<at::Tensor> bias;
        if (l.bias) bias = l.bias->narrow(0, col, n);
        if (p < l.gguf_channels.size() && l.gguf_channels[p].defined()) {
          PAGELLM_RANGE("pagellm::gguf_int8_linear");
          gguf_int8_linear(x, l.gguf_i8_qs[p], l.gguf_i8_scales[p], l.gguf_channels[p], l.gguf_wc[p], bias,
                           out.narrow(1, col, n));
        } else {
          PAGELLM_RANGE("pagellm::gguf_linear");
          gguf_linear(x, l.gguf_qs[p], l.gguf_scales[p], bias, out.narrow(1, col, n));
        }
        col += n;
      }
    } else if (takes_q4(l, x.size(0))) {
      PAGELLM_RANGE("pagellm::amx_q4_linear");
      amx_q4_linear(x, l.q4, l.q4_scales, l.bias, out, false);
    } else if (takes_q8(l, x.size(0))) {
      PAGELLM_RANGE("pagellm::vnni_int8_linear");
      vnni_int8_linear(x, l.q8, l.q8_scales, l.q8_channels, l.q8_wc, l.bias, out, false);
    } else if (x.size(0) <= gemv_max_rows_) {
      PAGELLM_RANGE("pagellm::small_m_linear");
      small_m_linear(x, l.weight, l.bias, out);
    } else if (x.size(0) <= amx_max_rows_ && amx_) {
      PAGELLM_RANGE("pagellm::amx_linear");
      amx_linear(x, packed(l), l.bias, out);
    } else if (x.size(0) <= amx_max_rows_) {
      PAGELLM_RANGE("pagellm::fma_linear");
      fma_linear(x, packed(l), l.bias, out, l.w_inv, fma_dot_);
    } else if (l.bias.has_value()) {
      at::addmm_out(out, *l.bias, x, l.weight.t());
    } else {
      at::mm_out(out, x, l.weight.t());
    }
  }

  // act = silu(gate) * up for [gate | up] = linear(h): one AMX call with the product in its epilogue where it
  // applies (amx_linear_silu_mul, bit for bit the two steps' result), else the linear into a gate_up buffer and
  // silu_and_mul. SmolLM2's 30 gate/up layers (`python bench/kernels.py`): 240 against 251 ms at 2,048 rows, 12.5
  // against 13.3 ms at 64; with the epilogue changes of the same day, workload_64's 2,048-token prefill steps in
  // 6 process pairs: median 456 against 501 ms (docs/performance-log.md).
  void gate_up_act(const at::Tensor& h, const Linear& l, at::Tensor act) const {
    const int64_t T = h.size(0);
    if (takes_q8(l, T) && I_ % 16 == 0) {
      PAGELLM_RANGE("pagellm::vnni_int8_linear_silu_mul");
      vnni_int8_linear(h, l.q8, l.q8_scales, l.q8_channels, l.q8_wc, l.bias, act, true);
      return;
    }
    if (T <= amx_max_rows_ && T > gemv_max_rows_ && I_ % 16 == 0 && !takes_gguf(l, T)) {
      if (takes_q4(l, T)) {
        PAGELLM_RANGE("pagellm::amx_q4_linear_silu_mul");
        amx_q4_linear(h, l.q4, l.q4_scales, l.bias, act, true);
      } else if (amx_) {
        PAGELLM_RANGE("pagellm::amx_linear_silu_mul");
        amx_linear_silu_mul(h, packed(l), l.bias, act);
      } else {
        PAGELLM_RANGE("pagellm::fma_linear_silu_mul");
        fma_linear_silu_mul(h, packed(l), l.bias, act, l.w_inv, fma_dot_);
      }
      return;
    }
    at::Tensor gate_up = at::empty({T, 2 * I_}, h.options());
    linear(h, l, gate_up);
    PAGELLM_RANGE("pagellm::silu_and_mul");
    silu_and_mul(gate_up, act);
  }

  // [T, I] whose rows lie an odd number of cache lines apart: written a 32-column block (one line per row) at a
  // time, rows a power-of-two multiple of 64 bytes apart share a few L1 sets (SmolLM2's 3 KiB: 4 of 64).
  at::Tensor activation_buffer(int64_t T, const at::TensorOptions& opts) const {
    const int64_t line = 64 / static_cast<int64_t>(sizeof(at::BFloat16)), lines = (I_ + line - 1) / line;
    return at::empty({T, (lines | 1) * line}, opts).narrow(1, 0, I_);
  }

  int64_t H_, Hkv_, D_, I_;
  double eps_, scale_;
  int64_t amx_max_rows_, kernel_max_query_;
  bool fp16_sums_;         // paged attention's fp16 partial sums (CPUPagedAttention.fp16_sums)
  bool fma_dot_;           // the FMA kernel's bf16 dot products (CPUKernels.fma_dot)
  bool amx_;               // the AMX linear kernels, else the FMA one
  bool amx_prefill_ = false;  // the AMX prefill attention kernel (bind_cache)
  int64_t gemv_max_rows_;  // the streaming kernel up to this many rows (without AMX or the dot products; 0: never)
  int64_t gguf_max_rows_;  // a linear with GGUF blocks takes them up to this many rows (CPULinear's GEMV_MAX_ROWS)
  int64_t amx_q4_max_rows_;  // and one with AMX nibbles those up to this many (CPULinear's AMX_Q4_MAX_ROWS)
  std::vector<Layer> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.class_<LlamaDecoder>("LlamaDecoder")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, double, double, int64_t, int64_t, int64_t, bool, bool,
                       int64_t>())
      .def("add_layer", &LlamaDecoder::add_layer)
      .def("add_gguf_part", &LlamaDecoder::add_gguf_part)
      .def("set_gguf_int8", &LlamaDecoder::set_gguf_int8)
      .def("set_amx_q4", &LlamaDecoder::set_amx_q4)
      .def("set_vnni_int8", &LlamaDecoder::set_vnni_int8)
      .def("bind_cache", &LlamaDecoder::bind_cache)
      .def("forward", &LlamaDecoder::forward);
}
