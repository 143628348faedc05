"""GGUF weights kept in blocks of 32 quants, for the linears' few-row path (``csrc/gguf_linear_cpu.cpp``).

A decode step with a handful of requests is a pass over every weight, bound by memory bandwidth. The default
model's layer linears are Q4_1 (32 weights a block, ``w = d * q + m``, q a nibble) and its tied embeddings Q8_0
(``w = q * d``, q an int8): kept so, they are a third and a half of bf16's bytes. The loader dequantizes every tensor
for the model's parameters as before and, for a weight of a type below, also keeps its quants
(``gguf_loader.load_gguf``); the model fuses them as it fuses the parameters (q/k/v, gate/up; parts of different
layouts as ``GGUFParts``, one kernel call each) and hands them to its ``CPULinear`` layers, which take them up to
``GEMV_MAX_ROWS`` rows.

The kernel reads four layouts; every other supported GGUF type is re-packed into one of them at load, so that each
weight is, bit for bit, the fp32 value ``gguf.quants.dequantize`` gives (its products are exact in fp32, and each
layout keeps its one rounding: ``tests/test_gguf_linear.py`` checks every type against ``gguf``):

============  ========================================  ==========================  ======================
layout        qs per 32 weights                          scales (fp32) per 32        from
============  ========================================  ==========================  ======================
``q4_1``      16 bytes: element j in the low nibble of   d, m: ``w = d * q + m``     Q4_1; Q4_0 (m = -8 d);
              byte j, j + 16 in its high one                                         Q4_K (d sc, -dmin m)
``q8_0``      32 int8                                    d: ``w = q * d``            Q8_0; Q5_0 (q - 16)
``u8_1``      32 uint8                                   d, m: ``w = d * q + m``     Q5_1; Q5_K (d sc, -dmin m)
``q8_2``      32 int8                                    d for elements 0-15, 16-31  Q6_K (d sc per 16)
============  ========================================  ==========================  ======================

Scales are fp32 so the kernel broadcasts them from memory. Bits per weight as read: Q4_x and Q4_K 6, Q8_0 and
Q5_0 9, Q5_1 / Q5_K / Q6_K 10, against bf16's 16.

``pack_vnni_int8`` makes a weight of any layout (or fused parts of several) the int8 form of the many-row kernel on
CPUs without AMX, and measures how much coarser than the file's own steps that form is.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# fp32 values dequantize and pack_vnni_int8 make at a time (4 MB)
DEQUANT_FLOATS = 1 << 20
# GGUF type name -> (weights a block, bytes a block) for the types kept as quants
GGUF_BLOCKS = {name: GGML_QUANT_SIZES[GGMLQuantizationType[name]]
               for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")}
# GGUF type -> its layout; a layout -> (its quants' bytes and dtype, its scales) per 32 weights
LAYOUT_OF = {"Q4_0": "q4_1", "Q4_1": "q4_1", "Q4_K": "q4_1", "Q8_0": "q8_0", "Q5_0": "q8_0", "Q5_1": "u8_1",
             "Q5_K": "u8_1", "Q6_K": "q8_2"}
LAYOUTS = {"q4_1": (16, torch.uint8, 2), "q8_0": (32, torch.int8, 1), "u8_1": (32, torch.uint8, 2),
           "q8_2": (32, torch.int8, 2)}


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 from the last dim's byte pairs, as fp32: [..., 2 n] uint8 -> [..., n]."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] values: element j the low nibble of byte j, j + 16 its high one."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1's 4 bytes (a little-endian uint32) -> [..., 32]: bit j of the word, as 0 / 1."""
    bits = torch.arange(8, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> bits) & 1).flatten(-2)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes -> the 8 sub-blocks' 6-bit scales and minimums ([..., 8] each, as gguf unpacks them)."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_low(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K's 128 bytes -> [..., 8, 32] low nibbles: sub-block 2i the low nibbles of bytes 32i .. 32i + 31,
    2i + 1 their high ones."""
    q = qs.unflatten(-1, (4, 1, 32)) >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)
    return (q & 0x0F).flatten(-3, -2)


@dataclass
class GGUFWeight:
    """A weight [N, K] in blocks of 32 quants in one of the kernel's layouts (module docstring): ``qs`` uint8
    [N, K/32, 16] (q4_1), int8 [N, K/32, 32] (q8_0, q8_2) or uint8 [N, K/32, 32] (u8_1); ``scales`` fp32
    [N, K/32, 2], or [N, K/32, 1] for q8_0."""

    kind: str  # the layout: "q4_1", "q8_0", "u8_1" or "q8_2"
    qs: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def from_blocks(cls, kind: str, blocks: torch.Tensor, kernel: Callable | None = None) -> "GGUFWeight":
        """blocks: uint8 [N, K / block weights * block bytes], each row the file's blocks of one output row, of GGUF
        type ``kind`` (a key of GGUF_BLOCKS; lower case accepted). kernel: torch.ops.pagellm.gguf_unpack
        (``csrc/gguf_unpack_cpu.cpp``: the same bytes in one pass; CPU uint8 blocks), else unpacked here in torch."""
        kind = kind.upper()
        per, size = GGUF_BLOCKS[kind]
        if (kernel is not None and blocks.dtype == torch.uint8 and blocks.device.type == "cpu" and blocks.dim() == 2
                and blocks.shape[1] % size == 0):
            qbytes, qdtype, nscales = LAYOUTS[LAYOUT_OF[kind]]
            n, kc = blocks.shape[0], blocks.shape[1] // size * (per // 32)
            qs = torch.empty(n, kc, qbytes, dtype=qdtype)
            scales = torch.empty(n, kc, nscales, dtype=torch.float32)
            kernel(blocks.contiguous(), kind, qs, scales)
            return cls(LAYOUT_OF[kind], qs, scales)
        b = blocks.reshape(blocks.shape[0], -1, size)
        if kind == "Q4_1":
            return cls("q4_1", b[..., 4:].contiguous(), _f16(b[..., :4]))
        if kind == "Q4_0":
            d = _f16(b[..., :2])
            return cls("q4_1", b[..., 2:].contiguous(), torch.cat([d, d * -8.0], dim=-1))
        if kind == "Q8_0":
            return cls("q8_0", b[..., 2:].contiguous().view(torch.int8), _f16(b[..., :2]))
        if kind == "Q5_0":
            q = _nibbles(b[..., 6:]) | (_high_bits(b[..., 2:6]) << 4)
            return cls("q8_0", (q.to(torch.int16) - 16).to(torch.int8), _f16(b[..., :2]))
        if kind == "Q5_1":
            q = _nibbles(b[..., 8:]) | (_high_bits(b[..., 4:8]) << 4)
            return cls("u8_1", q.contiguous(), _f16(b[..., :4]))
        n = b.shape[0]
        if kind in ("Q4_K", "Q5_K"):
            d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
            sc, mn = _k_scales(b[..., 4:16])
            scales = torch.stack([d * sc.float(), -(dmin * mn.float())], dim=-1).reshape(n, -1, 2)
            if kind == "Q4_K":
                q = _k_low(b[..., 16:144])  # [N, S, 8, 32]
                return cls("q4_1", (q[..., :16] | (q[..., 16:] << 4)).reshape(n, -1, 16), scales)
            qh = b[..., 16:48].unsqueeze(-2) >> torch.arange(8, dtype=torch.uint8).view(8, 1)
            q = _k_low(b[..., 48:176]) | ((qh & 1) << 4)
            return cls("u8_1", q.reshape(n, -1, 32), scales)
        if kind == "Q6_K":
            ql, qh = b[..., 0:128], b[..., 128:192]
            sc, d = b[..., 192:208].contiguous().view(torch.int8), _f16(b[..., 208:210])
            low = (ql.unflatten(-1, (2, 1, 64)) >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)) & 0x0F
            high = (qh.unflatten(-1, (2, 1, 32)) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 0x03
            q = low.reshape(n, -1, 8, 32) | (high.reshape(n, -1, 8, 32) << 4)
            q = (q.to(torch.int16) - 32).to(torch.int8)
            return cls("q8_2", q.reshape(n, -1, 32), (d * sc.float()).reshape(n, -1, 2))
        raise ValueError(f"GGUF type {kind} is not kept in blocks")

    @staticmethod
    def cat(parts: list["GGUFWeight"]) -> "GGUFWeight | GGUFParts":
        """Rows stacked, as ``torch.cat`` of the weights (fused q/k/v, gate/up): one weight where the parts share a
        layout, else the runs of neighbouring parts that do (Q4_K_M's q and k in Q4_K with v in Q6_K: two)."""
        runs: list[list[GGUFWeight]] = []
        for p in parts:
            if runs and runs[-1][0].kind == p.kind:
                runs[-1].append(p)
            else:
                runs.append([p])
        merged = [r[0] if len(r) == 1 else GGUFWeight(r[0].kind, torch.cat([p.qs for p in r]),
                                                       torch.cat([p.scales for p in r])) for r in runs]
        return merged[0] if len(merged) == 1 else GGUFParts(merged)

    @property
    def pieces(self) -> list[tuple["GGUFWeight", int]]:
        """(weight, first output column): the kernel's calls for this weight."""
        return [(self, 0)]

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] * 32

    def _tile_scales(self) -> torch.Tensor:
        """A q4_1 weight's d and m per 16-column tile and 32-deep block: fp32 [ceil(N/16), K/32, 2, 16] (columns
        past N: zeros)."""
        n, kc = self.qs.shape[0], self.qs.shape[1]
        tiles = -(-n // 16)
        sc = torch.zeros(tiles * 16, kc, 2, dtype=torch.float32)
        sc[:n] = self.scales
        return sc.view(tiles, 16, kc, 2).permute(0, 2, 3, 1).contiguous()

    def _tile_quants(self) -> torch.Tensor:
        """A q4_1 weight's quants as uint8 [ceil(N/16) * 16, K/32, 32] (k order; columns past N: zeros)."""
        if self.kind != "q4_1":
            raise ValueError(f"the 4-bit kernels take the q4_1 layout, not {self.kind}")
        n, kc = self.qs.shape[0], self.qs.shape[1]
        q = torch.zeros(-(-n // 16) * 16, kc, 32, dtype=torch.uint8)
        q[:n] = _nibbles(self.qs)
        return q

    def pack_amx_q4(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A q4_1 weight in the AMX decode kernel's layout (``csrc/amx_q4_panels.h``): nibbles uint8
        [ceil(N/16), K/32, 16, 16], byte b of k-pair row p holding column b // 2 (low nibble) and 8 + b // 2 (high)
        at depth 2p + b % 2; scales fp32 [ceil(N/16), K/32, 2, 16] (d, then m, per column). Columns past N: zeros."""
        q = self._tile_quants()
        tiles, kc = q.shape[0] // 16, q.shape[1]
        # [tile, n, kc, p, j] -> [tile, kc, p, lane = 2 n + j]; lanes 0-15 in the low nibbles, 16-31 in the high
        lanes = q.view(tiles, 16, kc, 16, 2).permute(0, 2, 3, 1, 4).reshape(tiles, kc, 16, 32)
        q4 = (lanes[..., :16] | (lanes[..., 16:] << 4)).contiguous()
        return q4, self._tile_scales()

    def shapes_only(self) -> "GGUFWeight":
        """This weight with its quants and scales as meta tensors: their shapes, no bytes (CPULinear's
        drop_unread)."""
        return GGUFWeight(self.kind, self.qs.to("meta"), self.scales.to("meta"))

    def dequantize(self, dtype: torch.dtype = torch.float32, kernel: Callable | None = None) -> torch.Tensor:
        """The weight in dtype: each the fp32 value the kernel computes (and ``gguf.quants.dequantize``), rounded once
        to dtype. kernel: torch.ops.pagellm.gguf_dequantize (``csrc/gguf_unpack_cpu.cpp``, the same values in one
        pass), else made here DEQUANT_FLOATS values at a time: a fresh GB-sized fp32 temporary costs more in page
        faults than in arithmetic (a 1.1B-parameter Q4_1 file's engine start-up, with pack_vnni_int8 likewise: ~8
        against 23-91 s on Zen 4, 2026-12-06)."""
        n, k = self.shape
        out = torch.empty(n, k, dtype=dtype)
        if kernel is not None and dtype in (torch.float32, torch.bfloat16, torch.float16):
            kernel(self.qs, self.scales, self.kind, out)
            return out
        rows = max(1, DEQUANT_FLOATS // max(k, 1))
        for r in range(0, n, rows):
            out[r:r + rows] = self._dequantize_rows(r, min(n, r + rows))
        return out

    def _dequantize_rows(self, r0: int, r1: int) -> torch.Tensor:
        """Rows [r0, r1) of the fp32 weight."""
        qs, scales = self.qs[r0:r1], self.scales[r0:r1]
        if self.kind == "q4_1":
            w = scales[..., :1] * _nibbles(qs).float() + scales[..., 1:]
        elif self.kind == "u8_1":
            w = scales[..., :1] * qs.float() + scales[..., 1:]
        elif self.kind == "q8_0":
            w = qs.float() * scales
        else:
            w = (qs.float().unflatten(-1, (2, 16)) * scales.unsqueeze(-1)).flatten(-2)
        return w.reshape(r1 - r0, self.shape[1])

    def _rounding_error_rows(self, r0: int, r1: int) -> torch.Tensor:
        """Rows [r0, r1)'s squared error from the file's own rounding, as for a value rounded to the nearest of
        steps d (d^2 / 12 a weight), summed over each row: fp32 [r1 - r0]. Every layout's first scale is its step
        (Q6_K's two, one per 16 weights)."""
        s = self.scales[r0:r1]
        if self.kind == "q8_2":
            return s.square().sum((-2, -1)) * (16 / 12)
        return s[..., 0].square().sum(-1) * (32 / 12)


@dataclass
class GGUFParts:
    """A fused weight whose parts lie in different layouts: their rows stacked in order, one kernel call each into
    its columns of the output."""

    parts: list[GGUFWeight]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def pieces(self) -> list[tuple[GGUFWeight, int]]:
        out, col = [], 0
        for p in self.parts:
            out.append((p, col))
            col += p.shape[0]
        return out

    def shapes_only(self) -> "GGUFParts":
        return GGUFParts([p.shapes_only() for p in self.parts])

    def dequantize(self, dtype: torch.dtype = torch.float32, kernel: Callable | None = None) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype, kernel) for p in self.parts])

    def _rows(self, r0: int, r1: int, rows: Callable[[GGUFWeight, int, int], torch.Tensor]) -> torch.Tensor:
        """Rows [r0, r1) across the parts: rows(part, a, b) for each part's share [a, b) of them."""
        out, first = [], 0
        for p in self.parts:
            n = p.shape[0]
            a, b = max(r0, first), min(r1, first + n)
            if a < b:
                out.append(rows(p, a - first, b - first))
            first += n
        return torch.cat(out)

    def _dequantize_rows(self, r0: int, r1: int) -> torch.Tensor:
        return self._rows(r0, r1, GGUFWeight._dequantize_rows)

    def _rounding_error_rows(self, r0: int, r1: int) -> torch.Tensor:
        return self._rows(r0, r1, GGUFWeight._rounding_error_rows)


def pack_vnni_int8(q: GGUFWeight | GGUFParts, max_excess: float = math.inf, per_block: bool = False,
                   kernel: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """A GGUF weight of any layout (or a fused one of mixed layouts) as the int8 dot-product kernel takes it
    (``csrc/vnni_int8_linear_cpu.cpp``): each output column's exact values rounded to int8 steps of s = max|w| /
    127 over the column, or with per_block over each 32-deep block of it (nearest, ties to even; at most s / 2
    off), int8 [ceil(N/16), K/32, 8, 64], byte 4 n + e of row j of block b holding column n's value at depth
    32 b + 4 j + e (one VPDPBUSD operand); fp32 [ceil(N/16), 2, 16] (per_block: [ceil(N/16), K/32, 2, 16], a
    block's): the 16 columns' s, then the bits of their int32 offsets, -128 times the column's (block's) sum of
    int8 values. Columns past N: zeros. Third: the worst column's excess, the squared error the int8 rounding adds
    over the column divided by the file's own rounding's (``_rounding_error_rows``): a guard against a column
    whose one outlying value makes s much coarser than its blocks' steps (SmolLM2-135M's Q4_1: 0.009-0.016 over
    whole weights, at most 0.36 in one column), and against a file whose own steps are finer than one step per
    column can follow (Q8_0's 127 per 32 weights: over 1 per column in practice; per block its values exactly, 0);
    infinite for a column holding a value that is not finite. None as soon as a column's excess is over max_excess.
    kernel: torch.ops.pagellm.vnni_int8_pack (``csrc/gguf_unpack_cpu.cpp``: the same bytes, each value decoded,
    rounded and placed in one pass), else made here a few MB of fp32 at a time (see GGUFWeight.dequantize)."""
    n, k = q.shape
    kc = k // 32
    tiles = -(-n // 16)
    packed = torch.empty(tiles, kc, 8, 64, dtype=torch.int8)
    out = torch.empty((tiles, kc, 2, 16) if per_block else (tiles, 2, 16), dtype=torch.float32)
    if kernel is not None and tiles:  # it writes the real columns only
        packed[-1].zero_()
        out[-1].zero_()
        col_excess = torch.zeros(tiles * 16)
    excess = 0.0
    # tiles a chunk: here a few MB of fp32; the kernel stages nothing, so all the rest in one call (its threads split
    # them)
    chunk = tiles if kernel is not None else max(1, DEQUANT_FLOATS // (16 * k))
    t0, size = 0, 1  # one tile first: a weight whose steps are too fine for the form (Q8_0) is told at once
    while t0 < tiles:
        t1 = min(tiles, t0 + size)
        r0, r1 = 16 * t0, min(n, 16 * t1)  # the chunk's real columns (at least one)
        if kernel is not None:
            for part, first in q.pieces:
                a, b = max(r0, first), min(r1, first + part.shape[0])
                if a < b:
                    kernel(part.qs[a - first:b - first], part.scales[a - first:b - first], part.kind, a, per_block,
                           packed, out, col_excess)
            excess = max(excess, col_excess[r0:r1].max().item())
        else:
            excess = max(excess, _pack_tiles(q, t0, t1, per_block, packed, out))
        if excess > max_excess:
            return None
        t0, size = t1, chunk
    return packed, out, excess


def _pack_tiles(q: GGUFWeight | GGUFParts, t0: int, t1: int, per_block: bool, packed: torch.Tensor,
                out: torch.Tensor) -> float:
    """pack_vnni_int8's tiles [t0, t1) in torch, into packed and out; returns their worst column's excess."""
    n, k = q.shape
    kc, group = k // 32, 32 if per_block else k  # group: the weights one step covers
    r0, r1 = 16 * t0, min(n, 16 * t1)
    real, cols = r1 - r0, (t1 - t0) * 16
    w = torch.zeros(cols, k)
    w[:real] = q._dequantize_rows(r0, r1)
    w = w.view(cols, k // group, group)
    step = w.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    steps = w.mul_(inv)  # w in steps, in place
    w8f = torch.round(steps)
    added = (steps[:real].sub_(w8f[:real]).square_().sum(-1) * step[:real, :, 0].square()).sum(-1)
    own = q._rounding_error_rows(r0, r1)
    w8 = w8f.clamp_(-127, 127).to(torch.int8)
    offsets = -128 * w8.sum(-1, dtype=torch.int32)  # [cols, groups]
    if per_block:
        out[t0:t1, :, 0] = step.view(t1 - t0, 16, kc).permute(0, 2, 1)
        out[t0:t1, :, 1].view(torch.int32).copy_(offsets.view(t1 - t0, 16, kc).permute(0, 2, 1))
    else:
        out[t0:t1, 0] = step.view(t1 - t0, 16)
        out[t0:t1, 1].view(torch.int32).copy_(offsets.view(t1 - t0, 16))
    packed[t0:t1] = w8.view(t1 - t0, 16, kc, 8, 4).permute(0, 2, 3, 1, 4).reshape(t1 - t0, kc, 8, 64)
    excess = torch.where(added > 0, added / own, torch.zeros_like(added))
    return excess.masked_fill_(added.isnan(), math.inf).max().item()  # a value that is not finite: declined
