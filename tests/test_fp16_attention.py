"""The paged attention kernel's fp16 sums (csrc/attention_fp16.h; EngineConfig.reduced_precision_reduction, CPUs
with AVX512-FP16): prefill chunks of at least 16 rows (and, over an fp8 cache, what its bf16 copy would take) run
on an fp16 copy of their blocks, q.k and p.v as fp16 FMAs whose partial sums join fp32 ones. Powers of two scale
q, K, V and p so that no input overflows fp16, and the result stays near the fp32 path's, which its bf16
rounding dominates. Against the dense fp64 reference of tests/test_attention.py."""
from __future__ import annotations

import pytest
import torch

from pagellm.model_executor.layers.cpu_attention import CPUPagedAttention
from pagellm.model_executor.layers.cpu_kernels import load_extension
from tests.test_attention import dense_reference, make_case

ops = load_extension()
pytestmark = pytest.mark.skipif(not ops.paged_attention_fp16_supported(), reason="CPU without AVX512-FP16")


def both_paths(q_lens, ctx_lens, block_size=32, heads=9, kv_heads=3, dim=64, window=None, kv_dtype=None,
               dtype=torch.bfloat16, seed=0, scale_k=1.0, scale_v=1.0, scale_q=1.0):
    """(fp32-sum output, fp16-sum output, fp64 reference) of one backend step over make_case's batch."""
    be = CPUPagedAttention(kv_heads, dim, block_size, kv_dtype)
    q, k, v, cache, meta, k_all, v_all = make_case(be, q_lens, ctx_lens, block_size, dtype, heads, kv_heads, dim,
                                                   seed)
    if (scale_k, scale_v, scale_q) != (1.0, 1.0, 1.0):  # the case's tensors at other magnitudes
        q = (q.float() * scale_q).to(dtype)
        k, v = (k.float() * scale_k).to(dtype), (v.float() * scale_v).to(dtype)
        k_all = [(x.float() * scale_k).to(dtype) for x in k_all]
        v_all = [(x.float() * scale_v).to(dtype) for x in v_all]
        be.write_kv(cache, *_old_tokens(k_all, v_all, q_lens, ctx_lens, meta, block_size))
    outs = []
    for fp16 in (False, True):
        be.fp16_sums = fp16
        outs.append(be.forward(q, k, v, cache.clone(), meta, dim ** -0.5, window))
    return outs[0], outs[1], dense_reference(q, k_all, v_all, q_lens, ctx_lens, dim ** -0.5, window)


def _old_tokens(k_all, v_all, q_lens, ctx_lens, meta, block_size):
    """The cached (earlier) tokens of each request with their slots, as make_case writes them."""
    ks, vs, slots = [], [], []
    for r, (ql, c) in enumerate(zip(q_lens, ctx_lens)):
        for p in range(c - ql):
            slots.append(int(meta.block_tables[r, p // block_size]) * block_size + p % block_size)
            ks.append(k_all[r][p]), vs.append(v_all[r][p])
    return torch.stack(ks), torch.stack(vs), torch.tensor(slots)


def errors(out32, out16, ref):
    return [(o.double() - ref).abs().mean().item() for o in (out32, out16)]


@pytest.mark.parametrize("q_lens,ctx_lens,block_size,dim,window", [
    ([300, 1, 40], [300, 500, 77], 32, 64, None),      # a prompt, a decode row, a chunk after a context
    ([64, 17], [1000, 17], 16, 64, None),               # odd lengths: partial last blocks
    ([48], [203], 8, 128, None),                        # small blocks, a larger head
    ([33, 16], [33, 90], 32, 32, None),
    ([96], [450], 32, 64, 100),                         # sliding window
    ([20, 24], [20, 300], 16, 256, None),
    ([40, 18], [260, 18], 16, 96, None),                # 96 dims: six 16-dim vectors per V pair row
    # long contexts: rows of scores larger than L2
    ([200, 30], [1600, 1100], 16, 64, None),
    ([96], [1500], 32, 64, 700),                        # a window whose start moves across passes
    ([70, 1], [1234, 900], 8, 128, None),
])
def test_error_stays_near_the_fp32_paths(q_lens, ctx_lens, block_size, dim, window):
    # Measured: 1.2-1.4x the fp32 path's mean error (its bf16 rounding of the output dominates both). Summing a
    # whole row in fp16, a scale off by a factor or a stale slot read shows up far above this bound.
    out32, out16, ref = both_paths(q_lens, ctx_lens, block_size, dim=dim, window=window)
    err32, err16 = errors(out32, out16, ref)
    assert torch.isfinite(out16).all()
    assert err16 <= 1.6 * err32, (err16, err32)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_caches(kv_dtype):
    # fp8 requests that the bf16 copy took now get an fp16 one (fp16 holds every e4m3 and e5m2 value)
    out32, out16, ref = both_paths([64, 5], [700, 300], kv_dtype=kv_dtype)
    err32, err16 = errors(out32, out16, ref)
    assert err16 <= 1.6 * err32, (err16, err32)


@pytest.mark.parametrize("scale_k,scale_v,scale_q,ctx", [
    (1e3, 1.0, 1e-3, 200), (1e-4, 1e-4, 1e4, 200), (1.0, 3e4, 1.0, 200), (3e4, 1e-3, 3e-5, 200), (1.0, 1.0, 4.0, 200),
    (1e3, 1.0, 1e-3, 1300), (1e-4, 1e-4, 1e4, 1300), (1.0, 3e4, 1.0, 1300), (3e4, 1e-3, 3e-5, 1300)])
def test_any_magnitude_keeps_its_precision(scale_k, scale_v, scale_q, ctx):
    # K or V of 1e-4 are fp16 subnormals and 3e4 overflows fp16's sums without the scaling. (The logits keep a
    # model's range: far larger ones make one-hot rows, where fp16 sums' error, relative to the logit, exceeds
    # the fp32 path's; the bf16 rounding of q and K already costs more there: 4x the logits over 1,300 keys give
    # 1.94x the fp32 path's error.)
    out32, out16, ref = both_paths([40], [ctx], scale_k=scale_k, scale_v=scale_v, scale_q=scale_q, seed=3)
    err32, err16 = errors(out32, out16, ref)
    assert torch.isfinite(out16).all()
    assert err16 <= 1.6 * err32 + 1e-30, (err16, err32)


def test_worst_case_sums_do_not_overflow():
    # every q.k product at its largest with one sign, every row of V at the largest value: each fp16 lane's sum
    # reaches its bound
    be = CPUPagedAttention(1, 64, 32)
    q, k, v, cache, meta, k_all, v_all = make_case(be, [32], [32], 32, torch.bfloat16, 1, 1, 64)
    q, k, v = torch.full_like(q, 250.0), torch.full_like(k, 6e4), torch.full_like(v, -6e4)
    out = {}
    for fp16 in (False, True):
        be.fp16_sums = fp16
        out[fp16] = be.forward(q, k, v, cache.clone(), meta, 0.125, None)
    assert torch.isfinite(out[True]).all()
    assert torch.allclose(out[True].float(), out[False].float(), rtol=1e-2)


@pytest.mark.parametrize("ctx", [400, 1400])
def test_lse_matches_the_fp32_path(ctx):
    # cascade attention merges parts by each row's log-sum-exp, which the fp16 path writes too
    be = CPUPagedAttention(3, 64, 32)
    q, k, v, cache, meta, *_ = make_case(be, [64], [ctx], 32, torch.bfloat16, 9, 3, 64)
    kc, vc = be.views(cache)
    be.ops.write_kv_cache(k, v, kc, vc, meta.slot_mapping)
    lse = {}
    for fp16 in (False, True):
        out, lse[fp16] = torch.empty_like(q), torch.empty(q.shape[:2])
        be.ops.paged_attention(q, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, out, 0.125, 0,
                               1 << 40, None, lse[fp16], fp16)
    assert (lse[True] - lse[False]).abs().max() < 2e-2


def test_same_result_on_any_thread_count():
    be = CPUPagedAttention(3, 64, 32)
    be.fp16_sums = True
    q, k, v, cache, meta, *_ = make_case(be, [100, 1, 30], [600, 200, 30], 32, torch.bfloat16, 9, 3, 64)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(be.forward(q, k, v, cache.clone(), meta, 0.125, None))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_fp32_keeps_fp32_sums():
    # fp32 queries never take the path (the engine's fp32 stays token-exact with HF): bit-identical either way
    be = CPUPagedAttention(2, 32, 16)
    q, k, v, cache, meta, *_ = make_case(be, [40], [100], 16, torch.float32, 6, 2, 32)
    kc, vc = be.views(cache)
    be.ops.write_kv_cache(k, v, kc, vc, meta.slot_mapping)
    outs = []
    for fp16 in (False, True):
        out = torch.empty_like(q)
        be.ops.paged_attention(q, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, out, 0.125, 0,
                               1 << 40, None, None, fp16)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("kv_start,ctx", [(37, 300), (64, 300), (601, 1300)])
def test_kv_start_is_honoured(kv_start, ctx):
    # cascade attention's suffix part leaves out the keys before kv_start (odd: it splits a token pair of the
    # fp16 copy); the fp16 path must leave out the same keys as the fp32 path
    be = CPUPagedAttention(3, 64, 16)
    q, k, v, cache, meta, *_ = make_case(be, [48], [ctx], 16, torch.bfloat16, 9, 3, 64, seed=5)
    kc, vc = be.views(cache)
    be.ops.write_kv_cache(k, v, kc, vc, meta.slot_mapping)
    outs = {}
    for fp16, start in ((False, None), (False, kv_start), (True, kv_start)):
        out = torch.empty_like(q)
        starts = None if start is None else torch.tensor([start], dtype=torch.int64)
        be.ops.paged_attention(q, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, out, 0.125, 0,
                               1 << 40, starts, None, fp16)
        outs[fp16, start] = out.float()
    scale = outs[False, kv_start].abs().mean()
    assert (outs[True, kv_start] - outs[False, kv_start]).abs().mean() < 0.01 * scale
    assert (outs[False, None] - outs[False, kv_start]).abs().mean() > 0.05 * scale  # the keys left out matter
