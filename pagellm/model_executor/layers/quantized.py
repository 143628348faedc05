"""GGUF weights kept in the file's own blocks, for the linears' few-row path (``csrc/gguf_linear_cpu.cpp``).

A decode step with a handful of requests is a pass over every weight, bound by memory bandwidth. The default
model's layer linears are Q4_1 (32 weights a block, ``w = d * q + m``, q a nibble) and its tied embeddings Q8_0
(``w = q * d``, q an int8): kept so, they are a third and a half of bf16's bytes. The loader dequantizes every tensor
for the model's parameters as before and, for such a weight, also keeps its blocks (``gguf_loader.load_gguf``); the
model fuses them as it fuses the parameters (q/k/v, gate/up) and hands them to its ``CPULinear`` layers, which take
them up to ``GEMV_MAX_ROWS`` rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# bytes of one 32-weight block in the file: fp16 d, fp16 m, 16 bytes of nibbles / fp16 d, 32 int8
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}


@dataclass
class GGUFWeight:
    """A weight [N, K] in blocks of 32, split for the kernel: ``qs`` the quants, uint8 [N, K/32, 16] for Q4_1
    (byte j: element j in its low nibble, j + 16 in its high one, as in the file) or int8 [N, K/32, 32] for Q8_0;
    ``scales`` fp32 [N, K/32, 2] (d, m) or [N, K/32, 1] (d): fp32 so the kernel broadcasts them from memory."""

    kind: str  # "q4_1" or "q8_0"
    qs: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def from_blocks(cls, kind: str, blocks: torch.Tensor) -> "GGUFWeight":
        """blocks: uint8 [N, K/32 * BLOCK_BYTES[kind]], each row the file's blocks of one output row."""
        b = blocks.reshape(blocks.shape[0], -1, BLOCK_BYTES[kind])
        if kind == "q4_1":
            return cls(kind, b[..., 4:].contiguous(), b[..., :4].contiguous().view(torch.float16).float())
        return cls(kind, b[..., 2:].contiguous().view(torch.int8), b[..., :2].contiguous().view(torch.float16).float())

    @staticmethod
    def cat(parts: list["GGUFWeight"]) -> "GGUFWeight | None":
        """Rows stacked, as ``torch.cat`` of the weights (fused q/k/v, gate/up); None for parts of different kinds."""
        if len({p.kind for p in parts}) != 1:
            return None
        if len(parts) == 1:
            return parts[0]
        return GGUFWeight(parts[0].kind, torch.cat([p.qs for p in parts]), torch.cat([p.scales for p in parts]))

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] * 32

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight as the loader computes it (``gguf_loader._dequantize_torch``)."""
        if self.kind == "q4_1":
            q = torch.cat([self.qs & 0x0F, self.qs >> 4], dim=-1).float()
            w = self.scales[..., :1] * q + self.scales[..., 1:]
        else:
            w = self.qs.float() * self.scales
        return w.reshape(self.shape)
