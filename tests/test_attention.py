"""PagedAttention backends against a dense causal-attention reference computed from unpaged K/V."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from pagellm.model_executor.layers.attention import AttentionMetadata, TorchPagedAttention


def dense_reference(q, k, v, q_lens, ctx_lens, scale, window):
    """Per request: queries are the last q_len positions of a ctx_len context; plain softmax attention in fp64."""
    outs, q0 = [], 0
    for r, (ql, cl) in enumerate(zip(q_lens, ctx_lens)):
        qr = q[q0:q0 + ql].double()  # [ql, H, D]
        kr, vr = k[r][:cl].double(), v[r][:cl].double()  # [cl, Hkv, D]
        g = qr.shape[1] // kr.shape[1]
        kr, vr = kr.repeat_interleave(g, 1), vr.repeat_interleave(g, 1)
        s = torch.einsum("qhd,khd->hqk", qr, kr) * scale
        qpos = torch.arange(cl - ql, cl)[:, None]
        kpos = torch.arange(cl)[None, :]
        allowed = kpos <= qpos
        if window:
            allowed &= kpos > qpos - window
        s = s.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vr))
        q0 += ql
    return torch.cat(outs)


def make_case(backend, q_lens, ctx_lens, block_size, dtype, heads=6, kv_heads=2, dim=32, seed=0):
    """Random K/V for each request's whole context, scattered into shuffled blocks (earlier tokens written with
    the backend's own writer); new tokens are left for the backend. Returns its inputs and the dense tensors (as
    the cache holds them: rounded to an fp8 cache's type)."""
    g = torch.Generator().manual_seed(seed)
    R = len(q_lens)
    nblocks = sum(-(-c // block_size) for c in ctx_lens) + 3
    perm = torch.randperm(nblocks, generator=g).tolist()
    # The C++ kernel must never read a slot outside a context, even multiplied by 0: unused slots hold NaN for it.
    # (The torch reference masks scores, so it needs finite stale values, as a zero-initialised pool has.)
    fill = 0.0 if type(backend) is TorchPagedAttention else float("nan")
    kv_cache = torch.full((2, nblocks, block_size * kv_heads * dim), fill, dtype=backend.kv_cache_dtype or dtype)
    k_all = [torch.randn(c, kv_heads, dim, generator=g).to(dtype) for c in ctx_lens]
    v_all = [torch.randn(c, kv_heads, dim, generator=g).to(dtype) for c in ctx_lens]
    max_blocks = max(-(-c // block_size) for c in ctx_lens)
    tables = np.zeros((R, max_blocks), dtype=np.int64)
    for r, c in enumerate(ctx_lens):
        n = -(-c // block_size)
        tables[r, :n] = [perm.pop() for _ in range(n)]
    # cached (earlier) tokens go straight into the cache; the new ones are passed as k/v to the backend
    new_k, new_v, slots, old_k, old_v, old_slots = [], [], [], [], [], []
    for r, (ql, c) in enumerate(zip(q_lens, ctx_lens)):
        for p in range(c):
            slot = tables[r, p // block_size] * block_size + p % block_size
            if p < c - ql:
                old_slots.append(slot)
                old_k.append(k_all[r][p])
                old_v.append(v_all[r][p])
            else:
                slots.append(slot)
                new_k.append(k_all[r][p])
                new_v.append(v_all[r][p])
    if old_slots:
        backend.write_kv(kv_cache, torch.stack(old_k), torch.stack(old_v), torch.tensor(old_slots))
    T = sum(q_lens)
    q = torch.randn(T, heads, dim, generator=g).to(dtype)
    q_lens_np, seq = np.array(q_lens), np.array(ctx_lens)
    cu = np.concatenate([[0], np.cumsum(q_lens_np)])
    dec = np.nonzero(q_lens_np == 1)[0]
    t = torch.from_numpy
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_tables=t(tables), seq_lens=t(seq), query_start_loc=t(cu),
        seq_lens_list=seq.tolist(), query_start_list=cu.tolist(),
        query_lens_list=q_lens_np.tolist(), decode_q_idx=t(cu[:-1][dec]),
        decode_block_tables=t(np.ascontiguousarray(tables[dec])), decode_seq_lens=t(seq[dec]),
        max_decode_seq_len=int(seq[dec].max()) if len(dec) else 0,
        prefill_rows=np.nonzero(q_lens_np > 1)[0].tolist())
    k_all, v_all = ([backend.to_cache(x).to(dtype) for x in xs] for xs in (k_all, v_all))
    return q, torch.stack(new_k), torch.stack(new_v), kv_cache, meta, k_all, v_all


def backends():
    out = [TorchPagedAttention]
    try:
        from pagellm.model_executor.layers.cpu_attention import CPUPagedAttention
        CPUPagedAttention(2, 32, 16)
        out.append(CPUPagedAttention)
    except Exception as e:  # pragma: no cover - no compiler
        pytest.fail(f"CPU kernel did not build: {e}")
    return out


def assert_matches_dense(backend, q_lens, ctx_lens, block_size, dtype, heads, kv_heads, dim, window, seed=0):
    """One step of the backend over make_case's batch against dense_reference (fp64)."""
    q, k, v, cache, meta, k_all, v_all = make_case(backend, q_lens, ctx_lens, block_size, dtype, heads, kv_heads,
                                                   dim, seed)
    out = backend.forward(q, k, v, cache, meta, scale=dim ** -0.5, sliding_window=window)
    ref = dense_reference(q, k_all, v_all, q_lens, ctx_lens, dim ** -0.5, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2 if dtype == torch.bfloat16 else 4e-3
    assert torch.allclose(out.double(), ref, atol=tol, rtol=tol), (out.double() - ref).abs().max()


@pytest.mark.parametrize("backend_cls", backends(), ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads,kv_heads,dim", [(6, 2, 32), (9, 3, 64), (9, 1, 64), (8, 2, 128), (4, 2, 48)],
                         ids=["gqa3-d32", "gqa3-d64", "mqa9-d64", "gqa4-d128", "d48"])
def test_mixed_batch_matches_dense(backend_cls, dtype, block_size, window, heads, kv_heads, dim):
    # decodes with short and long contexts, a fresh prompt, a later chunk of a prompt, a decode at position 0;
    # head shapes cover the kernel's grouped path, its split into subgroups (9 heads per kv head: 6 + 3; d128:
    # 3 + 1) and the portable C++ path (d48)
    assert_matches_dense(backend_cls(kv_heads, dim, block_size), [1, 1, 7, 1, 12, 1], [1, 40, 7, 100, 30, 17],
                         block_size, dtype, heads, kv_heads, dim, window)


@pytest.mark.parametrize("backend_cls", backends(), ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (4, 2, 48)], ids=["d64", "d128", "d48"])
def test_many_requests_match_dense(backend_cls, dtype, window, heads, kv_heads, dim):
    # with at least 4 requests per thread the C++ kernel gives each task all of a request's kv heads
    R = 4 * torch.get_num_threads() + 3
    q_lens = [1 if r % 4 else 3 + r % 5 for r in range(R)]
    ctx_lens = [q + 7 * r for r, q in enumerate(q_lens)]
    assert_matches_dense(backend_cls(kv_heads, dim, 16), q_lens, ctx_lens, 16, dtype, heads, kv_heads, dim, window,
                         seed=5)


@pytest.mark.parametrize("backend_cls", backends(), ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_then_gather_round_trips(backend_cls, dtype):
    kv_heads, dim, bs = 2, 32, 8
    backend = backend_cls(kv_heads, dim, bs)
    cache = torch.zeros(2, 6, bs * kv_heads * dim, dtype=dtype)
    k = torch.randn(20, kv_heads, dim).to(dtype)
    v = torch.randn(20, kv_heads, dim).to(dtype)
    blocks = torch.tensor([4, 1, 5])  # positions 0..19 live in blocks 4, 1, 5
    slots = torch.tensor([blocks[p // bs].item() * bs + p % bs for p in range(20)])
    backend.write_kv(cache, k, v, slots)
    gk, gv = backend.gather(cache, blocks, 20)
    assert torch.equal(gk, k.transpose(0, 1)) and torch.equal(gv, v.transpose(0, 1))
    # untouched blocks stay zero: each row went to its own slot only
    assert cache[:, [0, 2, 3]].abs().sum() == 0
    gk, _ = backend.gather(cache, blocks, 11)
    assert torch.equal(gk, k[:11].transpose(0, 1))

@pytest.mark.parametrize("backend_cls", backends(), ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (4, 2, 48)], ids=["d64", "d128", "d48"])
def test_long_prefill_chunks_match_dense(backend_cls, dtype, window, heads, kv_heads, dim):
    # chunks spanning several 16-row tiles: a whole prompt, a late chunk after a cached prefix, a chunk whose
    # length is not a multiple of the tile, next to decode rows
    assert_matches_dense(backend_cls(kv_heads, dim, 16), [70, 1, 33, 1, 17], [70, 90, 160, 5, 50], 16, dtype, heads,
                         kv_heads, dim, window, seed=3)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (4, 4, 32)], ids=["d64", "d128", "d32"])
def test_amx_prefill_kernel_matches_dense(block_size, window, heads, kv_heads, dim):
    # bf16 chunks past the FMA kernel's 32 rows go to the AMX kernel: a whole prompt, a chunk after a long cached
    # prefix that ends mid-block (stale NaN slots after it), chunks not a multiple of 16 rows, beside decode rows
    from pagellm.model_executor.layers.cpu_attention import CPUPagedAttention

    backend = CPUPagedAttention(kv_heads, dim, block_size)
    if not backend.amx_prefill:
        pytest.skip("CPU without AMX")
    q_lens = [200, 1, 45, 1, 33, 77]
    ctx_lens = [200, 300, 345, 9, 70, 1077]
    q, k, v, cache, meta, k_all, v_all = make_case(backend, q_lens, ctx_lens, block_size, torch.bfloat16, heads,
                                                   kv_heads, dim, seed=11)
    out = backend.forward(q, k, v, cache, meta, scale=dim ** -0.5, sliding_window=window)
    ref = dense_reference(q, k_all, v_all, q_lens, ctx_lens, dim ** -0.5, window)
    assert torch.allclose(out.double(), ref, atol=2e-2, rtol=2e-2), (out.double() - ref).abs().max()


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (4, 4, 32)], ids=["d64", "d128", "d32"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_cascade_prefix_matches_dense(heads, kv_heads, dim, block_size):
    # Requests 0-6 decode over one shared 3-block prefix (their block tables begin with request 0's blocks);
    # request 7 decodes over blocks of its own; request 8, a prefill chunk, also starts with the shared blocks
    # but is not a decode row, so it attends to its whole context in the prefill kernel.
    from pagellm.model_executor.layers.attention import CascadePrefix, find_cascade_prefix
    from pagellm.model_executor.layers.cpu_attention import CPUPagedAttention

    backend = CPUPagedAttention(kv_heads, dim, block_size)
    if not backend.supports_cascade:
        pytest.skip("CPU without AMX")
    shared = 3
    p = shared * block_size
    q_lens = [1, 1, 1, 1, 1, 1, 1, 1, 40]
    ctx_lens = [p + 1, p + 12, p + 52, p + 1, p + 29, p + 82, p + 2, 90, p + 40]
    q, k, v, cache, meta, k_all, v_all = make_case(backend, q_lens, ctx_lens, block_size, torch.bfloat16, heads,
                                                   kv_heads, dim, seed=5)
    for r in (1, 2, 3, 4, 5, 6, 8):  # share request 0's first blocks, and so its keys and values there
        meta.block_tables[r, :shared] = meta.block_tables[0, :shared]
        k_all[r][:p], v_all[r][:p] = k_all[0][:p], v_all[0][:p]
    tables, seq, cu = meta.block_tables.numpy(), meta.seq_lens.numpy(), meta.query_start_loc.numpy()
    decode_rows = np.nonzero(np.array(q_lens) == 1)[0]
    found = find_cascade_prefix(tables, seq, decode_rows, cu, block_size, min_requests=4, min_tokens=32)
    assert found is not None
    blocks, rows, kv_start = found
    assert blocks.tolist() == tables[0, :shared].tolist() and rows.tolist() == cu[:7].tolist()
    assert kv_start.tolist() == [p] * 7 + [0, 0]
    meta.cascade = CascadePrefix(torch.from_numpy(blocks), torch.from_numpy(rows), torch.from_numpy(kv_start))
    out = backend.forward(q, k, v, cache, meta, scale=dim ** -0.5, sliding_window=None)
    ref = dense_reference(q, k_all, v_all, q_lens, ctx_lens, dim ** -0.5, None)
    assert torch.allclose(out.double(), ref, atol=2e-2, rtol=2e-2), (out.double() - ref).abs().max()


def test_find_cascade_prefix_thresholds():
    from pagellm.model_executor.layers.attention import find_cascade_prefix

    bs = 16
    tables = np.array([[5, 6, 7, 8], [5, 6, 7, 9], [5, 6, 2, 3], [1, 2, 3, 4]])
    seq = np.array([64, 64, 64, 64])
    cu = np.arange(5)
    rows = np.arange(4)
    # three requests share blocks 5, 6 (two of them also 7); the fourth is on its own
    blocks, qrows, start = find_cascade_prefix(tables, seq, rows, cu, bs, min_requests=3, min_tokens=32)
    assert blocks.tolist() == [5, 6] and qrows.tolist() == [0, 1, 2] and start.tolist() == [32, 32, 32, 0]
    assert find_cascade_prefix(tables, seq, rows, cu, bs, min_requests=4, min_tokens=32) is None  # group too small
    assert find_cascade_prefix(tables, seq, rows, cu, bs, min_requests=3, min_tokens=48) is None  # prefix too short
    # a block that holds a request's new token is never part of the prefix: 33 tokens -> 2 full blocks before it
    blocks, _, _ = find_cascade_prefix(tables[:2], np.array([33, 64]), rows[:2], cu[:3], bs, 2, 16)
    assert blocks.tolist() == [5, 6]
    blocks, _, _ = find_cascade_prefix(tables[:2], np.array([32, 64]), rows[:2], cu[:3], bs, 2, 16)
    assert blocks.tolist() == [5]


@pytest.mark.parametrize("block_size", [32, 64])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("heads,kv_heads,dim", [(3, 3, 64), (6, 3, 64), (9, 3, 64), (8, 2, 128), (16, 2, 64)],
                         ids=["g1", "g2", "g3", "g4-d128", "g8"])
def test_decode_rows_are_dense_attention_rounded_once(block_size, window, heads, kv_heads, dim):
    # Decode rows (and a 2-row chunk) over a bf16 cache: with AMX, up to 8 query vectors per kv head go to the tile
    # kernel (decode_attention_amx.h), whose probabilities keep ~16 bits (a bf16 high and low half), so each output
    # is the fp64 result rounded to bf16 once; contexts end anywhere in a 32-key chunk (stale NaN slots after).
    # Where the kernel sums on VDPBF16PS (AMD, fma_linear_dot_default) the weights are rounded to bf16 (unnormalised,
    # as SDPA's bf16 CPU kernel rounds them, the sums divided at the end): each weight p_i off by at most 2^-8 p_i
    # (bf16's unit roundoff), so the output is off by at most 2^-8 * sum p_i |v_i| more.
    from pagellm.model_executor.layers.cpu_attention import CPUPagedAttention

    q_lens, ctx_lens = [1, 1, 1, 1, 2, 1, 1], [1, 31, 32, 33, 95, 300, 64]
    backend = CPUPagedAttention(kv_heads, dim, block_size)
    q, k, v, cache, meta, k_all, v_all = make_case(backend, q_lens, ctx_lens, block_size, torch.bfloat16, heads,
                                                   kv_heads, dim, seed=7)
    out = backend.forward(q, k, v, cache, meta, scale=dim ** -0.5, sliding_window=window).double()
    ref = dense_reference(q, k_all, v_all, q_lens, ctx_lens, dim ** -0.5, window)
    if backend.ops.fma_linear_dot_default():
        weighted_abs = dense_reference(q, k_all, [t.abs() for t in v_all], q_lens, ctx_lens, dim ** -0.5, window)
        bound = 2 ** -8 * (ref.abs() + 1.01 * weighted_abs)
        assert ((out - ref).abs() <= bound).all(), ((out - ref).abs() / bound).max()
        return
    err = (out - ref).abs() / (ref.abs() + 1e-3)
    assert err.max() <= 2 ** -8, err.max()


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128)], ids=["g3", "g4-d128"])
def test_dot_product_chunks_are_dense_attention_within_bf16_weights(block_size, window, heads, kv_heads, dim):
    # Prefill chunks on VDPBF16PS (AMD, fma_linear_dot_default; the other run of this file where a CPU has
    # AVX512-BF16 but another default): the weights exp(s - max) are rounded to bf16 unnormalised and the weighted
    # sums divided by the unrounded sums, so as for decode rows each weight is off by at most 2^-8 of itself (and
    # ~3e-6 from the exponential). Chunks start and end at odd positions (pairs of tokens cut by the span's ends),
    # contexts end mid-block with stale NaN slots after, the window cuts pairs too; the paged kernel takes every chunk.
    from pagellm.model_executor.layers.cpu_attention import CPUPagedAttention

    backend = CPUPagedAttention(kv_heads, dim, block_size)
    if not backend.ops.fma_linear_dot_default():
        pytest.skip("the paged kernel sums on FMAs on this CPU (the test's other run covers VDPBF16PS)")
    backend.amx_prefill = False
    q_lens, ctx_lens = [37, 1, 64, 5, 130], [37, 90, 101, 211, 333]
    q, k, v, cache, meta, k_all, v_all = make_case(backend, q_lens, ctx_lens, block_size, torch.bfloat16, heads,
                                                   kv_heads, dim, seed=11)
    out = backend.forward(q, k, v, cache, meta, scale=dim ** -0.5, sliding_window=window).double()
    ref = dense_reference(q, k_all, v_all, q_lens, ctx_lens, dim ** -0.5, window)
    weighted_abs = dense_reference(q, k_all, [t.abs() for t in v_all], q_lens, ctx_lens, dim ** -0.5, window)
    bound = 2 ** -8 * (ref.abs() + 1.01 * weighted_abs)
    assert ((out - ref).abs() <= bound).all(), ((out - ref).abs() / bound).max()


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_attention_writes_this_steps_rows_as_write_kv_cache_does(cache_dtype):
    # paged_attention with k_new / v_new / slot_mapping writes the rows itself (decode rows and short chunks
    # inside their tasks, the rest first) and must leave the cache and the outputs as write_kv_cache followed by
    # paged_attention does. Request 1 reads the block request 0 writes in this very call (a prefix-cache hit on a
    # block filled in this step), so request 0's row must be written before any task runs; request 3's 20 rows
    # exceed a task's 16, request 4's 40 the kernel's 32 (left to the caller, written all the same); row 1 of
    # request 2 has a negative slot (not written); the last row belongs to no request.
    from pagellm.model_executor.layers.cpu_kernels import load_extension

    ops = load_extension()
    dtype = torch.float32 if cache_dtype == torch.float32 else torch.bfloat16
    H, Hkv, D, B, nb = 6, 2, 64, 32, 40
    x = 4 // torch.tensor([], dtype=cache_dtype).element_size()
    g = torch.Generator().manual_seed(3)
    q_lens, seq = [1, 1, 3, 20, 40], [45, 64, 70, 100, 50]
    tables = torch.zeros(5, 4, dtype=torch.long)
    tables[0, :2] = torch.tensor([3, 9])
    tables[1, :2] = torch.tensor([3, 9])  # request 0's blocks: reads slot 9 * 32 + 12, written now by request 0
    tables[2, :3] = torch.tensor([1, 17, 30])
    tables[3, :4] = torch.tensor([5, 6, 7, 8])
    tables[4, :2] = torch.tensor([20, 21])
    slots = []
    for r, (ql, L) in enumerate(zip(q_lens, seq)):
        if r == 1:
            slots.append(int(tables[1, 1]) * B + 31)  # its own new row, at the end of the shared block
            continue
        slots += [int(tables[r, p // B]) * B + p % B for p in range(L - ql, L)]
    slots[2 + 1] = -1
    T = sum(q_lens) + 1
    slots.append(int(tables[4, 1]) * B + 20)  # the row past every request: written, read by none
    slot_mapping = torch.tensor(slots)
    cache = torch.randn(2, nb, Hkv * D * B, generator=g).to(cache_dtype)
    k, v = (torch.randn(T, Hkv, D, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(T, H, D, generator=g).to(dtype)
    qs = torch.tensor([0] + np.cumsum(q_lens).tolist())
    seq_t = torch.tensor(seq)

    def views(c):
        return c[0].view(nb, Hkv, D // x, B, x), c[1].view(nb, Hkv, B // x, D, x)

    apart, fused = cache.clone(), cache.clone()
    out_apart, out_fused = torch.zeros_like(q), torch.zeros_like(q)
    ops.write_kv_cache(k, v, *views(apart), slot_mapping)
    ops.paged_attention(q, *views(apart), tables, seq_t, qs, out_apart, D ** -0.5, 0, 32)
    ops.paged_attention(q, *views(fused), tables, seq_t, qs, out_fused, D ** -0.5, 0, 32, None, None, False,
                        k, v, slot_mapping)
    assert torch.equal(apart.view(torch.uint8), fused.view(torch.uint8))
    assert torch.equal(out_apart, out_fused)
    assert out_apart[:qs[4]].isfinite().all()
    with pytest.raises(RuntimeError, match="slot_mapping"):
        bad = slot_mapping.clone()
        bad[0] = nb * B
        ops.paged_attention(q, *views(fused), tables, seq_t, qs, out_fused, D ** -0.5, 0, 32, None, None, False,
                            k, v, bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 2)])
def test_prompt_rows_get_the_same_bits_in_any_chunks(dtype, heads, kv_heads):
    # Chunked prefill must not change a row's output: attending a prompt's rows in the chunks a token budget cuts
    # it into gives each row the bits it gets in one chunk (a chunk's last rows fall in a smaller group of query
    # vectors than in a longer chunk, and a group's size must not change how a vector's scores are summed).
    from pagellm.model_executor.layers.cpu_kernels import load_extension

    ops = load_extension()
    D, B, L = 64, 32, 300
    x = 4 // torch.tensor([], dtype=dtype).element_size()
    g = torch.Generator().manual_seed(5)
    nb = -(-L // B)
    cache = torch.randn(2, nb, kv_heads * D * B, generator=g).to(dtype)
    kc, vc = cache[0].view(nb, kv_heads, D // x, B, x), cache[1].view(nb, kv_heads, B // x, D, x)
    q = torch.randn(L, heads, D, generator=g).to(dtype)
    tables = torch.randperm(nb, generator=g).view(1, nb)
    whole = torch.zeros_like(q)
    ops.paged_attention(q, kc, vc, tables, torch.tensor([L]), torch.tensor([0, L]), whole, D ** -0.5, 0, 1 << 40)
    bounds = [0, 63, 125, 185, 244, 297, 300]  # the engine's chunks of this prompt at budget 64, and a short one
    for a, b in zip(bounds, bounds[1:]):
        part = torch.zeros_like(q[a:b])
        ops.paged_attention(q[a:b].contiguous(), kc, vc, tables, torch.tensor([b]), torch.tensor([0, b - a]), part,
                            D ** -0.5, 0, 1 << 40)
        assert torch.equal(part, whole[a:b]), (a, b)


def test_the_other_summing_path_where_the_cpu_has_both():
    # The paged kernel sums on VDPBF16PS (bf16 q and cache) where fma_linear_dot_default says so (AMD), else on
    # FMAs; the choice is made once per process, so this file's tests run again in a child process with
    # PAGELLM_FMA_DOT set to the other path: both are checked on any CPU with AVX512-BF16.
    from pagellm.model_executor.layers.cpu_kernels import load_extension

    ops = load_extension()
    if not ops.fma_linear_dot_supported():
        pytest.skip("CPU without AVX512-BF16: one path only")
    env = {**os.environ, "PAGELLM_FMA_DOT": "0" if ops.fma_linear_dot_default() else "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, "-k",
                           "not test_the_other_summing_path"], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_the_torch_backend_keeps_cudnn_attention_out_on_cuda_only():
    # On CUDA the reference backend's SDPA calls must not take cuDNN's attention, which builds a plan per new shape
    # (~0.4 s each, and this backend brings new shapes every step); on CPU torch chooses as it likes.
    from pagellm.model_executor.layers import attention

    cuda = torch.backends.cuda

    def flags():  # cuDNN, flash, memory-efficient, math
        return [cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(),
                cuda.math_sdp_enabled()]

    before = flags()
    with attention.sdpa_backends(torch.device("cpu")):
        assert flags() == before
    with attention.sdpa_backends(torch.device("cuda")):
        assert flags() == [False, True, True, True]
    assert flags() == before
