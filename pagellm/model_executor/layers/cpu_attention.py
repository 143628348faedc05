"""CPU PagedAttention backend: the C++ kernels of ``csrc/paged_attention_cpu.cpp`` behind the backend interface.

The cache uses the kernel's own layout (x = 4 bytes / element size: 4 for fp8, 2 for bf16, 1 for fp32):
K [num_blocks, kv_heads, head_dim/x, block_size, x], V [num_blocks, kv_heads, block_size/x, head_dim, x].
One kernel call per layer serves every decode row and short chunk of the step (as speculative decoding will
produce), reading K/V in place from the blocks. Longer prefill chunks go, in bf16 on a CPU with AMX, to the AMX
kernel of ``csrc/prefill_attention_amx.cpp`` (also in place; one call per layer); without it the paged kernel
takes bf16/fp16 chunks of any length (NO_QUERY_LIMIT), and SDPA's flash kernel fp32 ones, on their own or
gathered context. The backend also carries the fused element-wise ops (``ops``) the model uses on CPU.
"""
from __future__ import annotations

import torch

from pagellm.model_executor.layers.attention import TorchPagedAttention
from pagellm.model_executor.layers.cpu_kernels import load_extension


# Requests with at most this many query rows go through the paged FMA kernel; longer chunks go to the AMX prefill
# kernel (bf16) or SDPA. ``python bench/kernels.py``, 4 chunks of 32 rows after 500 tokens: 1.3 ms against 2.1 ms
# for the SDPA reference. Past 32 rows SDPA caught up with the FMA kernel on chunks after a context (64 rows:
# 1.63 against 1.82 ms, measured with the same case builder before the AMX kernel existed).
KERNEL_MAX_QUERY = 32
# Without the AMX prefill kernel the paged kernel takes bf16/fp16 chunks of any length: on the project's VM with
# AMX hidden (2026-12-01, evening; 32-token blocks, SmolLM2's heads, medians of 5, two alternating rounds) it took
# 3.7-4.0 ms for 4 prompts of 300 against 7.6-8.3 ms for SDPA in fp32, 5.2 against 8.9 ms for 2 of 512, 2.1-2.3
# against 3.7-3.9 for 4 chunks of 64 after 500, 190-211 against 233-234 ms for a 2,048-row chunk after 4,952.
# fp32 keeps SDPA for them (the reference's kernel, for HF-exact tokens).
NO_QUERY_LIMIT = 1 << 40


class CPUPagedAttention(TorchPagedAttention):
    # The kernels read only the slots inside each context (tests/test_attention.py fills the others with NaN),
    # and the SDPA fallback gathers exactly the context.
    needs_zeroed_cache = False
    # fp16 partial sums for prefill chunks on CPUs with AVX512-FP16 (csrc/attention_fp16.h), bf16/fp16 only: set by
    # build_model from EngineConfig.reduced_precision_reduction.
    fp16_sums = False

    def __init__(self, num_kv_heads: int, head_dim: int, block_size: int,
                 kv_cache_dtype: torch.dtype | None = None) -> None:
        super().__init__(num_kv_heads, head_dim, block_size, kv_cache_dtype)
        per_word = 4 if self.fp8 else 2  # elements per 32-bit word of the layout
        if block_size % per_word:
            raise ValueError(f"block_size must be a multiple of {per_word} for the CPU kernels with this cache "
                             f"dtype, got {block_size}")
        self.ops = load_extension()
        self._views: dict = {}
        # bf16 prefill chunks on AMX tiles straight from the blocks (csrc/prefill_attention_amx.cpp), else SDPA.
        # An fp8 cache: the paged kernel takes every chunk (it reads fp8 in place, the AMX kernel bf16 only).
        self.amx_prefill = not self.fp8 and bool(self.ops.prefill_attention_amx_supported(head_dim, block_size))
        self.supports_cascade = self.amx_prefill  # the shared prefix runs on the same AMX kernel

    def max_query(self, dtype: torch.dtype) -> int:
        """The longest chunk (rows of one request) the paged kernel takes; longer ones go to the AMX prefill kernel
        or SDPA (see KERNEL_MAX_QUERY and NO_QUERY_LIMIT)."""
        if self.fp8:
            return NO_QUERY_LIMIT
        return KERNEL_MAX_QUERY if self.amx_prefill or dtype == torch.float32 else NO_QUERY_LIMIT

    def views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (kv_cache.data_ptr(), kv_cache.shape)
        if key not in self._views:  # built once per layer: two view ops cost more than the dict lookup
            nb, x = kv_cache.shape[1], 4 // kv_cache.element_size()
            h, d, b = self.num_kv_heads, self.head_dim, self.block_size
            self._views[key] = (kv_cache[0].view(nb, h, d // x, b, x), kv_cache[1].view(nb, h, b // x, d, x))
        return self._views[key]

    def write_kv(self, kv_cache, k, v, slot_mapping) -> None:
        kc, vc = self.views(kv_cache)
        self.ops.write_kv_cache(k, v, kc, vc, slot_mapping)

    def gather(self, kv_cache: torch.Tensor, blocks: torch.Tensor, ctx: int,
               dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        kc, vc = self.views(kv_cache)
        shape = (self.num_kv_heads, ctx, self.head_dim)
        k = torch.empty(shape, dtype=dtype or kv_cache.dtype, device=kv_cache.device)
        v = torch.empty(shape, dtype=dtype or kv_cache.dtype, device=kv_cache.device)
        self.ops.gather_kv_cache(kc, vc, blocks[:-(-ctx // self.block_size)].contiguous(), k, v)
        return k, v

    def forward(self, q, k, v, kv_cache, meta, scale, sliding_window):
        """This step's k, v into the cache, and decode rows and chunks up to max_query rows, in one kernel call
        (a request's rows written by its own tasks just before they read its blocks), K/V read in place; longer
        prefill chunks in one call of the AMX kernel (bf16 on a CPU with AMX), else SDPA's flash kernel, one each.
        With a cascade prefix (bf16, no sliding window) the first call leaves the shared prefix out and
        ``cascade_prefix_attention`` adds it."""
        kc, vc = self.views(kv_cache)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        cascade = meta.cascade if sliding_window is None and q.dtype == torch.bfloat16 else None
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if cascade is not None else None
        max_query = self.max_query(q.dtype)
        self.ops.paged_attention(q, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, out, scale,
                                 sliding_window or 0, max_query, cascade.kv_start if cascade else None, lse,
                                 self.fp16_sums, k, v, meta.slot_mapping)  # writes k, v into the cache first
        if cascade is not None:  # the shared prefix for all its rows at once, merged by log-sum-exp
            self.ops.cascade_prefix_attention(q, kc, vc, cascade.blocks, cascade.rows, out, lse, scale)
        if not meta.prefill_rows:
            return out
        if self.amx_prefill and q.dtype == torch.bfloat16:
            self.ops.prefill_attention_amx(q, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, out,
                                           scale, sliding_window or 0, KERNEL_MAX_QUERY)
            return out
        for r in meta.prefill_rows:
            q0, qlen = meta.query_start_list[r], meta.query_lens_list[r]
            if qlen > max_query:
                rows = slice(q0, q0 + qlen)
                out[rows] = self.prefill(q[rows], k[rows], v[rows], kv_cache, meta, r, scale, sliding_window)
        return out
