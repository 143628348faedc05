"""The forms a linear's weight is packed into at load, each for one kernel (layers/linear.py's CPULinear keeps the
ones its CPU's kernels read): oneDNN's blocked layout, the tile kernels' B-tile order (bf16, or fp16 scaled by a
power of two), and a GGUF weight's two int8 forms, for the int8 dot products past a few rows (vnni_int8_form) and
for the few-row kernel on a 4-bit weight's own nibbles (gguf_int8_form)."""
from __future__ import annotations

import math
from typing import Callable

import torch

from pagellm.model_executor.layers.quantized import GGUFParts, GGUFWeight, pack_vnni_int8

INT8_OUTLIER_CHANNELS = 8  # x's channels the int8 kernel keeps out of its int8 rows, per weight (vnni_int8_form)
GGUF_INT8_OUTLIER_CHANNELS = 8  # and the few-row int8 kernel (gguf_int8_form)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_amx(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N/16), K/32, 16, 16, 2]: element [c, k, r, n, e] = weight[16c + n, 32k + 2r + e]
    (columns past N are zero): each 16-column x 32-deep slice is one AMX B tile, one contiguous KiB. A 16-bit
    weight moves as 32-bit pairs (one permuted copy of int32s: about half the time of moving 16-bit elements,
    ~0.1 s for a TinyLlama gate/up)."""
    n, k = weight.shape
    w = weight.detach()
    if n % 16:
        w = torch.cat([w, w.new_zeros(-(-n // 16) * 16 - n, k)])
    if w.element_size() != 2:
        return w.view(-1, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()
    pairs = w.contiguous().view(torch.int32).view(-1, 16, k // 32, 16).permute(0, 2, 3, 1).contiguous()
    return pairs.view(weight.dtype).view(-1, k // 32, 16, 16, 2)


def vnni_int8_form(q: GGUFWeight | GGUFParts, outliers: int = INT8_OUTLIER_CHANNELS, max_excess: float = math.inf,
                   per_block: bool = False, pack: Callable | None = None) -> tuple[torch.Tensor, ...] | None:
    """vnni_int8_linear's operands for a GGUF weight of any layout, or a fused one of mixed layouts: its int8
    values and steps (``quantized.pack_vnni_int8``: a step per output column, or per 32-deep block), and room for
    ``outliers`` channels kept out of x's int8 values (int32 [P], -1 until the kernel's first call chooses them)
    with the weight's values there (fp32 [P, ceil(N/16) * 16]). None where the int8 form's excess error in some
    column is over max_excess. pack: torch.ops.pagellm.vnni_int8_pack, to make the int8 form in C++."""
    packed = pack_vnni_int8(q, max_excess, per_block, pack)
    if packed is None:
        return None
    q8, scales, _ = packed
    p = min(outliers, q.shape[1])
    return q8, scales, torch.full((p,), -1, dtype=torch.int32), torch.zeros(p, q8.shape[0] * 16)


def gguf_int8_form(q: GGUFWeight, outliers: int | None = None) -> tuple[torch.Tensor, ...]:
    """gguf_int8_linear's operands for a q4_1 weight: its blocks' bytes and steps with 16 output columns side by
    side (uint8 [ceil(N/16), K/32, 4, 64]: row j of a block holds at byte 4 c + e column c's block byte 4 j + e;
    fp32 [ceil(N/16), K/32, 2, 16]: the columns' d, then their m; columns past N zero), the outlier channels (int32
    [P], -1 until the kernel's first call chooses them; P: outliers, else GGUF_INT8_OUTLIER_CHANNELS) and room for
    the weight's values there (fp32 [N, P])."""
    n, k = q.shape
    n16, kb = -(-n // 16), k // 32
    qs, scales = q.qs.view(n, kb, 16), q.scales.view(n, kb, 2)
    if n16 * 16 != n:
        qs = torch.cat([qs, qs.new_zeros(n16 * 16 - n, kb, 16)])
        scales = torch.cat([scales, scales.new_zeros(n16 * 16 - n, kb, 2)])
    # (4 bytes move together: as int32s, a quarter of the elements to permute; ~0.3 s of TinyLlama's load as bytes)
    qs = qs.contiguous().view(torch.int32).view(n16, 16, kb, 4).permute(0, 2, 3, 1).contiguous()
    qs = qs.view(torch.uint8).view(n16, kb, 4, 64)
    scales = scales.view(n16, 16, kb, 2).permute(0, 2, 3, 1).contiguous()
    p = min(GGUF_INT8_OUTLIER_CHANNELS if outliers is None else outliers, k)
    return qs, scales, torch.full((p,), -1, dtype=torch.int32), torch.zeros(n, p)


def pack_fp16(weight: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The FMA kernel's fp16 weight: ``pack_amx`` of weight x 2^-e in fp16, the power of two putting the largest
    |value| in [0.5, 1) (exact for bf16 values from 2^-14 of the largest up, so no overflow and little underflow),
    and 2^e, by which the kernel scales its result back. -> (packed, 2^e)."""
    top = weight.detach().abs().max().item() if weight.numel() else 0.0
    e = min(max(math.frexp(top)[1], -126), 126) if 0.0 < top < math.inf else 0
    # bf16 times a power of two is exact in bf16 (fp32's exponent range), so no fp32 copy is needed before the one
    # rounding to fp16; an fp16 weight goes through fp32 (scaled up, it could overflow fp16)
    scaled = weight.detach() * 2.0 ** -e if weight.dtype == torch.bfloat16 else weight.detach().float() * 2.0 ** -e
    return pack_amx(scaled.half()), 2.0 ** e
