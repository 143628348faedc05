"""The fused CPU element-wise kernels against the torch ops they replace (the model's reference path)."""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from pagellm.model_executor.layers.attention import select_backend
from pagellm.model_executor.layers.cpu_kernels import load_extension
from pagellm.model_executor.layers.rotary import apply_rotary
from pagellm.model_executor.models.llama import RMSNorm

ops = load_extension()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _norm(dim, dtype, with_ops):
    n = RMSNorm(dim, 1e-5, ops if with_ops else None).to(dtype)
    with torch.no_grad():
        n.weight.copy_(torch.randn(dim) * 0.5 + 1)
    return n


def assert_close(got, want, dtype):
    if dtype == torch.float32:  # the only freedom is the order of the fp32 sum of squares
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:  # the same roundings as torch: equal, bar rare one-ulp ties from the fp32 statistics
        mismatch = (got != want).float().mean().item()
        assert mismatch < 1e-3, mismatch
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 576), (37, 64), (300, 200)])  # 200: a tail after 16-lane chunks
def test_rms_norm_matches_torch(dtype, rows, dim):
    torch.manual_seed(0)
    x = (torch.randn(rows, dim) * 3).to(dtype)
    fused, ref = _norm(dim, dtype, True), _norm(dim, dtype, False)
    ref.weight.data.copy_(fused.weight.data)
    assert_close(fused(x), ref(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_torch_and_updates_residual(dtype):
    torch.manual_seed(1)
    x, res = torch.randn(50, 96).to(dtype), torch.randn(50, 96).to(dtype)
    fused, ref = _norm(96, dtype, True), _norm(96, dtype, False)
    ref.weight.data.copy_(fused.weight.data)
    want_out, want_res = ref(x.clone(), res.clone())
    got_out, got_res = fused(x.clone(), res.clone())
    assert torch.equal(got_res, want_res)  # one rounded add, exactly as torch's
    assert_close(got_out, want_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 40])
def test_silu_and_mul_matches_torch(dtype, inter):
    torch.manual_seed(2)
    gate_up = (torch.randn(33, 2 * inter) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp over- and underflow
    out = torch.empty(33, inter, dtype=dtype)
    ops.silu_and_mul(gate_up, out)
    gate, up = gate_up.split(inter, dim=-1)
    want = F.silu(gate) * up
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=2e-6, atol=1e-6)
    else:
        assert (out != want).float().mean().item() < 1e-3
        torch.testing.assert_close(out.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
# 64: the vector paths; 48: half a multiple of 8 (AVX2's 8 lanes), not of 16; 24: the scalar loop
@pytest.mark.parametrize("dim", [64, 48, 24])
def test_rotary_matches_hf_formula_in_place(dtype, dim):
    torch.manual_seed(3)
    T, H, Hkv = 21, 6, 2
    qkv = torch.randn(T, (H + 2 * Hkv) * dim).to(dtype)
    q = qkv[:, :H * dim].view(T, H, dim)  # strided views of one projection, as in the model
    k = qkv[:, H * dim:(H + Hkv) * dim].view(T, Hkv, dim)
    ang = torch.randn(T, dim // 2) * 10
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
    want_q, want_k = apply_rotary(q.clone(), k.clone(), cos, sin)
    v_before = qkv[:, (H + Hkv) * dim:].clone()
    ops.rotary_embedding(q, k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, (H + Hkv) * dim:], v_before)  # v untouched


def test_bad_shapes_are_refused_clearly():
    with pytest.raises(RuntimeError, match="out: \\[N, gate_up.size\\(1\\) / 2\\]"):
        ops.silu_and_mul(torch.zeros(2, 8), torch.zeros(2, 3))
    with pytest.raises(RuntimeError, match="dtype Double is not supported"):
        ops.rms_norm(torch.zeros(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64),
                     torch.zeros(2, 8, dtype=torch.float64), 1e-5)


@pytest.mark.skipif(not ops.small_m_linear_supported(), reason="CPU without AVX512-BF16")
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("k,n,bias", [(576, 3072, False), (70, 13, True), (1536, 576, True)])
def test_small_m_linear_matches_fp32_matmul(rows, k, n, bias):
    # odd K (a masked tail of the 32-wide dot products) and N (a partial group of 4 output rows), with bias
    torch.manual_seed(4)
    x = torch.randn(rows, k).bfloat16()
    w = torch.randn(n, k).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    ops.small_m_linear(x, w, b, out)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    # exact bf16 products, fp32 sums in another order, one bf16 rounding of the result
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


def tile_kernel(name: str):
    """(linear, linear_silu_mul, pack) of a kernel on the B-tile-packed weight: "amx" (AMX tiles), "fma" (AVX-512
    fp32 FMAs, for CPUs without AMX; it runs on AMX machines too, so both are tested there), "fma_dot" (the FMA
    kernel on AVX512-BF16's dot products, AMD's default) or "fma16" (the FMA kernel on an fp16 weight,
    AVX512-FP16). pack(w) -> (packed, the arguments after out)."""
    from pagellm.model_executor.layers.weight_forms import pack_amx, pack_fp16

    op = "fma" if name.startswith("fma") else name
    supported = {"fma16": ops.fma_linear_fp16_supported, "fma_dot": ops.fma_linear_dot_supported}.get(
        name, getattr(ops, f"{op}_linear_supported"))()
    if not supported:
        pytest.skip(f"this CPU lacks the instructions of the {name} kernel")

    def pack(w):
        if name != "fma16":  # the FMA kernel told which sums to take (by default it picks by CPU vendor)
            return pack_amx(w), {"amx": (), "fma": (1.0, 0), "fma_dot": (1.0, 1)}[name]
        packed, w_inv = pack_fp16(w)
        return packed, (w_inv,)

    return getattr(ops, f"{op}_linear").default, getattr(ops, f"{op}_linear_silu_mul").default, pack


TILE_KERNELS = pytest.mark.parametrize("tile", ["amx", "fma", "fma_dot", "fma16"])


@pytest.mark.parametrize("kernels", ["amx", "fma+gemv", "fma_dot+gemv", "fma16+gemv", "gemv+onednn"])
def test_cpu_linear_paths_agree_with_f_linear(kernels):
    from pagellm.model_executor.layers.linear import CPUKernels, CPULinear, _onednn_packing_works, cpu_kernels

    have = cpu_kernels(ops, torch.bfloat16)
    if kernels == "amx":
        k = CPUKernels(amx=tile_kernel("amx")[0])
    elif kernels.startswith("fma"):
        fma, fma_silu_mul, _ = tile_kernel(kernels.split("+")[0])
        k = CPUKernels(gemv=have.gemv if have else None, fma=fma, fma_silu_mul=fma_silu_mul,
                       fma_fp16=kernels.startswith("fma16"), fma_dot=kernels.startswith("fma_dot"))
    else:
        if not _onednn_packing_works(torch.bfloat16):  # e.g. AVX2 only: oneDNN packs bf16 from AVX512-BW on
            pytest.skip("oneDNN cannot pack bf16 weights on this CPU")
        k = CPUKernels(gemv=have.gemv if have else None, onednn_packing=True)
    torch.manual_seed(5)
    for n in (96, 40):  # 40: a partial 16-column tile
        w = torch.randn(n, 64).bfloat16()
        b = torch.randn(n).bfloat16()
        lin = CPULinear(w, b, k)
        for rows in (0, 1, 4, 5, 17, 64, 65, 128, 129, 512, 513):  # every path and its edges (0: a step that
            # samples nothing, as a long prompt's first chunks)
            x = torch.randn(rows, 64).bfloat16()
            torch.testing.assert_close(lin(x).float(), F.linear(x, w, b).float(), rtol=2e-2, atol=5e-2)


@TILE_KERNELS
@pytest.mark.parametrize("rows", [1, 11, 15, 16, 17, 33, 64, 65, 97, 130, 257, 520])  # row tiles and micro-blocks,
def test_tile_linear_matches_fp32_matmul(tile, rows):  # blocks, chunks, tails
    linear, _, pack = tile_kernel(tile)
    torch.manual_seed(6)
    x = torch.randn(rows, 640).bfloat16()[:, 32:608]  # rows strided, as a slice of a wider tensor
    w, b = torch.randn(200, 576).bfloat16(), torch.randn(200).bfloat16()  # 13 column tiles, the last half full
    out = torch.empty(rows, 200, dtype=torch.bfloat16)
    packed, extra = pack(w)
    linear(x, packed, b, out, *extra)
    want = F.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


@TILE_KERNELS
@pytest.mark.parametrize("rows", [1, 64, 520, 2100])
def test_tile_linear_is_the_same_on_any_thread_count(tile, rows):
    # threads claim blocks from both ends of the work (several threads per end from 3 on): every output block
    # must be computed exactly once, whoever computes it
    linear, _, pack = tile_kernel(tile)
    torch.manual_seed(7)
    x, w = torch.randn(rows, 576).bfloat16(), torch.randn(1000, 576).bfloat16()
    (packed, extra), threads, outs = pack(w), torch.get_num_threads(), []
    try:
        for n in (1, 2, 3, 5):
            torch.set_num_threads(n)
            out = torch.full((rows, 1000), float("nan"), dtype=torch.bfloat16)
            linear(x, packed, None, out, *extra)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert not outs[0].isnan().any()
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


@TILE_KERNELS
def test_tile_linear_takes_each_calls_own_x(tile):
    # the FMA kernel's threads keep their fp32 copy of x's rows from one claim to the next within a call: it must
    # never carry over into the next call (same shapes, new x, the same scratch)
    linear, _, pack = tile_kernel(tile)
    torch.manual_seed(8)
    w = torch.randn(1000, 576).bfloat16()
    (packed, extra), threads = pack(w), torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for rows in (64, 64, 200, 200, 64):
            x = torch.randn(rows, 576).bfloat16()
            out = torch.empty(rows, 1000, dtype=torch.bfloat16)
            linear(x, packed, None, out, *extra)
            want = F.linear(x.float(), w.float())
            torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    finally:
        torch.set_num_threads(threads)


@TILE_KERNELS
@pytest.mark.parametrize("rows,inter", [(1, 48), (17, 48), (64, 1536), (300, 80), (520, 96)])
def test_tile_linear_silu_mul_is_the_two_steps_bit_for_bit(tile, rows, inter):
    # the product in the GEMM's epilogue must give exactly what the linear into gate_up and silu_and_mul give
    # (the C++ decoder takes one, the Python loop on other paths the other); 80: a last block of one 16-column
    # panel; out strided, as the decoder's padded activation buffer
    linear, silu_mul, pack = tile_kernel(tile)
    torch.manual_seed(8)
    x = torch.randn(rows, 608).bfloat16()[:, :576]
    w, b = (torch.randn(2 * inter, 576) * 0.1).bfloat16(), torch.randn(2 * inter).bfloat16()
    packed, extra = pack(w)
    for bias in (None, b):
        gate_up = torch.empty(rows, 2 * inter, dtype=torch.bfloat16)
        linear(x, packed, bias, gate_up, *extra)
        want = torch.empty(rows, inter, dtype=torch.bfloat16)
        ops.silu_and_mul(gate_up, want)
        got = torch.full((rows, inter + 32), float("nan"), dtype=torch.bfloat16)[:, :inter]
        silu_mul(x, packed, bias, got, *extra)
        assert torch.equal(got, want)
    packed, extra = pack(w[:40])
    with pytest.raises(RuntimeError, match="multiple of 16"):
        silu_mul(x, packed, None, torch.empty(rows, 20, dtype=torch.bfloat16), *extra)


@TILE_KERNELS
def test_mlp_takes_the_fused_gate_up(tile):
    # the Python MLP (models the C++ decoder does not cover, e.g. Qwen3, and every model on CPUs without AMX)
    # routes gate/up through the tile kernel's silu_mul: called once, and the same bits as its own layers run one
    # after the other
    from types import SimpleNamespace

    from pagellm.model_executor.layers.linear import CPUKernels, replace_linears
    from pagellm.model_executor.models.llama import MLP

    linear, fused, _ = tile_kernel(tile)
    torch.manual_seed(9)
    mlp = MLP(SimpleNamespace(hidden_size=64, intermediate_size=96, mlp_bias=True), ops).bfloat16()
    calls = []
    spy = lambda *a: calls.append(fused(*a))  # noqa: E731
    kernels = (CPUKernels(amx=linear, amx_silu_mul=spy) if tile == "amx"
               else CPUKernels(fma=linear, fma_silu_mul=spy, fma_fp16=tile == "fma16", fma_dot=tile == "fma_dot"))
    replace_linears(mlp, kernels)
    x = torch.randn(40, 64).bfloat16()
    got = mlp(x)
    assert len(calls) == 1
    gate_up = mlp.gate_up_proj(x)  # the same tile kernel, into gate_up
    h = torch.empty(40, 96, dtype=torch.bfloat16)
    ops.silu_and_mul(gate_up, h)
    assert torch.equal(got, mlp.down_proj(h))
    # the tile kernels take every row count but for the streaming kernel's few rows (no dot products, fp16 copies):
    # where they take them all, the plain weight goes (drop_unread), and the other forms serve any x
    assert mlp.down_proj.weight.is_meta == (mlp.down_proj.tiled_min_rows == 1)
    one = torch.randn(1, 64).bfloat16()
    assert torch.equal(mlp.gate_up_proj(one.view(1, 1, 64)).view(1, -1), mlp.gate_up_proj(one))


def test_bf16_stores_round_denormals_and_nan_as_torch():
    # the kernels' bf16 stores take AVX512-BF16's conversion, which flushes denormals to zero; a vector holding
    # one must still round as torch does (add_rms_norm stores residual = x + residual). NaN stays NaN (torch's
    # own vectorised and scalar conversions differ in the NaN's bits).
    x = torch.full((2, 64), 1e-39).bfloat16()  # denormal in bf16 as in fp32
    r = torch.full((2, 64), 2e-39).bfloat16()
    x[1, 5] = float("nan")
    want = (x.float() + r.float()).bfloat16()
    ops.add_rms_norm(x, r, torch.ones(64, dtype=torch.bfloat16), 1e-5)
    nan = want.isnan()
    assert torch.equal(r.isnan(), nan) and nan.sum() == 1
    assert torch.equal(r.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    assert r[0, 0].item() != 0.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows_matches_torch_ties_nan_and_tails(dtype):
    torch.manual_seed(7)
    x = torch.randn(6, 1000).to(dtype)  # 1000: a scalar tail after the 16-lane chunks
    x[1, 5] = x[1, 700] = 50.0  # tie: the first index wins
    x[2, :] = float("-inf")  # all -inf: index 0
    x[3, 999] = 60.0  # maximum in the tail
    x[4, 300] = float("nan")  # NaN: its index, as torch
    x[5, 17] = x[5, 33] = 40.0  # tie inside the vector part, in different lanes
    out = torch.empty(6, dtype=torch.int64)
    ops.argmax_rows(x, out)
    assert out.tolist() == x.argmax(-1).tolist() == [out[0].item(), 5, 0, 999, 300, 17]


@pytest.mark.skipif(not ops.amx_linear_supported(), reason="CPU without AMX-BF16")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows,n,k", [(1, 40, 64), (7, 1000, 96), (300, 530, 64), (64, 4099, 576)])
def test_amx_linear_argmax_is_the_argmax_of_amx_linear(threads, rows, n, k):
    # the greedy LM head's kernel: torch.argmax of what amx_linear stores (bf16), across column blocks split between
    # threads (either end) and row chunks (300 rows), ties, NaN and infinities included
    from pagellm.model_executor.layers.weight_forms import pack_amx

    torch.manual_seed(rows + n)
    w, x = torch.randn(n, k).bfloat16(), torch.randn(rows, k).bfloat16()
    w[n - 1] = w[n // 2] = w[3]  # three columns always equal: a tie wherever they lead
    x[0] = 0.0  # every logit 0: index 0
    if rows > 3:
        x[1, 0] = float("nan")  # every logit NaN: index 0
        x[2] = float("inf")  # +inf, -inf and NaN (inf - inf) mixed
        x[3] = w[3] * 8  # column 3 and its copies lead: the first wins
    packed = pack_amx(w)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = torch.empty(rows, n, dtype=torch.bfloat16)
        ops.amx_linear(x, packed, None, y)
        got = torch.empty(rows, dtype=torch.int64)
        ops.amx_linear_argmax(x, packed, n, got)
    finally:
        torch.set_num_threads(old)
    assert got.tolist() == y.argmax(-1).tolist()
    if rows > 3:
        assert got[:2].tolist() == [0, 0] and got[3].item() == 3
    with pytest.raises(RuntimeError, match="packed"):
        ops.amx_linear_argmax(x, packed, n + 16, got)


@pytest.mark.skipif(not ops.amx_linear_supported(), reason="CPU without AMX-BF16")
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("rows,k", [(400, 576), (1250, 1184)])  # x held whole / in three parts of K (12, 12, 13)
def test_amx_linear_row_major_order_gives_the_column_major_bits(threads, rows, k):
    # prefill-sized calls take the rows block by block across column groups (amx_linear_cpu.cpp: row_block); each
    # row's sums run in the same order as in a small call's column-major pass, so every output row must be the same
    # bits as the same row computed in a call of a few rows: plain (bias, a half-full last panel, strided x and y),
    # silu_mul, and the argmax head
    from pagellm.model_executor.layers.weight_forms import pack_amx

    torch.manual_seed(rows)
    x = torch.randn(rows, k + 64).bfloat16()[:, 32:32 + k]
    w, b = (torch.randn(200, k) * 0.1).bfloat16(), torch.randn(200).bfloat16()
    wg = (torch.randn(2 * 1536, k) * 0.1).bfloat16()  # gate/up: 8 column groups of 6 blocks (0.87 MiB) at K = 1184
    packed, packed_gu = pack_amx(w), pack_amx(wg)
    few = torch.tensor([0, 1, 37, rows // 2, rows - 2, rows - 1])
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = torch.full((rows, 232), float("nan"), dtype=torch.bfloat16)[:, :200]
        ops.amx_linear(x, packed, b, y)
        h = torch.empty(rows, 1536, dtype=torch.bfloat16)
        ops.amx_linear_silu_mul(x, packed_gu, None, h)
        top = torch.empty(rows, dtype=torch.int64)
        ops.amx_linear_argmax(x, packed, 200, top)
        for i in few.tolist():
            xi = x[i:i + 1]
            yi, hi, ti = torch.empty(1, 200, dtype=torch.bfloat16), torch.empty(1, 1536, dtype=torch.bfloat16), \
                torch.empty(1, dtype=torch.int64)
            ops.amx_linear(xi, packed, b, yi)
            ops.amx_linear_silu_mul(xi, packed_gu, None, hi)
            ops.amx_linear_argmax(xi, packed, 200, ti)
            assert torch.equal(y[i], yi[0]) and torch.equal(h[i], hi[0]) and top[i] == ti[0], i
    finally:
        torch.set_num_threads(old)
    want = F.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(y.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    y0 = torch.empty(rows, 200, dtype=torch.bfloat16)
    ops.amx_linear(x, packed, None, y0)
    assert torch.equal(top, y0.argmax(-1))


def test_avx2_cpus_take_the_fma_kernels_and_the_cpp_decoder():
    # CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 2/3): torch's bf16 GEMM runs oneDNN's reference path there
    # (5-11 GFLOP/s on the project's 2-core Zen 3 VM), so the FMA kernel's 8-lane path must be what bf16 linears
    # take, and with it the C++ layer loop (which needs a tile kernel)
    from pagellm.model_executor.layers import cpu_kernels as build
    from pagellm.model_executor.layers.linear import cpu_kernels

    if not {"avx2", "fma"} <= set(build._cpu_flags().split()):
        pytest.skip("CPU without AVX2 and FMA")

    assert ops.fma_linear_supported()
    kernels = cpu_kernels(ops, torch.bfloat16)
    assert kernels is not None and (kernels.amx or kernels.fma)
    decoder = torch.classes.pagellm.LlamaDecoder(9, 3, 64, 96, 1e-5, 0.125, 1 << 40, 1 << 40, 4, False, False, 64)
    assert decoder is not None


def test_kernels_build_for_cpus_without_avx512_fp16_or_amx():
    """The kernels are compiled with -march=native, so this machine's build says nothing about another CPU's: one
    without AVX2 (x86-64-v2), one with AVX2 and FMA but no AVX-512 (x86-64-v3: the 8-lane paths) and one with
    AVX-512 but no AVX512-BF16/FP16 or AMX (skylake-avx512) must build them too, their instruction-specific parts
    behind #if (a constant of the fp16 path once sat inside the AVX-512 block and broke the first). Syntax only,
    in parallel, in C++17 (~45-70 s; the build's C++20 makes torch's headers take ~2.5x as long, and the sources
    are C++17). The same whatever PAGELLM_CPU_MARCH says, so left to the pass without it (make test)."""
    import os
    import pathlib
    import subprocess
    import sysconfig

    if os.environ.get("PAGELLM_CPU_MARCH"):
        pytest.skip("compiles the same for any PAGELLM_CPU_MARCH: make test's pass runs it")

    from torch.utils import cpp_extension

    from pagellm.model_executor.layers import cpu_kernels

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    csrc = pathlib.Path(cpu_kernels.__file__).parent / "csrc"
    sources = [str(csrc / s) for s in cpu_kernels._SOURCES]
    procs = {arch: subprocess.Popen([cxx, "-std=c++17", "-w", "-fsyntax-only", f"-march={arch}", *includes, *sources],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for arch in ("x86-64-v2", "x86-64-v3", "skylake-avx512")}
    for arch, proc in procs.items():
        _, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"-march={arch}:\n{err[-3000:]}"


def test_earlier_builds_of_this_source_tree_are_pruned(tmp_path):
    # A new build marks its directory with the source tree it came from and removes that tree's earlier builds;
    # another tree's builds, and directories without the mark, stay.
    from pagellm.model_executor.layers import cpu_kernels as build

    # A build for another -march (PAGELLM_CPU_MARCH) is another tree's as far as pruning goes.
    names = ("old", "new", "other", "unmarked", "haswell")
    old, new, other, unmarked, haswell = (tmp_path / f"pagellm_cpu_kernels_{n}" for n in names)
    for d in (old, new, other, unmarked, haswell):
        d.mkdir()
        (d / "x.so").write_bytes(b"")
    (old / "source_dir").write_text(str(build._CSRC))
    (other / "source_dir").write_text("/elsewhere/csrc")
    (haswell / "source_dir").write_text(f"{build._CSRC} -march=haswell")
    build._prune_old_builds(new)
    assert (new / "source_dir").read_text() == str(build._CSRC)
    assert not old.exists() and other.exists() and unmarked.exists() and haswell.exists() and (new / "x.so").exists()
    # the haswell tree's own next build prunes its earlier one and nothing else
    newer = tmp_path / "pagellm_cpu_kernels_newer"
    newer.mkdir()
    build._prune_old_builds(newer, "haswell")
    assert not haswell.exists() and new.exists() and other.exists()


@pytest.mark.parametrize("march", ["", "native; rm -rf /", "-O0", "Haswell", "no-such-cpu"])
def test_cpu_march_must_be_a_target_name(march, monkeypatch):
    from pagellm.model_executor.layers import cpu_kernels as build

    if march == "no-such-cpu" and not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("PAGELLM_CPU_MARCH", march)
    with pytest.raises(build.CPUMarchError, match="PAGELLM_CPU_MARCH"):
        build.load_extension.__wrapped__()
    # an engine stops on it instead of falling back to the torch backend (load_extension uncached, as in a fresh
    # process)
    from pagellm.model_executor.layers import cpu_attention

    monkeypatch.setattr(cpu_attention, "load_extension", build.load_extension.__wrapped__)
    with pytest.raises(build.CPUMarchError):
        select_backend("auto", torch.device("cpu"), 2, 32, 16)


def test_cpu_march_beyond_this_cpu_is_refused(monkeypatch):
    # A target using an extension this CPU lacks would stop the process with an illegal instruction: refused by
    # name. The CPU's flags are given here without AMX and AVX-512, so any x86-64 machine checks the same.
    from pagellm.model_executor.layers import cpu_kernels as build

    if not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no C++ compiler")
    monkeypatch.setattr(build, "_cpu_flags", lambda: "flags\t\t: fpu sse sse2 avx avx2 fma f16c bmi1 bmi2")
    for march, lacks in (("sapphirerapids", "amx_bf16, amx_int8, amx_tile, avx512_bf16"),
                         ("skylake-avx512", "avx512bw")):
        monkeypatch.setenv("PAGELLM_CPU_MARCH", march)
        with pytest.raises(build.CPUMarchError, match=f"uses {lacks}.*does not have"):
            build.cpu_march()
    for march in ("haswell", "x86-64"):  # within the CPU's extensions
        monkeypatch.setenv("PAGELLM_CPU_MARCH", march)
        assert build.cpu_march() == march
