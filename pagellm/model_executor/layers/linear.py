"""Linear layers for CPU decode: the weight pre-packed once into oneDNN's blocked layout.

``F.linear`` hands oneDNN a plain row-major weight, which it re-packs on every call. With a few rows of input (a
decode step: one row per running request) that re-packing costs more than the multiply itself; measured here on
SmolLM2's layer shapes, 64 rows, bf16: 40 ms per step for all layers plainly against 24 ms pre-packed. With
thousands of rows (a prefill chunk) the two are even and the plain path is kept, so each layer holds both forms
(about 270 MB more for the default model). fp32 keeps the plain path only, which is the same GEMM HF transformers
calls, so greedy tokens stay exactly the reference's.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger("pagellm")

# At most this many rows go through the packed weight.
PACKED_MAX_ROWS = 128


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """Wraps an ``nn.Linear``: small batches through the packed weight, large ones through the plain one."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear
        self.packed = pack_weight(linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= PACKED_MAX_ROWS and x.dim() == 2:
            return packed_linear(x, self.packed, self.linear.bias)
        return self.linear(x)


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


def prepack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` under ``model`` by a ``PackedLinear``; returns how many were packed."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, PackedLinear(linear))
    return len(targets)
