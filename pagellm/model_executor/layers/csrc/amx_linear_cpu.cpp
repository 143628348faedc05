// y [M, N] = x [M, K] @ w[N, K]^T (+ bias) on AMX tiles for decode-sized batches (tens of rows), bf16.
//
// A decode step multiplies every weight by one row per running request: the weight is read from memory once
// and the arithmetic is small, so the time is the weight's stream. Here w is packed once at load into AMX's
// B-tile order, [N/16][K/32][16 k-pairs][16 n][2], so each 16-column x 32-deep slice is one contiguous KiB;
// each thread walks its columns in order (software-prefetching the next slice) and multiplies every slice
// with the up-to-four 16-row tiles of x, accumulating in fp32 tiles.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define PAGELLM_AMX 1
#endif

#include "vec.h"

namespace {
using namespace pagellm;

#if defined(PAGELLM_AMX)
// Linux hands out AMX tile state on request (once per process).
bool request_amx() {
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C (fp32) of row blocks 0-3; 4: A of a full row block; 5: A of the last, partial one; 6: B.
void configure(int64_t blocks, int64_t last_rows) {
  TileConfig c;
  for (int64_t b = 0; b < blocks; ++b) {
    c.rows[b] = static_cast<uint8_t>(b == blocks - 1 ? last_rows : 16);
    c.colsb[b] = 64;
  }
  c.rows[4] = 16, c.colsb[4] = 64;
  c.rows[5] = static_cast<uint8_t>(last_rows), c.colsb[5] = 64;
  c.rows[6] = 16, c.colsb[6] = 64;
  _tile_loadconfig(&c);
}

#define PAGELLM_DP(C)                                                              \
  if (blocks > C) {                                                                \
    if (C == blocks - 1) { _tile_loadd(5, a + C * 16 * lda, lda * 2); _tile_dpbf16ps(C, 5, 6); } \
    else { _tile_loadd(4, a + C * 16 * lda, lda * 2); _tile_dpbf16ps(C, 4, 6); }   \
  }

// Output columns [16 nc0, 16 nc1) for all M rows of x, 64 rows (four C tiles) at a time: each B slice is read
// from memory once and reused from L1 for every 64-row group.
void columns(const c10::BFloat16* x, int64_t lda, const c10::BFloat16* bp, int64_t kc_n, int64_t M, int64_t N,
             int64_t nc0, int64_t nc1, const c10::BFloat16* bias, c10::BFloat16* y, int64_t ldy) {
  alignas(64) float c[4 * 16 * 16];
  int64_t configured = -1;  // rows of the group the tiles are configured for
  for (int64_t nc = nc0; nc < nc1; ++nc) {
    const c10::BFloat16* bcol = bp + nc * kc_n * 512;
    for (int64_t m0 = 0; m0 < M; m0 += 64) {
      const int64_t rows = std::min<int64_t>(64, M - m0);
      const int64_t blocks = (rows + 15) / 16, last_rows = rows - (blocks - 1) * 16;
      if (rows != configured) configure(blocks, last_rows), configured = rows;
      _tile_zero(0);
      if (blocks > 1) _tile_zero(1);
      if (blocks > 2) _tile_zero(2);
      if (blocks > 3) _tile_zero(3);
      for (int64_t kc = 0; kc < kc_n; ++kc) {
        const c10::BFloat16* slice = bcol + kc * 512;
        if (m0 == 0 && nc + 1 < nc1) {  // the same slice of the next columns: 16 cache lines
          const char* nxt = reinterpret_cast<const char*>(slice + kc_n * 512);
          for (int l = 0; l < 1024; l += 64) _mm_prefetch(nxt + l, _MM_HINT_T0);
        }
        _tile_loadd(6, slice, 64);
        const c10::BFloat16* a = x + m0 * lda + kc * 32;
        PAGELLM_DP(0) PAGELLM_DP(1) PAGELLM_DP(2) PAGELLM_DP(3)
      }
      _tile_stored(0, c, 64);
      if (blocks > 1) _tile_stored(1, c + 256, 64);
      if (blocks > 2) _tile_stored(2, c + 512, 64);
      if (blocks > 3) _tile_stored(3, c + 768, 64);
      const int64_t n0 = nc * 16, nn = std::min<int64_t>(16, N - n0);
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t j = 0; j < nn; ++j) {
          float v = c[m * 16 + j];
          if (bias) v += to_float(bias[n0 + j]);
          y[(m0 + m) * ldy + n0 + j] = static_cast<c10::BFloat16>(v);
        }
    }
  }
  _tile_release();
}
#undef PAGELLM_DP
#endif

}  // namespace

bool amx_linear_supported() {
#if defined(PAGELLM_AMX)
  return request_amx();
#else
  return false;
#endif
}

// packed: [ceil(N/16), K/32, 16, 16, 2] bf16 (see above); x [M, K] with K % 32 == 0.
void amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, at::Tensor out) {
  TORCH_CHECK(amx_linear_supported(), "amx_linear needs AMX-BF16");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1, "x, out: [M, K], [M, N]");
  TORCH_CHECK(packed.dim() == 5 && packed.is_contiguous() && packed.size(2) == 16 && packed.size(3) == 16 &&
              packed.size(4) == 2 && packed.size(1) * 32 == x.size(1), "packed: [N/16, K/32, 16, 16, 2]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 &&
              out.scalar_type() == at::kBFloat16, "bfloat16 only");
  const int64_t M = x.size(0), N = out.size(1);
  TORCH_CHECK(M >= 1 && out.size(0) == M && (N + 15) / 16 == packed.size(0), "out [M, N], N matches packed");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == at::kBFloat16,
                            "bias: bfloat16 [N]");
#if defined(PAGELLM_AMX)
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* bp = packed.data_ptr<c10::BFloat16>();
  const auto* bi = has_bias ? bias->data_ptr<c10::BFloat16>() : nullptr;
  auto* yp = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, packed.size(0), 4, [&](int64_t nc0, int64_t nc1) {
    columns(xp, x.stride(0), bp, packed.size(1), M, N, nc0, nc1, bi, yp, out.stride(0));
  });
#endif
}

TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias, Tensor(a!) out) -> ()");
  m.impl("amx_linear", c10::DispatchKey::CPU, &amx_linear);
  m.def("amx_linear_supported() -> bool", [] { return amx_linear_supported(); });
}
