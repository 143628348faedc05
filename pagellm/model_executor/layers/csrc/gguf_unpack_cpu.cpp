// A GGUF weight's blocks made into the forms the kernels read, at load (layers/quantized.py: GGUFWeight.from_blocks,
// dequantize, pack_vnni_int8; their torch code is the reference these match, and the path without the extension):
//   gguf_unpack:     the file's blocks of a type re-packed into one of the layouts below (the quants and fp32
//                    scales the kernels read), byte for byte the torch code's;
//   gguf_dequantize: the weight's values, each the fp32 value of its block (as gguf.quants.dequantize gives it)
//                    rounded once to out's dtype;
//   vnni_int8_pack:  its int8 form for vnni_int8_linear (a step per output column, or per 32-deep block), bit for
//                    bit the torch code's, and each column's excess: the squared error the int8 rounding adds over
//                    the file's own rounding's.
//
// Why: the torch code makes fp32 copies a few MB at a time and walks them a dozen times (decode, max, scale, round,
// error, clamp, sums, the layout's permutation). For TinyLlama-1.1B's shapes in Q5_0 that was ~4 s of an 11 s
// engine start on Zen 4, and ~0.4 s of the default model's ~3 s cold start; here each value is decoded, rounded and
// placed in one pass, the threads splitting the columns. Likewise the unpacking: torch's strided copies, shifts and
// concatenations of a K-quant's bit fields took ~1.7 s of TinyLlama's Q4_K_M load.
//
// The layouts (layers/quantized.py's module docstring), per 32 weights of a row:
//   q4_1: 16 bytes, element j the low nibble of byte j, j + 16 its high one; scales d, m: w = d q + m
//   q8_0: 32 int8; scale d: w = q d
//   u8_1: 32 uint8; scales d, m: w = d q + m
//   q8_2: 32 int8; scales d0 (elements 0-15), d1 (16-31): w = q d
// Each value is computed as the torch code computes it (a product, then a sum, each rounded in fp32: the build's
// -ffp-contract=off keeps them apart).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace {

enum class Layout { Q4_1, Q8_0, U8_1, Q8_2 };

Layout parse_layout(const std::string& kind) {
  if (kind == "q4_1") return Layout::Q4_1;
  if (kind == "q8_0") return Layout::Q8_0;
  if (kind == "u8_1") return Layout::U8_1;
  if (kind == "q8_2") return Layout::Q8_2;
  TORCH_CHECK(false, "kind: one of q4_1, q8_0, u8_1, q8_2, not ", kind);
}

int64_t block_bytes(Layout l) { return l == Layout::Q4_1 ? 16 : 32; }
int64_t block_scales(Layout l) { return l == Layout::Q8_0 ? 1 : 2; }

// Checks qs [N, K/32, bytes] and scales fp32 [N, K/32, scales] of layout l; returns K.
int64_t check_blocks(const at::Tensor& qs, const at::Tensor& scales, Layout l) {
  const bool signed_quants = l == Layout::Q8_0 || l == Layout::Q8_2;
  TORCH_CHECK(qs.dim() == 3 && qs.is_contiguous() && qs.size(2) == block_bytes(l) &&
                  qs.scalar_type() == (signed_quants ? at::kChar : at::kByte),
              "qs: contiguous ", signed_quants ? "int8" : "uint8", " [N, K/32, ", block_bytes(l), "]");
  TORCH_CHECK(scales.dim() == 3 && scales.is_contiguous() && scales.scalar_type() == at::kFloat &&
                  scales.size(0) == qs.size(0) && scales.size(1) == qs.size(1) && scales.size(2) == block_scales(l),
              "scales: contiguous float32 [N, K/32, ", block_scales(l), "] matching qs");
  return qs.size(1) * 32;
}

// One block (its quants qs, its scales sc) as 32 fp32 values.
inline void decode_block(Layout l, const uint8_t* qs, const float* sc, float* v) {
  switch (l) {
    case Layout::Q4_1: {
      const float d = sc[0], m = sc[1];
      for (int j = 0; j < 16; ++j) {
        const float lo = d * static_cast<float>(qs[j] & 0x0F), hi = d * static_cast<float>(qs[j] >> 4);
        v[j] = lo + m;
        v[j + 16] = hi + m;
      }
      break;
    }
    case Layout::Q8_0: {
      const int8_t* q = reinterpret_cast<const int8_t*>(qs);
      for (int j = 0; j < 32; ++j) v[j] = static_cast<float>(q[j]) * sc[0];
      break;
    }
    case Layout::U8_1: {
      const float d = sc[0], m = sc[1];
      for (int j = 0; j < 32; ++j) {
        const float p = d * static_cast<float>(qs[j]);
        v[j] = p + m;
      }
      break;
    }
    case Layout::Q8_2: {
      const int8_t* q = reinterpret_cast<const int8_t*>(qs);
      for (int j = 0; j < 16; ++j) v[j] = static_cast<float>(q[j]) * sc[0];
      for (int j = 16; j < 32; ++j) v[j] = static_cast<float>(q[j]) * sc[1];
      break;
    }
  }
}

// A row's K values (fp32) into v.
inline void decode_row(Layout l, const uint8_t* qs, const float* sc, int64_t kc, float* v) {
  const int64_t qb = block_bytes(l), sb = block_scales(l);
  for (int64_t b = 0; b < kc; ++b) decode_block(l, qs + b * qb, sc + b * sb, v + 32 * b);
}

template <typename T>
void dequantize_rows(Layout l, const uint8_t* Q, const float* S, int64_t n, int64_t kc, T* out) {
  const int64_t K = kc * 32, qrow = kc * block_bytes(l), srow = kc * block_scales(l);
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> v(static_cast<size_t>(K));
    for (int64_t r = r0; r < r1; ++r) {
      decode_row(l, Q + r * qrow, S + r * srow, kc, v.data());
      T* o = out + r * K;
      for (int64_t k = 0; k < K; ++k) o[k] = static_cast<T>(v[k]);
    }
  });
}

// out [N, K] (float32, bfloat16 or float16) = the weight's values.
void gguf_dequantize(const at::Tensor& qs, const at::Tensor& scales, const std::string& kind, at::Tensor out) {
  const Layout l = parse_layout(kind);
  const int64_t K = check_blocks(qs, scales, l), n = qs.size(0), kc = K / 32;
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == n && out.size(1) == K,
              "out: contiguous [N, K] = [", n, ", ", K, "]");
  const uint8_t* Q = static_cast<const uint8_t*>(qs.data_ptr());
  const float* S = scales.data_ptr<float>();
  switch (out.scalar_type()) {
    case at::kFloat: return dequantize_rows(l, Q, S, n, kc, out.data_ptr<float>());
    case at::kBFloat16: return dequantize_rows(l, Q, S, n, kc, out.data_ptr<c10::BFloat16>());
    case at::kHalf: return dequantize_rows(l, Q, S, n, kc, out.data_ptr<c10::Half>());
    default: TORCH_CHECK(false, "out: float32, bfloat16 or float16");
  }
}

// ---- gguf_unpack: the file's blocks into a layout ----

enum class GGUFType { Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K };

struct TypeInfo {
  GGUFType type;
  int64_t weights, bytes;  // a block's
  Layout layout;
};

TypeInfo parse_type(const std::string& name) {
  static const std::pair<const char*, TypeInfo> types[] = {
      {"Q4_0", {GGUFType::Q4_0, 32, 18, Layout::Q4_1}},   {"Q4_1", {GGUFType::Q4_1, 32, 20, Layout::Q4_1}},
      {"Q5_0", {GGUFType::Q5_0, 32, 22, Layout::Q8_0}},   {"Q5_1", {GGUFType::Q5_1, 32, 24, Layout::U8_1}},
      {"Q8_0", {GGUFType::Q8_0, 32, 34, Layout::Q8_0}},   {"Q4_K", {GGUFType::Q4_K, 256, 144, Layout::Q4_1}},
      {"Q5_K", {GGUFType::Q5_K, 256, 176, Layout::U8_1}}, {"Q6_K", {GGUFType::Q6_K, 256, 210, Layout::Q8_2}}};
  for (const auto& t : types)
    if (name == t.first) return t.second;
  TORCH_CHECK(false, "type: one of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, not ", name);
}

inline float f16_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// A K-quant's 12 bytes of packed 6-bit values: sub-block i's scale and minimum (i < 8), as gguf unpacks them.
inline void k_scale_min(const uint8_t* s, int i, uint8_t& sc, uint8_t& mn) {
  if (i < 4) {
    sc = s[i] & 0x3F, mn = s[4 + i] & 0x3F;
  } else {
    sc = (s[8 + i - 4] & 0x0F) | ((s[i - 4] >> 2) & 0x30);
    mn = (s[8 + i - 4] >> 4) | ((s[4 + i - 4] >> 2) & 0x30);
  }
}

// One file block b (of t's type) into its 32-weight layout blocks: quants q (t.weights / 32 blocks of
// block_bytes(layout) each) and scales sc (block_scales(layout) each), as GGUFWeight.from_blocks's torch code.
inline void unpack_block(GGUFType t, const uint8_t* b, uint8_t* q, float* sc) {
  switch (t) {
    case GGUFType::Q4_1:
      sc[0] = f16_at(b), sc[1] = f16_at(b + 2);
      std::memcpy(q, b + 4, 16);
      break;
    case GGUFType::Q4_0: {
      const float d = f16_at(b);
      sc[0] = d, sc[1] = d * -8.0f;
      std::memcpy(q, b + 2, 16);
      break;
    }
    case GGUFType::Q8_0:
      sc[0] = f16_at(b);
      std::memcpy(q, b + 2, 32);
      break;
    case GGUFType::Q5_0:
    case GGUFType::Q5_1: {
      // element j: the low nibble of byte j (j < 16) or the high one of byte j - 16, bit j of the 32-bit qh above
      const bool q5_0 = t == GGUFType::Q5_0;
      const uint8_t* qh = b + (q5_0 ? 2 : 4);
      const uint8_t* qs = qh + 4;
      sc[0] = f16_at(b);
      if (!q5_0) sc[1] = f16_at(b + 2);
      for (int j = 0; j < 32; ++j) {
        const int v = ((j < 16 ? qs[j] & 0x0F : qs[j - 16] >> 4) | (((qh[j / 8] >> (j % 8)) & 1) << 4));
        q[j] = static_cast<uint8_t>(q5_0 ? static_cast<int8_t>(v - 16) : v);
      }
      break;
    }
    case GGUFType::Q4_K:
    case GGUFType::Q5_K: {
      // 8 sub-blocks of 32: scales d sc, -(dmin mn); quants: sub-block 2c + s the nibbles (s: low, high) of bytes
      // 32c .. 32c + 31 of qs, Q5_K's fifth bit i of qh[l]; Q4_K's repacked into q4_1's 16 bytes
      const float d = f16_at(b), dmin = f16_at(b + 2);
      const bool q5 = t == GGUFType::Q5_K;
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (q5 ? 48 : 16);
      for (int i = 0; i < 8; ++i) {
        uint8_t s, m;
        k_scale_min(b + 4, i, s, m);
        sc[2 * i] = d * static_cast<float>(s);
        sc[2 * i + 1] = -(dmin * static_cast<float>(m));
        const uint8_t* src = qs + 32 * (i / 2);
        const int shift = 4 * (i % 2);
        if (q5) {
          for (int l = 0; l < 32; ++l)
            q[32 * i + l] = static_cast<uint8_t>(((src[l] >> shift) & 0x0F) | (((qh[l] >> i) & 1) << 4));
        } else {
          for (int j = 0; j < 16; ++j)
            q[16 * i + j] = static_cast<uint8_t>(((src[j] >> shift) & 0x0F) | (((src[j + 16] >> shift) & 0x0F) << 4));
        }
      }
      break;
    }
    case GGUFType::Q6_K: {
      // weight f = 128 h + r (h: which half): low 4 bits from ql[64 h + r % 64] (its high nibble when r >= 64),
      // high 2 from qh[32 h + r % 32] >> 2 (r / 32); minus 32. 16 scales d sc[g], one per 16 weights
      const uint8_t *ql = b, *qh = b + 128;
      const int8_t* s = reinterpret_cast<const int8_t*>(b + 192);
      const float d = f16_at(b + 208);
      for (int g = 0; g < 16; ++g) sc[g] = d * static_cast<float>(s[g]);
      for (int h = 0; h < 2; ++h)
        for (int r = 0; r < 128; ++r) {
          const int low = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 0x0F;
          const int high = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 0x03;
          q[128 * h + r] = static_cast<uint8_t>(static_cast<int8_t>((low | (high << 4)) - 32));
        }
      break;
    }
  }
}

// blocks uint8 [N, bytes] (each row the file's blocks of one output row, of GGUF type `type`) into qs and scales,
// contiguous [N, K/32, block_bytes] (int8 for q8_0 and q8_2, else uint8) and float32 [N, K/32, block_scales] of
// the type's layout (layers/quantized.py's module docstring; the Python side allocates them).
void gguf_unpack(const at::Tensor& blocks, const std::string& type, at::Tensor qs, at::Tensor scales) {
  const TypeInfo t = parse_type(type);
  TORCH_CHECK(blocks.dim() == 2 && blocks.is_contiguous() && blocks.scalar_type() == at::kByte &&
                  blocks.size(1) % t.bytes == 0,
              "blocks: contiguous uint8 [N, a multiple of ", t.bytes, " bytes] (", type, "'s blocks)");
  const int64_t n = blocks.size(0), per_row = blocks.size(1) / t.bytes, kc = per_row * (t.weights / 32);
  check_blocks(qs, scales, t.layout);
  TORCH_CHECK(qs.size(0) == n && qs.size(1) == kc, "qs, scales: [N, K/32, ...] = [", n, ", ", kc, ", ...]");
  const int64_t sub = t.weights / 32, qb = block_bytes(t.layout) * sub, sb = block_scales(t.layout) * sub;
  const uint8_t* B = static_cast<const uint8_t*>(blocks.data_ptr());
  uint8_t* Q = static_cast<uint8_t*>(qs.data_ptr());
  float* S = scales.data_ptr<float>();
  const int64_t all = n * per_row;
  at::parallel_for(0, all, 2048, [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0; i < b1; ++i) unpack_block(t.type, B + i * t.bytes, Q + i * qb, S + i * sb);
  });
}

// The file's own rounding's squared error over a row (its scales sc), as for values rounded to the nearest of steps
// d: d^2 / 12 a weight (every layout's first scale is its step; q8_2's two, one per 16 weights).
double own_error(Layout l, const float* sc, int64_t kc) {
  double e = 0;
  if (l == Layout::Q8_2) {
    for (int64_t i = 0; i < 2 * kc; ++i) e += static_cast<double>(sc[i]) * sc[i];
    return e * (16.0 / 12.0);
  }
  const int64_t sb = block_scales(l);
  for (int64_t b = 0; b < kc; ++b) e += static_cast<double>(sc[b * sb]) * sc[b * sb];
  return e * (32.0 / 12.0);
}

// v's values over [0, len) rounded to int8 steps of max|v| / 127 (ties to even) into w8; returns the step, adds
// the squared error the rounding makes to err.
// (len a multiple of 32; the loops are written lane by lane so that the compiler vectorizes them without
// reassociating anything: std::rint in the default rounding mode is round-half-even, as torch.round)
inline float round_group(const float* v, int64_t len, int8_t* w8, int32_t& sum, double& err) {
  float top[32] = {};
  for (int64_t k = 0; k < len; k += 32)
    for (int i = 0; i < 32; ++i) top[i] = std::max(top[i], std::fabs(v[k + i]));
  const float step = *std::max_element(top, top + 32) / 127.f;
  const float inv = step > 0.f ? 1.f / step : 0.f;
  float sq[32] = {};  // each lane's squared errors (in steps), summed over the blocks
  int32_t s = 0;
  for (int64_t k = 0; k < len; k += 32) {
    int32_t q[32];
    for (int i = 0; i < 32; ++i) {
      const float x = v[k + i] * inv;
      const float r = std::rint(x);
      sq[i] += (x - r) * (x - r);
      // (a NaN, from a value that is not finite, is stored as 0: the column's error is NaN, its excess infinite)
      q[i] = static_cast<int32_t>(r == r ? std::min(std::max(r, -127.f), 127.f) : 0.f);
    }
    for (int i = 0; i < 32; ++i) {
      s += q[i];
      w8[k + i] = static_cast<int8_t>(q[i]);
    }
  }
  double e = 0;
  for (int i = 0; i < 32; ++i) e += sq[i];
  err += e * static_cast<double>(step) * step;
  sum = s;
  return step;
}

// The int8 form of rows [0, N) of one weight (or one part of a fused one, its rows the columns col0 .. col0 + N of
// the whole): packed int8 [tiles, K/32, 8, 64] (byte 4 n + e of row j of block b: column 16 t + n at depth
// 32 b + 4 j + e), out fp32 [tiles, 2, 16] (the columns' steps, then their int32 offsets' bits: -128 times the sum
// of their int8 values), or per_block [tiles, K/32, 2, 16] (a block's); excess fp32 [tiles * 16]: the column's
// added squared error over its own (0 where it adds none; infinite for a column holding a value that is not
// finite, whose form is declined). Writes only these columns; the threads split them by whole tiles.
void vnni_int8_pack(const at::Tensor& qs, const at::Tensor& scales, const std::string& kind, int64_t col0,
                    bool per_block, at::Tensor packed, at::Tensor out, at::Tensor excess) {
  const Layout l = parse_layout(kind);
  const int64_t K = check_blocks(qs, scales, l), n = qs.size(0), kc = K / 32;
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.scalar_type() == at::kChar &&
                  packed.size(1) == kc && packed.size(2) == 8 && packed.size(3) == 64,
              "packed: contiguous int8 [tiles, K/32, 8, 64]");
  const int64_t tiles = packed.size(0);
  TORCH_CHECK(col0 >= 0 && n <= tiles * 16 && col0 <= tiles * 16 - n,
              "col0: the rows' first column, their last within the tiles");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kFloat &&
                  (per_block ? out.dim() == 4 && out.size(0) == tiles && out.size(1) == kc && out.size(2) == 2 &&
                                   out.size(3) == 16
                             : out.dim() == 3 && out.size(0) == tiles && out.size(1) == 2 && out.size(2) == 16),
              "out: contiguous float32 ", per_block ? "[tiles, K/32, 2, 16]" : "[tiles, 2, 16]");
  TORCH_CHECK(excess.dim() == 1 && excess.is_contiguous() && excess.scalar_type() == at::kFloat &&
                  excess.size(0) == tiles * 16,
              "excess: contiguous float32 [tiles * 16]");
  const uint8_t* Q = static_cast<const uint8_t*>(qs.data_ptr());
  const float* S = scales.data_ptr<float>();
  int8_t* P = packed.data_ptr<int8_t>();
  float* O = out.data_ptr<float>();
  float* E = excess.data_ptr<float>();
  const int64_t qrow = kc * block_bytes(l), srow = kc * block_scales(l);
  if (n == 0) return;
  const int64_t t_first = col0 / 16, t_end = (col0 + n - 1) / 16 + 1;
  at::parallel_for(t_first, t_end, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> v(static_cast<size_t>(K));
    std::vector<int8_t> w8(static_cast<size_t>(K));
    for (int64_t r = std::max(int64_t{0}, 16 * t0 - col0); r < std::min(n, 16 * t1 - col0); ++r) {
      const int64_t c = col0 + r, t = c / 16, lane = c % 16;
      decode_row(l, Q + r * qrow, S + r * srow, kc, v.data());
      double added = 0;
      if (per_block) {
        for (int64_t b = 0; b < kc; ++b) {
          int32_t sum;
          const float step = round_group(v.data() + 32 * b, 32, w8.data() + 32 * b, sum, added);
          float* o = O + ((t * kc + b) * 2) * 16;
          const int32_t offset = -128 * sum;
          o[lane] = step;
          std::memcpy(o + 16 + lane, &offset, sizeof(offset));
        }
      } else {
        int32_t sum;
        const float step = round_group(v.data(), K, w8.data(), sum, added);
        const int32_t offset = -128 * sum;
        O[(t * 2) * 16 + lane] = step;
        std::memcpy(O + (t * 2 + 1) * 16 + lane, &offset, sizeof(offset));
      }
      // depth 4 j + e of block b: 4 bytes at row j's byte 4 lane
      for (int64_t b = 0; b < kc; ++b)
        for (int64_t j = 0; j < 8; ++j)
          std::memcpy(P + ((t * kc + b) * 8 + j) * 64 + 4 * lane, w8.data() + 32 * b + 4 * j, 4);
      const double own = own_error(l, S + r * srow, kc);
      E[c] = std::isnan(added) ? std::numeric_limits<float>::infinity()
                               : added > 0 ? static_cast<float>(added / own) : 0.f;
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("gguf_unpack(Tensor blocks, str type, Tensor(a!) qs, Tensor(b!) scales) -> ()");
  m.impl("gguf_unpack", c10::DispatchKey::CPU, &gguf_unpack);
  m.def("gguf_dequantize(Tensor qs, Tensor scales, str kind, Tensor(a!) out) -> ()");
  m.impl("gguf_dequantize", c10::DispatchKey::CPU, &gguf_dequantize);
  m.def("vnni_int8_pack(Tensor qs, Tensor scales, str kind, int col0, bool per_block, Tensor(a!) packed, "
        "Tensor(b!) out, Tensor(c!) excess) -> ()");
  m.impl("vnni_int8_pack", c10::DispatchKey::CPU, &vnni_int8_pack);
}
