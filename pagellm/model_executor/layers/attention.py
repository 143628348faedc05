"""PagedAttention: attention that reads K/V straight from the block pool through block tables.

A step's batch is flattened: request r owns query rows ``query_start_loc[r] : query_start_loc[r+1]``, which are
its tokens at positions ``seq_lens[r] - q_len[r] .. seq_lens[r] - 1``; it attends to keys ``0 .. seq_lens[r]-1``
that live in the blocks ``block_tables[r]``. Prefill chunks and decode tokens mix freely in one batch.

Backends implement ``AttentionBackend.forward``. ``TorchPagedAttention`` is the reference: plain torch, runs on
CPU and CUDA. Faster kernels (a CPU C++ kernel, FlashAttention's paged kernel) slot in behind the same interface.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-step inputs shared by every attention layer (built once per step by the model runner)."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token (block_id * block_size + offset)
    block_tables: torch.Tensor  # [R, max_blocks] int64, padded with 0
    seq_lens: torch.Tensor  # [R] int64: context length after this step
    query_start_loc: torch.Tensor  # [R + 1] int64
    block_size: int
    # Host-side copies and the decode/prefill split, computed once per step for the backend's dispatch.
    seq_lens_list: list[int]
    query_start_list: list[int]
    query_lens_list: list[int]
    decode_rows: torch.Tensor  # [Rd] request indices with exactly one query token
    prefill_rows: list[int]  # request indices with more than one query token
    max_decode_seq_len: int


class AttentionBackend:
    """Interface of an attention backend: write this step's K/V into the cache, attend through block tables."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, sliding_window: int | None) -> torch.Tensor:
        raise NotImplementedError


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V rows into their slots. kv_cache: [2, num_blocks, block_size, Hkv, D]."""
    nb, bs = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, nb * bs, *kv_cache.shape[3:])
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


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
        num_heads = q.shape[1]
        out = torch.empty_like(q)
        nb, bs = kv_cache.shape[1], kv_cache.shape[2]
        k_flat = kv_cache[0].view(nb * bs, *kv_cache.shape[3:])
        v_flat = kv_cache[1].view(nb * bs, *kv_cache.shape[3:])
        gqa = num_heads != k_flat.shape[1]

        if meta.decode_rows.numel():
            rows = meta.decode_rows
            ctx = meta.max_decode_seq_len
            nblk = -(-ctx // bs)
            slots = (meta.block_tables[rows, :nblk, None] * bs
                     + torch.arange(bs, device=q.device)).reshape(len(rows), -1)[:, :ctx]  # [Rd, L]
            kd = k_flat[slots].transpose(1, 2)  # [Rd, Hkv, L, D]
            vd = v_flat[slots].transpose(1, 2)
            seq = meta.seq_lens[rows, None]
            k_pos = torch.arange(ctx, device=q.device)[None, :]
            mask = _key_mask(seq - 1, k_pos, seq, sliding_window)  # [Rd, L]
            q_idx = meta.query_start_loc[rows]
            qd = q[q_idx].unsqueeze(2)  # [Rd, H, 1, D]
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask[:, None, None, :], scale=scale,
                                               enable_gqa=gqa)
            out[q_idx] = o.squeeze(2)

        for r in meta.prefill_rows:
            q0 = meta.query_start_list[r]
            qlen = meta.query_lens_list[r]
            ctx = meta.seq_lens_list[r]
            nblk = -(-ctx // bs)
            slots = (meta.block_tables[r, :nblk, None] * bs + torch.arange(bs, device=q.device)).reshape(-1)[:ctx]
            kp = k_flat[slots].transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
            vp = v_flat[slots].transpose(0, 1).unsqueeze(0)
            qp = q[q0:q0 + qlen].transpose(0, 1).unsqueeze(0)  # [1, H, Lq, D]
            if qlen == ctx and sliding_window is None:
                o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=gqa)
            else:
                q_pos = torch.arange(ctx - qlen, ctx, device=q.device)[:, None]
                k_pos = torch.arange(ctx, device=q.device)[None, :]
                mask = _key_mask(q_pos, k_pos, torch.tensor(ctx, device=q.device), sliding_window)
                o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=gqa)
            out[q0:q0 + qlen] = o[0].transpose(0, 1)
        return out
