// The kernels' C++ entry points (each also registered as torch.ops.pagellm.*), for code in this library that
// calls them directly rather than through the dispatcher: the fused decoder (decoder_cpu.cpp), the LM head's
// screen (argmax_screen_cpu.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>

void rms_norm(const at::Tensor& x, const at::Tensor& weight, at::Tensor out, double eps);
void add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps);
void silu_and_mul(const at::Tensor& gate_up, at::Tensor out);
void rotary_embedding(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin);

bool amx_linear_supported();
void amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, at::Tensor out);
void amx_linear_silu_mul(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         at::Tensor out);
bool amx_q4_linear_supported();
void amx_q4_linear(const at::Tensor& x, const at::Tensor& q4, const at::Tensor& scales,
                   const c10::optional<at::Tensor>& bias, at::Tensor out, bool silu_mul);
bool small_m_linear_supported();
void small_m_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, at::Tensor out);
bool vnni_int8_linear_supported();
void vnni_int8_linear(const at::Tensor& x, const at::Tensor& q8, const at::Tensor& scales, at::Tensor channels,
                      at::Tensor wc, const c10::optional<at::Tensor>& bias, at::Tensor out, bool silu_mul);
bool gguf_linear_supported();
void gguf_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales,
                 const c10::optional<at::Tensor>& bias, at::Tensor out);
bool gguf_int8_linear_supported();
void gguf_int8_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales, at::Tensor channels,
                      at::Tensor wc, const c10::optional<at::Tensor>& bias, at::Tensor out);
bool fma_linear_supported();
bool fma_linear_fp16_supported();
bool fma_linear_dot_supported();
bool fma_linear_dot_default();
void fma_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, at::Tensor out,
                double w_inv = 1.0, int64_t dot = -1);
void fma_linear_silu_mul(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         at::Tensor out, double w_inv = 1.0, int64_t dot = -1);
void fma_linear_panel_sums(const c10::BFloat16* x, int64_t ldx, int64_t M, int64_t K, int64_t dot,
                           const int64_t* rows, const uint16_t* const* panels, int64_t n, float* out);

void write_kv_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                    const at::Tensor& slot_mapping);
void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start,
                     at::Tensor out, double scale, int64_t window, int64_t max_query_len,
                     const c10::optional<at::Tensor>& kv_start, c10::optional<at::Tensor> lse,
                     bool fp16_sums = false, const c10::optional<at::Tensor>& k_new = c10::nullopt,
                     const c10::optional<at::Tensor>& v_new = c10::nullopt,
                     const c10::optional<at::Tensor>& slot_mapping = c10::nullopt);
bool paged_attention_fp16_supported();

bool prefill_attention_amx_supported(int64_t head_dim, int64_t block_size);
void prefill_attention_amx(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start,
                           at::Tensor out, double scale, int64_t window, int64_t min_query_len);
void prefix_attention_amx(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& blocks, at::Tensor out, at::Tensor lse, double scale);
void cascade_prefix_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& blocks, const at::Tensor& rows, at::Tensor out, const at::Tensor& lse,
                              double scale);
