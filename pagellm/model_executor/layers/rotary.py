"""Rotary position embedding with a precomputed cos/sin table indexed by absolute position.

The inverse frequencies come from transformers' own ``ROPE_INIT_FUNCTIONS`` (default, linear, llama3, yarn,
longrope...), so every rope-scaling variant a config can name is computed exactly as the reference does.
Dynamic NTK scaling changes frequencies with the sequence length and cannot share one table; it is refused.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config, head_dim: int, max_position: int) -> None:
        super().__init__()
        params = getattr(hf_config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "dynamic":
            raise ValueError("rope_type 'dynamic' is not supported (its frequencies change with sequence length)")
        if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"unknown rope_type {rope_type!r}; supported: default, {sorted(ROPE_INIT_FUNCTIONS)}")
        self.hf_config, self.rope_type, self.params = hf_config, rope_type, params
        self.head_dim, self.max_position = head_dim, max_position
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def build_tables(self, device: torch.device) -> None:
        """Compute the fp32 cos/sin tables on ``device``; called once the model is materialised there."""
        inv_freq, scaling = self._inv_freq(self.hf_config, self.rope_type, self.params, self.head_dim)
        positions = torch.arange(self.max_position, dtype=torch.float32, device=device)
        freqs = positions[:, None] * inv_freq.to(device=device, dtype=torch.float32)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos() * scaling  # [max_position, head_dim]
        self.sin = emb.sin() * scaling

    @staticmethod
    def _inv_freq(hf_config, rope_type: str, params: dict, head_dim: int) -> tuple[torch.Tensor, float]:
        if rope_type == "default":
            return _default_inv_freq(params.get("rope_theta", 10000.0), head_dim), 1.0
        if rope_type in ROPE_INIT_FUNCTIONS:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
            return inv_freq.float(), float(scaling)
        raise AssertionError(rope_type)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin rows for this step's positions, [T, head_dim] in ``dtype``: once per step, shared by layers."""
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q: [T, H, D], k: [T, Hkv, D], cos/sin: [T, D] -> rotated (rotate-half convention, as HF Llama)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
