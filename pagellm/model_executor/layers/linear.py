"""Linear layers for CPU decode: a streaming kernel for a few rows, oneDNN with pre-packed weights for more.

``F.linear`` hands oneDNN a plain row-major weight, which it re-packs on every call. With a few rows of input (a
decode step: one row per running request) that re-packing costs more than the multiply itself; measured here on
SmolLM2's layer shapes, 64 rows, bf16: 40 ms per step for all layers plainly against 24 ms pre-packed. With
thousands of rows (a prefill chunk) the two are even and the plain path is kept, so each layer holds both forms
(about 270 MB more for the default model). fp32 keeps the plain path only, which is the same GEMM HF transformers
calls, so greedy tokens stay exactly the reference's.

With at most GEMV_MAX_ROWS rows (single-stream decode) our own kernel (``csrc/gemv_cpu.cpp``) streams the plain
weight once at close to memory bandwidth: 30 layers x 4 linears of SmolLM2 at one row, bf16, 10-12 ms against
16-23 ms through oneDNN, measured here.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger("pagellm")

# At most this many rows go through the packed weight; at most GEMV_MAX_ROWS through the streaming kernel.
PACKED_MAX_ROWS = 128
GEMV_MAX_ROWS = 4


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor,
               gemv) -> torch.Tensor:
    """x @ weight.T + bias by the fastest path for x's number of rows (``gemv``: the kernel op, or None)."""
    rows = x.shape[0]
    if gemv is not None and rows <= GEMV_MAX_ROWS and x.stride(-1) == 1:
        out = torch.empty(rows, weight.shape[0], dtype=x.dtype, device=x.device)
        gemv(x, weight, bias, out)
        return out
    if rows <= PACKED_MAX_ROWS:
        return packed_linear(x, packed, bias)
    return F.linear(x, weight, bias)


class PackedLinear(nn.Module):
    """Wraps an ``nn.Linear``: its weight is also kept pre-packed; ``cpu_linear`` picks the path per call."""

    def __init__(self, linear: nn.Linear, gemv) -> None:
        super().__init__()
        self.linear = linear
        self.packed = pack_weight(linear.weight)
        self.gemv = gemv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self.linear(x)
        return cpu_linear(x, self.linear.weight, self.linear.bias, self.packed, self.gemv)


def packing_works(dtype: torch.dtype) -> bool:
    """True if oneDNN packing is available here and agrees with F.linear (checked once on a small case)."""
    if dtype not in (torch.bfloat16, torch.float16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(96, 64, generator=g).to(dtype)
        x = torch.randn(5, 64, generator=g).to(dtype)
        ok = torch.allclose(packed_linear(x, pack_weight(w), None).float(), F.linear(x, w).float(), rtol=2e-2, atol=2e-2)
    except (RuntimeError, AttributeError) as e:
        logger.info("oneDNN weight packing unavailable (%s); using plain linear layers", e)
        return False
    return ok


def gemv_op(ops, dtype: torch.dtype):
    """The streaming kernel if this build and CPU have it (AVX512-BF16) and the dtype is bf16, else None."""
    if ops is None or dtype != torch.bfloat16:
        return None
    try:
        return ops.small_m_linear.default if ops.small_m_linear_supported() else None
    except (RuntimeError, AttributeError):
        return None


def prepack_linears(model: nn.Module, gemv) -> int:
    """Replace every ``nn.Linear`` under ``model`` by a ``PackedLinear``; returns how many were packed."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, PackedLinear(linear, gemv))
    return len(targets)
