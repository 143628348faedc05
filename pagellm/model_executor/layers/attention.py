"""PagedAttention: attention that reads K/V straight from the block pool through block tables.

A step's batch is flattened: request r owns query rows ``query_start_loc[r] : query_start_loc[r+1]``, which are
its tokens at positions ``seq_lens[r] - q_len[r] .. seq_lens[r] - 1``; it attends to keys ``0 .. seq_lens[r]-1``
that live in the blocks ``block_tables[r]``. Prefill chunks and decode tokens mix freely in one batch.

Backends implement ``AttentionBackend.forward``. ``TorchPagedAttention`` is the reference: plain torch, runs on
CPU and CUDA. Faster kernels (a CPU C++ kernel, FlashAttention's paged kernel) slot in behind the same interface.
"""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

logger = logging.getLogger("pagellm")


@dataclass
class CascadePrefix:
    """Cascade attention for decode rows that share a prefix (a system prompt, a few-shot preamble, n samples of
    one prompt): those requests' block tables begin with the same full blocks. A backend that supports it attends
    the shared prefix once for all of them, as one batched matmul per kv head (its keys and values read once per
    step, not once per request), the rest of each context as usual, and merges the two parts by their log-sum-exp.
    Backends without it simply attend to the whole context."""

    blocks: torch.Tensor  # [P] int64: the shared blocks (P * block_size tokens)
    rows: torch.Tensor  # [Rc] int64: the query rows (one decode token each) of the requests that share them
    kv_start: torch.Tensor  # [R] int64: P * block_size for those requests, 0 for the others


def find_cascade_prefix(block_tables: np.ndarray, seq_lens: np.ndarray, decode_rows: np.ndarray,
                        query_start: np.ndarray, block_size: int, min_requests: int = 8,
                        min_tokens: int = 256) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The longest run of leading blocks shared by the largest group of decode requests (those whose first block
    is the most common one), if it is worth a cascade: at least ``min_requests`` requests and ``min_tokens``
    tokens (vLLM's thresholds). Only blocks wholly before each request's new token count. Returns (blocks, the
    group's query rows, kv_start per request) or None."""
    if len(decode_rows) < min_requests:
        return None
    first = block_tables[decode_rows, 0]
    values, counts = np.unique(first, return_counts=True)
    if counts.max() < min_requests:
        return None
    group = decode_rows[first == values[counts.argmax()]]
    n = int(seq_lens[group].min() - 1) // block_size  # full blocks before every group member's new token
    if n * block_size < min_tokens:
        return None
    bt = block_tables[group, :n]
    same = (bt == bt[0]).all(axis=0)
    if not same.all():
        n = int(same.argmin())
        if n * block_size < min_tokens:
            return None
    kv_start = np.zeros(len(seq_lens), dtype=np.int64)
    kv_start[group] = n * block_size
    return np.ascontiguousarray(bt[0, :n]), query_start[group], kv_start


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
    # Per-step memo of prefill attention masks, keyed by (request, window): built by the first layer, reused by
    # the others (a 2,048 x 7,000 mask is worth building once, not 30 times).
    masks: dict = field(default_factory=dict)
    cascade: CascadePrefix | None = None  # built only for a backend with ``supports_cascade``


class AttentionBackend:
    """Interface of an attention backend. A layer's cache is one tensor [2 (K, V), num_blocks, block_elems]; the
    backend owns the layout inside a block (``views``), writes this step's K/V into it and attends through the
    block tables. ``ops`` holds fused element-wise kernels that go with the backend (None: plain torch)."""

    ops = None
    supports_cascade = False  # reads AttentionMetadata.cascade (others may ignore it: it is only a speed-up)
    # The cache's unused slots must hold finite values (the torch reference multiplies whole blocks by masked
    # weights: 0 * NaN would leak). A backend that never reads a slot outside a context sets it False, and the
    # runner then leaves the cache unwritten until tokens land in it (see ModelRunner).
    needs_zeroed_cache = True

    def __init__(self, num_kv_heads: int, head_dim: int, block_size: int,
                 kv_cache_dtype: torch.dtype | None = None) -> None:
        self.num_kv_heads, self.head_dim, self.block_size = num_kv_heads, head_dim, block_size
        # None: the cache holds the model's dtype; an fp8 type: K/V are stored rounded to it (saturated) and read
        # back as the model's dtype (kv_cache_dtype="fp8*")
        self.kv_cache_dtype = kv_cache_dtype
        self.fp8 = kv_cache_dtype is not None and torch.finfo(kv_cache_dtype).bits == 8

    def to_cache(self, x: torch.Tensor) -> torch.Tensor:
        """x as the cache stores it: fp8 values saturate at the format's largest finite value (as vLLM's casts)."""
        if not self.fp8:
            return x
        m = torch.finfo(self.kv_cache_dtype).max
        return x.clamp(-m, m).to(self.kv_cache_dtype)

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        raise NotImplementedError

    def gather(self, kv_cache: torch.Tensor, blocks: torch.Tensor, ctx: int,
               dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the first ``ctx`` tokens held in ``blocks``, each [kv_heads, ctx, head_dim], as ``dtype``
        (default: the cache's)."""
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, sliding_window: int | None) -> torch.Tensor:
        raise NotImplementedError


# SDPA's kernels for the torch backend on CUDA: torch 2.11 tries cuDNN's attention first for a masked bf16 call
# on recent GPUs (reported on a B200; bf16 on our H200 ran ~3x slower than fp32), and cuDNN builds an execution
# plan for every shape it has not seen, ~0.4 s each; this backend brings a new shape nearly every step (each
# prefill chunk's length, each decode step's longest context). So cuDNN is left out; FlashAttention takes the
# causal chunks, memory-efficient attention the masked ones. PAGELLM_SDPA_CUDNN=1 lets torch choose cuDNN again.
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_SDPA_CUDNN = os.environ.get("PAGELLM_SDPA_CUDNN", "0") == "1"


def sdpa_backends(device: torch.device) -> contextlib.AbstractContextManager:
    """The SDPA kernels this backend's calls may take on ``device``: CUDA_SDPA_BACKENDS on CUDA (no cuDNN, see
    above), torch's own choice elsewhere."""
    if device.type != "cuda" or _SDPA_CUDNN:
        return contextlib.nullcontext()
    return sdpa_kernel(CUDA_SDPA_BACKENDS)


def _key_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, seq_len: torch.Tensor,
              sliding_window: int | None) -> torch.Tensor:
    """True where query at q_pos may attend key at k_pos (causal, within length, within window)."""
    m = (k_pos <= q_pos) & (k_pos < seq_len)
    if sliding_window is not None:
        m &= k_pos > q_pos - sliding_window
    return m


class TorchPagedAttention(AttentionBackend):
    """Reference backend in plain torch; runs on CPU and CUDA. A block holds [block_size, kv_heads, head_dim].

    Decode rows (one query token) are done together: their K/V is gathered from the blocks into a padded batch
    for this layer only (a transient, freed right away), masked by length, one SDPA call. Prefill chunks are few
    per step; each attends with an offset causal mask to its context (gathered, unless the chunk is the whole
    context, when the chunk's own K/V are used as they are).
    """

    def views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as [num_slots, kv_heads, head_dim] (slot = block * block_size + offset)."""
        shape = (-1, self.num_kv_heads, self.head_dim)
        return kv_cache[0].view(shape), kv_cache[1].view(shape)

    def write_kv(self, kv_cache, k, v, slot_mapping) -> None:
        k_flat, v_flat = self.views(kv_cache)
        if self.fp8:  # torch has no index_copy_ for fp8 types: copy the bytes
            k_flat, v_flat = k_flat.view(torch.uint8), v_flat.view(torch.uint8)
            k, v = self.to_cache(k).view(torch.uint8), self.to_cache(v).view(torch.uint8)
        k_flat.index_copy_(0, slot_mapping, k)
        v_flat.index_copy_(0, slot_mapping, v)

    def gather(self, kv_cache, blocks, ctx, dtype=None):
        k_flat, v_flat = self.views(kv_cache)
        bs = self.block_size
        slots = (blocks[:-(-ctx // bs), None] * bs + torch.arange(bs, device=blocks.device)).reshape(-1)[:ctx]
        dtype = dtype or kv_cache.dtype
        return k_flat[slots].transpose(0, 1).to(dtype), v_flat[slots].transpose(0, 1).to(dtype)

    def forward(self, q, k, v, kv_cache, meta, scale, sliding_window):
        with sdpa_backends(q.device):
            return self._forward(q, k, v, kv_cache, meta, scale, sliding_window)

    def _forward(self, q, k, v, kv_cache, meta, scale, sliding_window):
        self.write_kv(kv_cache, k, v, meta.slot_mapping)
        if not meta.prefill_rows:  # a pure decode step: no gather/scatter of rows
            return self.decode(q, kv_cache, meta, scale, sliding_window)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.decode_q_idx.numel():
            q_idx = meta.decode_q_idx
            out[q_idx] = self.decode(q[q_idx], kv_cache, meta, scale, sliding_window)
        for r in meta.prefill_rows:
            q0, qlen = meta.query_start_list[r], meta.query_lens_list[r]
            rows = slice(q0, q0 + qlen)
            out[rows] = self.prefill(q[rows], k[rows], v[rows], kv_cache, meta, r, scale, sliding_window)
        return out

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               sliding_window: int | None) -> torch.Tensor:
        """q: [Rd, H, D], one query per decode row (the last position of its context) -> [Rd, H, D]."""
        ctx = meta.max_decode_seq_len
        k_flat, v_flat = self.views(kv_cache)
        bs = self.block_size
        slots = (meta.decode_block_tables[:, :-(-ctx // bs), None] * bs
                 + torch.arange(bs, device=q.device)).reshape(q.shape[0], -1)[:, :ctx]  # [Rd, L]
        kd = k_flat[slots].transpose(1, 2).to(q.dtype)  # [Rd, Hkv, L, D]
        vd = v_flat[slots].transpose(1, 2).to(q.dtype)
        seq = meta.decode_seq_lens[:, None]
        mask = _key_mask(seq - 1, torch.arange(ctx, device=q.device)[None, :], seq, sliding_window)  # [Rd, L]
        o = F.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, attn_mask=mask[:, None, None, :], scale=scale,
                                           enable_gqa=q.shape[1] != kd.shape[1])
        return o.squeeze(2)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, r: int, scale: float, sliding_window: int | None) -> torch.Tensor:
        """q, k, v: [Lq, heads, D], the last Lq positions of request r's context -> [Lq, H, D]."""
        qlen, ctx = q.shape[0], meta.seq_lens_list[r]
        if qlen == ctx:  # the whole context is in this chunk (as the cache holds it)
            kp, vp = (self.to_cache(x).to(q.dtype).transpose(0, 1) for x in (k, v))
        else:
            kp, vp = self.gather(kv_cache, meta.block_tables[r], ctx, q.dtype)
        kp, vp, qp = kp.unsqueeze(0), vp.unsqueeze(0), q.transpose(0, 1).unsqueeze(0)  # [1, heads, L, D]
        gqa = q.shape[1] != kp.shape[1]
        if qlen == ctx and sliding_window is None:
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=_prefill_mask(meta, r, qlen, ctx, sliding_window,
                                                                                 q.dtype, q.device),
                                               scale=scale, enable_gqa=gqa)
        return o[0].transpose(0, 1)


def _prefill_mask(meta: AttentionMetadata, r: int, qlen: int, ctx: int, sliding_window: int | None,
                  dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask (0 / -inf in the query dtype: SDPA's CPU flash kernel takes it faster than a boolean one)
    for the last qlen positions of a ctx-token context; memoised in the step's metadata."""
    key = (r, sliding_window)
    if key not in meta.masks:
        q_pos = torch.arange(ctx - qlen, ctx, device=device)[:, None]
        allowed = _key_mask(q_pos, torch.arange(ctx, device=device)[None, :], torch.tensor(ctx, device=device),
                            sliding_window)
        meta.masks[key] = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
    return meta.masks[key]


def preload_cpu_ops(name: str, device: torch.device):
    """The C++ CPU kernels' ops (``torch.ops.pagellm``) where select_backend(name, device, ...) takes them, loaded
    ahead of the checkpoint so that the loader unpacks a GGUF file's blocks with them; None elsewhere. Where they
    cannot be built: raises for "cpu" (before the load, not after it), else says so and returns None, and the engine
    then asks select_backend for "torch" (one build attempt a start, not two)."""
    if name == "torch" or device.type != "cpu":
        return None
    from pagellm.model_executor.layers.cpu_kernels import CPUMarchError, load_extension

    try:
        return load_extension()
    except CPUMarchError:  # a setting to correct
        raise
    except Exception as e:  # no compiler, no headers...: stay correct, only slower
        if name == "cpu":
            raise
        logger.warning("CPU kernels unavailable (%s); using the torch reference backend", e)
        return None


def select_backend(name: str, device: torch.device, num_kv_heads: int, head_dim: int, block_size: int,
                   kv_cache_dtype: torch.dtype | None = None) -> AttentionBackend:
    """"auto": the C++ CPU kernels on CPU (torch reference if they cannot be built), the reference elsewhere.
    kv_cache_dtype: the cache's element type where it differs from the model's (fp8)."""
    args = (num_kv_heads, head_dim, block_size, kv_cache_dtype)
    if name == "torch" or (name == "auto" and device.type != "cpu"):
        return TorchPagedAttention(*args)
    from pagellm.model_executor.layers.cpu_attention import CPUPagedAttention
    from pagellm.model_executor.layers.cpu_kernels import CPUMarchError

    if name == "cpu":
        return CPUPagedAttention(*args)
    try:
        return CPUPagedAttention(*args)
    except CPUMarchError:  # a setting to correct, not a machine to make do with
        raise
    except Exception as e:  # no compiler, no headers...: stay correct, only slower
        logger.warning("CPU kernels unavailable (%s); using the torch reference backend", e)
        return TorchPagedAttention(*args)
