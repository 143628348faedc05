"""The few-row kernel on 4-bit GGUF blocks with x in int8 (csrc/gguf_int8_linear_cpu.cpp; layers/linear.py:
CPULinear.gguf_int8; EngineConfig.gguf_int8_activations): x rounded to int8 per 16 values at each call, the
weight's nibbles as they are (their blocks' bytes regrouped at load, 16 output columns side by side: gguf_int8_form),
a few outlier channels of x taken exactly. Held against the same math in fp64."""
from __future__ import annotations

import pytest
import torch

from pagellm.model_executor.layers.cpu_kernels import load_extension
from pagellm.model_executor.layers.linear import CPULinear, cpu_kernels
from pagellm.model_executor.layers.weight_forms import gguf_int8_form
from pagellm.model_executor.layers.quantized import GGUFWeight
from test_gguf_linear import random_blocks

ops = load_extension()
needs_kernel = pytest.mark.skipif(not ops.gguf_int8_linear_supported(), reason="CPU without AVX512-VNNI or AVX2")


def q4(n: int, k: int, seed: int = 0, kind: str = "q4_1") -> GGUFWeight:
    return GGUFWeight.from_blocks(kind, random_blocks(kind, n, k, seed=seed))


def chosen(x: torch.Tensor, p: int) -> torch.Tensor:
    """The p channels of largest |x| over the rows (NaN as infinite, ties to the lower index), ascending."""
    top = torch.nan_to_num(x.float().abs(), nan=float("inf")).amax(0)
    return torch.sort(torch.sort(top, descending=True, stable=True).indices[:p]).values.int()


def reference(x: torch.Tensor, q: GGUFWeight, chan: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """The kernel's math in fp64 from the same int8 rounding of x (fp32 steps per 16 values, ties to even): (y,
    the sum of the terms' magnitudes, which bounds the fp32 sums' rounding)."""
    m, k = x.shape
    xf = x.float()
    xo = xf[:, chan.long()].double()
    xz = xf.clone()
    xz[:, chan.long()] = 0
    halves = xz.view(m, k // 32, 2, 16)  # a step per 16 values: elements 0-15 and 16-31 of each block
    amax = halves.abs().amax(-1)
    dx = torch.where(torch.isfinite(amax), amax / 127, torch.full_like(amax, float("nan")))
    inv = 1 / dx
    inv = torch.where((dx > 0) & torch.isfinite(inv), inv, torch.zeros_like(inv))
    xq = torch.round(halves * inv[..., None]).double()  # fp32 product, then round half to even
    sx = halves.double().sum((-1, -2))
    nib = torch.stack([q.qs & 15, q.qs >> 4], -2).double()  # [N, KB, 2, 16]: elements 0-15, then 16-31
    d, mn = q.scales[..., 0].double(), q.scales[..., 1].double()  # [N, KB]
    dots = torch.einsum("mbhj,nbhj->mnbh", xq, nib)  # exact: integers well under 2^53
    terms = [(d[None, :, :, None] * dx.double()[:, None]) * dots, mn[None] * sx[:, None]]
    wc = q.dequantize().double()[:, chan.long()]
    y = terms[0].sum((-1, -2)) + terms[1].sum(-1) + xo @ wc.T
    size = terms[0].abs().sum((-1, -2)) + terms[1].abs().sum(-1) + xo.abs() @ wc.abs().T
    if bias is not None:
        y, size = y + bias.double(), size + bias.double().abs()
    return y, size


def run(x, q, form, bias=None, out=None):
    out = torch.full((x.shape[0], q.shape[0]), float("nan"), dtype=torch.bfloat16) if out is None else out
    ops.gguf_int8_linear(x, *form, bias, out)
    return out


def assert_close(out, y, size):
    err = (out.double() - y).abs()
    assert (err <= y.abs() * 2.0 ** -8 + 1e-5 * size).all(), err.max()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(13, 32), (13, 64), (70, 96), (37, 128), (960, 576), (64, 1536)])
def test_kernel_is_its_int8_math(rows, n, k):
    # depths of 1-4 blocks past a multiple of 4 (and 2), columns past a multiple of 4, a bias, x with two channels
    # 30x the rest: the first call chooses the 8 channels of largest |x| (those two among them) with the weight's
    # exact values there, a second call keeps them
    q = q4(n, k, seed=n + k)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g)
    x[:, 5] *= 30
    x[:, k - 1] *= -30
    x = x.bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    form = gguf_int8_form(q)
    assert form[2].shape == (min(8, k),) and (form[2] < 0).all()
    out = run(x, q, form, bias)
    chan = chosen(x, min(8, k))
    assert torch.equal(form[2], chan) and {5, k - 1} <= set(chan.tolist())
    assert torch.equal(form[3], q.dequantize()[:, chan.long()])
    assert_close(out, *reference(x, q, chan, bias))
    x2 = torch.randn(rows, k, generator=g).bfloat16()
    out2 = run(x2, q, form)
    assert torch.equal(form[2], chan)
    assert_close(out2, *reference(x2, q, chan, None))


@needs_kernel
def test_outlier_channels_keep_it_near_the_exact_product():
    # SmolLM2's shape, x with a few channels 20x the rest: against the exact fp32-weight product (what gguf_linear
    # computes), the int8 copy of x adds ~0.3% relative error with the outliers kept out of it and 2.7x that
    # without them; and the int8 result is not the exact one (the test sees the rounding it describes)
    q = q4(576, 576, seed=3)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 576, generator=g)
    x[:, [17, 301, 400]] *= 20
    x = x.bfloat16()
    exact = x.double() @ q.dequantize().double().T

    def rel(form):
        out = run(x, q, form).double()
        return ((out - exact).norm() / exact.norm()).item()

    kept, none = rel(gguf_int8_form(q)), rel(gguf_int8_form(q, outliers=0))
    assert 1e-4 < kept < 0.005 and none > 2 * kept, (kept, none)


@needs_kernel
def test_strided_rows_and_special_values():
    # x's rows strided, out a column slice of a wider tensor; an all-zero row gives the bias; a row holding a NaN
    # or an infinity gives NaN, the other rows untouched
    q = q4(40, 256, seed=1)
    wide = torch.randn(4, 300).bfloat16()
    x = wide[:, :256]
    x[1] = 0
    x[2, 7] = float("nan")
    x[3, 100] = float("inf")
    bias = torch.randn(40).bfloat16()
    form = gguf_int8_form(q, outliers=0)  # no channel taken out: the special values stay in the int8 blocks
    big = torch.zeros(4, 50, dtype=torch.bfloat16)
    run(x, q, form, bias, big[:, 5:45])
    assert torch.equal(big[1, 5:45], bias)
    assert big[2:, 5:45].isnan().all()
    y, size = reference(x[:1], q, form[2], bias)
    assert_close(big[:1, 5:45], y, size)
    assert (big[:, :5] == 0).all() and (big[:, 45:] == 0).all()


def test_the_form_regroups_the_blocks_bytes():
    # each 16 output columns' blocks side by side, a block's byte 4 j + e of column c at [j][4 c + e], the steps as
    # the 16 d and then the 16 m; columns past N (here 37 -> 48) zero
    q = q4(37, 96, seed=5)
    qs, sc, ch, wc = gguf_int8_form(q)
    assert qs.shape == (3, 3, 4, 64) and qs.dtype == torch.uint8 and sc.shape == (3, 3, 2, 16)
    assert ch.shape == (8,) and (ch < 0).all() and wc.shape == (37, 8)
    for n in (0, 15, 16, 36):
        g, c = divmod(n, 16)
        for b in range(3):
            for i in range(16):
                assert qs[g, b, i // 4, 4 * c + i % 4] == q.qs[n, b, i]
            assert sc[g, b, 0, c] == q.scales[n, b, 0] and sc[g, b, 1, c] == q.scales[n, b, 1]
    assert (qs[2, :, :, 4 * 5:] == 0).all() and (sc[2, :, :, 5:] == 0).all()


@needs_kernel
def test_bad_operands_get_clear_errors():
    q = q4(16, 64)
    x, out = torch.randn(2, 64).bfloat16(), torch.empty(2, 16, dtype=torch.bfloat16)
    qs, sc, ch, wc = gguf_int8_form(q)
    with pytest.raises(RuntimeError, match="1 to 4 rows"):
        ops.gguf_int8_linear(torch.randn(5, 64).bfloat16(), qs, sc, ch, wc, None, torch.empty(5, 16).bfloat16())
    with pytest.raises(RuntimeError, match="qs: uint8"):  # the GGUF blocks as they are, not the regrouped form
        ops.gguf_int8_linear(x, q.qs, sc, ch, wc, None, out)
    with pytest.raises(RuntimeError, match="scales: float32"):
        ops.gguf_int8_linear(x, qs, q.scales, ch, wc, None, out)
    with pytest.raises(RuntimeError, match="qs: uint8"):  # a weight of 32 columns against an output of 16
        ops.gguf_int8_linear(x, *gguf_int8_form(q4(32, 64))[:2], ch, wc, None, out)
    with pytest.raises(RuntimeError, match="wc: float32"):
        ops.gguf_int8_linear(x, qs, sc, ch, wc[:8], None, out)
    with pytest.raises(RuntimeError, match="channels: ascending"):
        ops.gguf_int8_linear(x, qs, sc, torch.tensor([3, 3, 5, 6, 7, 8, 9, 10], dtype=torch.int32), wc, None, out)
    with pytest.raises(RuntimeError, match="channels: int32"):
        ops.gguf_int8_linear(x, qs, sc, ch.long(), wc, None, out)


@needs_kernel
def test_cpu_linear_takes_it_for_4_bit_pieces_only():
    # a fused weight of a Q4_K part (the q4_1 layout) and a Q6_K one: up to 4 rows the 4-bit part takes the int8
    # kernel and the other the exact one, each into its columns; with int8_activations off both take the exact one
    parts = [q4(40, 512, seed=2, kind="q4_k"), q4(24, 512, seed=4, kind="q6_k")]
    fused = GGUFWeight.cat(parts)
    w = fused.dequantize()
    x = torch.randn(3, 512).bfloat16()
    lin = CPULinear(w.bfloat16(), None, cpu_kernels(ops, torch.bfloat16))
    assert lin.set_gguf(fused) and lin.gguf_int8[0] is not None and lin.gguf_int8[1] is None
    out = lin(x)
    assert_close(out[:, :40], *reference(x, parts[0], lin.gguf_int8[0][2], None))
    exact = x.double() @ parts[1].dequantize().double().T
    assert ((out[:, 40:].double() - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-6 * exact.abs().max()).all()
    off = CPULinear(w.bfloat16(), None, cpu_kernels(ops, torch.bfloat16, int8_activations=False))
    assert off.set_gguf(fused) and off.gguf_int8 == []
    exact = x.double() @ w.double().T
    assert ((off(x).double() - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-6 * exact.abs().max()).all()


@needs_kernel
def test_engines_choose_the_same_channels_at_start(gguf_path):
    # LLMEngine.choose_int8_outliers makes each 4-bit linear's first few-row call a fixed prompt's: after start every
    # form holds its channels, the same in a second engine whatever its first request, and decoding one request
    # (every step at most 4 rows) leaves them as they were; the pool ends whole
    from pagellm import LLM, SamplingParams

    from conftest import pool_is_whole

    def forms(llm):
        return [f for m in llm.llm_engine.model.modules() if isinstance(m, CPULinear) for f in m.gguf_int8 if f]

    a = LLM(model=str(gguf_path), dtype="bfloat16", kv_cache_memory="32MiB")
    chans = [f[2].clone() for f in forms(a)]
    assert len(chans) == 120 and all((c >= 0).all() and len(c) == 8 for c in chans)
    out = a.generate([{"prompt_token_ids": [4000, 17, 23]}], SamplingParams(max_tokens=6, temperature=0,
                                                                              ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6 and pool_is_whole(a)
    assert all(torch.equal(c, f[2]) for c, f in zip(chans, forms(a)))
    del a
    b = LLM(model=str(gguf_path), dtype="bfloat16", kv_cache_memory="32MiB")
    assert all(torch.equal(c, f[2]) for c, f in zip(chans, forms(b)))
    off = LLM(model=str(gguf_path), dtype="bfloat16", kv_cache_memory="32MiB", gguf_int8_activations=False)
    assert forms(off) == [] and off.llm_engine.model.linear_kernels.endswith("+gguf")
