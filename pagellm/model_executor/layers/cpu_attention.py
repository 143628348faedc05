"""CPU PagedAttention backend: the C++ kernels of ``csrc/paged_attention_cpu.cpp`` behind the backend interface.

The cache uses the kernel's own layout (x = 4 bytes / element size, so 2 for bf16 and 1 for fp32):
K [num_blocks, kv_heads, head_dim/x, block_size, x], V [num_blocks, kv_heads, block_size/x, head_dim, x].
Decode rows read K/V in place from the blocks; prefill chunks gather their context once per layer and use
SDPA's flash kernel, which is already efficient for many query rows. The backend also carries the fused
element-wise ops (``ops``) the model uses on CPU.
"""
from __future__ import annotations

import torch

from pagellm.model_executor.layers.attention import AttentionMetadata, TorchPagedAttention
from pagellm.model_executor.layers.cpu_kernels import load_extension


class CPUPagedAttention(TorchPagedAttention):
    def __init__(self, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        super().__init__(num_kv_heads, head_dim, block_size)
        if block_size % 2:
            raise ValueError(f"block_size must be even for the CPU kernels, got {block_size}")
        self.ops = load_extension()

    def views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        nb, x = kv_cache.shape[1], 4 // kv_cache.element_size()
        h, d, b = self.num_kv_heads, self.head_dim, self.block_size
        return kv_cache[0].view(nb, h, d // x, b, x), kv_cache[1].view(nb, h, b // x, d, x)

    def write_kv(self, kv_cache, k, v, slot_mapping) -> None:
        kc, vc = self.views(kv_cache)
        self.ops.write_kv_cache(k, v, kc, vc, slot_mapping)

    def gather(self, kv_cache: torch.Tensor, blocks: torch.Tensor, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
        kc, vc = self.views(kv_cache)
        blocks = blocks[:-(-ctx // self.block_size)]
        h, d = self.num_kv_heads, self.head_dim
        k = kc[blocks].permute(1, 0, 3, 2, 4).reshape(h, -1, d)[:, :ctx]
        v = vc[blocks].permute(1, 0, 2, 4, 3).reshape(h, -1, d)[:, :ctx]
        return k, v

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               sliding_window: int | None) -> torch.Tensor:
        kc, vc = self.views(kv_cache)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self.ops.paged_decode_attention(q, kc, vc, meta.decode_block_tables, meta.decode_seq_lens, out, scale,
                                        sliding_window or 0)
        return out
