// What the kernels on a B-tile-ordered weight share (amx_linear_cpu.cpp, fma_linear_cpu.cpp): the operand checks.
// The packed layout is [ceil(N/16)][K/32][16 k-pairs][16 n][2] (layers/linear.py: pack_amx); amx_q4_linear's
// nibbles keep its first two dimensions (amx_q4_panels.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

namespace pagellm {

// x [M, K] (rows may be strided) and out [M, N] laid out as rows, M >= 1; w_tiles: the weight's 16-column tiles,
// holding w_cols columns (w: its name, for the message), bias (if any) w_cols bf16 entries.
inline void check_tile_rows(const at::Tensor& x, const c10::optional<at::Tensor>& bias, const at::Tensor& out,
                            int64_t w_cols, int64_t w_tiles, const char* w) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1, "x, out: [M, K], [M, N]");
  TORCH_CHECK(x.size(0) >= 1 && out.size(0) == x.size(0) && (w_cols + 15) / 16 == w_tiles,
              "out: [M, N] with M >= 1 rows, N matching ", w);
  if (bias.has_value() && bias->defined())
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == w_cols && bias->scalar_type() == at::kBFloat16,
                "bias: bfloat16 [", w_cols, "]");
}

// x [M, K] (rows may be strided), out [M, N], all bf16; packed holds w_cols columns (out's N, or 2N for the
// silu_mul forms), bias (if any) w_cols entries. supported / needs: the kernel's instructions, for the message.
inline void check_tile_linear(bool supported, const char* needs, const at::Tensor& x, const at::Tensor& packed,
                              const c10::optional<at::Tensor>& bias, const at::Tensor& out, int64_t w_cols,
                              bool half_packed = false) {
  TORCH_CHECK(supported, needs);
  check_tile_rows(x, bias, out, w_cols, packed.dim() > 0 ? packed.size(0) : 0, "packed");
  TORCH_CHECK(packed.dim() == 5 && packed.is_contiguous() && packed.size(2) == 16 && packed.size(3) == 16 &&
              packed.size(4) == 2 && packed.size(1) * 32 == x.size(1), "packed: [N/16, K/32, 16, 16, 2]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
              packed.scalar_type() == (half_packed ? at::kHalf : at::kBFloat16),
              half_packed ? "x, out: bfloat16" : "bfloat16 only");
}

}  // namespace pagellm
