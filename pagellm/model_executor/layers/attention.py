"""PagedAttention: attention that reads K/V straight from the block pool through block tables.

A step's batch is flattened: request r owns query rows ``query_start_loc[r] : query_start_loc[r+1]``, which are
its tokens at positions ``seq_lens[r] - q_len[r] .. seq_lens[r] - 1``; it attends to keys ``0 .. seq_lens[r]-1``
that live in the blocks ``block_tables[r]``. Prefill chunks and decode tokens mix freely in one batch.

Backends implement ``AttentionBackend.forward``. ``TorchPagedAttention`` is the reference: plain torch, runs on
CPU and CUDA. Faster kernels (a CPU C++ kernel, FlashAttention's paged kernel) slot in behind the same interface.
"""
from __future__ import annotations

from dataclasses import dataclass

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger("pagellm")


@dataclass
class AttentionMetadata:
    """Per-step inputs shared by every attention layer (built once per step by the model runner)."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token (block_id * block_size + offset)
    block_tables: torch.Tensor  # [R, max_blocks] int64, padded with 0
    # Varlen form of the batch (what FlashAttention-style GPU kernels take); the CPU backends use the host lists.
    seq_lens: torch.Tensor  # [R] int64: context length after this step
    query_start_loc: torch.Tensor  # [R + 1] int64
    # Host-side copies and the decode/prefill split, computed once per step for the backend's dispatch.
    seq_lens_list: list[int]
    query_start_list: list[int]
    query_lens_list: list[int]
    # Decode rows (exactly one query token), gathered once per step for all layers:
    decode_q_idx: torch.Tensor  # [Rd] their query row in the flattened batch
    decode_block_tables: torch.Tensor  # [Rd, max_blocks] contiguous
    decode_seq_lens: torch.Tensor  # [Rd]
    max_decode_seq_len: int
    prefill_rows: list[int]  # request indices with more than one query token


class AttentionBackend:
    """Interface of an attention backend: write this step's K/V into the cache, attend through block tables."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, sliding_window: int | None) -> torch.Tensor:
        raise NotImplementedError


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V rows into their slots. kv_cache: [2, num_blocks, block_size, Hkv, D]."""
    k_flat, v_flat, _ = _flat(kv_cache)
    k_flat.index_copy_(0, slot_mapping, k)
    v_flat.index_copy_(0, slot_mapping, v)


def _key_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, seq_len: torch.Tensor,
              sliding_window: int | None) -> torch.Tensor:
    """True where query at q_pos may attend key at k_pos (causal, within length, within window)."""
    m = (k_pos <= q_pos) & (k_pos < seq_len)
    if sliding_window is not None:
        m &= k_pos > q_pos - sliding_window
    return m


class TorchPagedAttention(AttentionBackend):
    """Reference backend in plain torch.

    Decode rows (one query token) are done together: their K/V is gathered from the blocks into a padded batch
    for this layer only (a transient, freed right away), masked by length, one SDPA call. Prefill chunks are few
    per step; each is gathered and attended with an offset causal mask.
    """

    def forward(self, q, k, v, kv_cache, meta, scale, sliding_window):
        write_kv(kv_cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        if meta.decode_q_idx.numel():
            q_idx = meta.decode_q_idx
            out[q_idx] = self.decode(q[q_idx], kv_cache, meta, scale, sliding_window)
        for r in meta.prefill_rows:
            q0, qlen = meta.query_start_list[r], meta.query_lens_list[r]
            out[q0:q0 + qlen] = self.prefill(q[q0:q0 + qlen], kv_cache, meta, r, scale, sliding_window)
        return out

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               sliding_window: int | None) -> torch.Tensor:
        """q: [Rd, H, D], one query per decode row (the last position of its context) -> [Rd, H, D]."""
        ctx = meta.max_decode_seq_len
        k_flat, v_flat, bs = _flat(kv_cache)
        slots = (meta.decode_block_tables[:, :-(-ctx // bs), None] * bs
                 + torch.arange(bs, device=q.device)).reshape(q.shape[0], -1)[:, :ctx]  # [Rd, L]
        kd = k_flat[slots].transpose(1, 2)  # [Rd, Hkv, L, D]
        vd = v_flat[slots].transpose(1, 2)
        seq = meta.decode_seq_lens[:, None]
        mask = _key_mask(seq - 1, torch.arange(ctx, device=q.device)[None, :], seq, sliding_window)  # [Rd, L]
        o = F.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, attn_mask=mask[:, None, None, :], scale=scale,
                                           enable_gqa=q.shape[1] != kd.shape[1])
        return o.squeeze(2)

    def prefill(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, r: int, scale: float,
                sliding_window: int | None) -> torch.Tensor:
        """q: [Lq, H, D], the last Lq positions of request r's context -> [Lq, H, D]."""
        qlen, ctx = q.shape[0], meta.seq_lens_list[r]
        k_flat, v_flat, bs = _flat(kv_cache)
        slots = (meta.block_tables[r, :-(-ctx // bs), None] * bs + torch.arange(bs, device=q.device)).reshape(-1)[:ctx]
        kp = k_flat[slots].transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
        vp = v_flat[slots].transpose(0, 1).unsqueeze(0)
        qp = q.transpose(0, 1).unsqueeze(0)  # [1, H, Lq, D]
        gqa = q.shape[1] != kp.shape[1]
        if qlen == ctx and sliding_window is None:
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            q_pos = torch.arange(ctx - qlen, ctx, device=q.device)[:, None]
            mask = _key_mask(q_pos, torch.arange(ctx, device=q.device)[None, :], torch.tensor(ctx, device=q.device),
                             sliding_window)
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=gqa)
        return o[0].transpose(0, 1)


def _flat(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """K and V of one layer as [num_slots, Hkv, D] views, and the block size."""
    nb, bs = kv_cache.shape[1], kv_cache.shape[2]
    return kv_cache[0].view(nb * bs, *kv_cache.shape[3:]), kv_cache[1].view(nb * bs, *kv_cache.shape[3:]), bs


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """"auto": the C++ CPU kernel on CPU (torch reference if it cannot be built), the reference elsewhere."""
    if name == "torch" or (name == "auto" and device.type != "cpu"):
        return TorchPagedAttention()
    from pagellm.model_executor.layers.cpu_attention import CPUPagedAttention

    if name == "cpu":
        return CPUPagedAttention()
    try:
        return CPUPagedAttention()
    except Exception as e:  # no compiler, no headers...: stay correct, only slower
        logger.warning("CPU attention kernel unavailable (%s); using the torch reference backend", e)
        return TorchPagedAttention()
