"""reduced_precision_reduction: on CPUs with AVX512-FP16 and no AMX, the FMA kernel multiplies bf16 x by an fp16
copy of the weight (pack_fp16) with fp16 FMAs, each lane summing 32 products before they join an fp32 sum. Both
operands are scaled by powers of two first (x per row, w per matrix), so nothing overflows fp16 whatever the
magnitudes, and the error stays near that of the fp32 path, which the bf16 rounding of the result dominates."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagellm.model_executor.layers.cpu_kernels import load_extension
from pagellm.model_executor.layers.weight_forms import pack_amx, pack_fp16
from tests.conftest import teacher_forced_agreement

ops = load_extension()
needs_fp16 = pytest.mark.skipif(not ops.fma_linear_fp16_supported(), reason="CPU without AVX512-FP16")


def both_paths(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None):
    """(fp32-sum path, fp16-sum path, fp64 reference) of x @ w.T + b."""
    out32 = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)
    out16 = torch.empty_like(out32)
    ops.fma_linear(x, pack_amx(w), b, out32)
    packed, w_inv = pack_fp16(w)
    ops.fma_linear(x, packed, b, out16, w_inv)
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    return out32, out16, ref


@needs_fp16
@pytest.mark.parametrize("rows,k,n", [(1, 576, 960), (64, 576, 3072), (97, 1536, 576), (520, 64, 200)])
def test_error_stays_near_the_fp32_paths(rows, k, n):
    # SmolLM2's shapes: the result's error against fp64 is mostly its bf16 rounding (either path); fp16 partial
    # sums add a little. Summing whole rows in fp16 (no flush) or a wrong scale shows up far above this bound.
    torch.manual_seed(11)
    x = torch.randn(rows, k).bfloat16()
    w, b = (torch.randn(n, k) * 0.05).bfloat16(), torch.randn(n).bfloat16()
    out32, out16, ref = both_paths(x, w, b)
    err32 = (out32.double() - ref).abs().mean().item()
    err16 = (out16.double() - ref).abs().mean().item()
    assert err16 <= 1.4 * err32
    torch.testing.assert_close(out16.double(), ref, rtol=1e-2, atol=2e-2 * ref.abs().max().item())


@needs_fp16
def test_rows_of_any_magnitude_keep_their_precision():
    # each row is scaled on its own: a row of 1e4s, one of 1e-20s, zeros, one outlier among small values, and
    # weights far from 1 (x 1e3, x 1e-4) all come out as accurate as ordinary ones, with no inf
    torch.manual_seed(12)
    x = torch.randn(8, 576)
    x[0] *= 1e4
    x[1] *= 1e-20
    x[2] = 0.0
    x[3] *= 1e-3
    x[3, 100] = 3e4
    x = x.bfloat16()
    for w_mag in (1e3, 1e-4):
        w = (torch.randn(96, 576) * w_mag).bfloat16()
        out32, out16, ref = both_paths(x, w)
        assert out16.isfinite().all()
        assert torch.equal(out16[2], torch.zeros(96, dtype=torch.bfloat16))
        for r in (0, 1, 3, 4):  # error relative to each row's own magnitude
            scale = ref[r].abs().mean().item()
            err16 = (out16[r].double() - ref[r]).abs().mean().item() / scale
            err32 = (out32[r].double() - ref[r]).abs().mean().item() / scale
            assert err16 <= max(1.5 * err32, 4e-3), (w_mag, r, err16, err32)


@needs_fp16
def test_worst_case_sums_do_not_overflow():
    # every product at its largest with one sign: each fp16 lane's 32-product sum reaches its bound (2^14 after
    # the scaling), far above fp16's largest value without it (3e4 x 3e4 x 32)
    x = torch.full((3, 1536), 3e4).bfloat16()
    x[1] = -x[1]
    w = torch.full((64, 1536), 3e4).bfloat16()
    out32, out16, ref = both_paths(x, w)
    assert out16.isfinite().all()
    torch.testing.assert_close(out16.double(), ref, rtol=1e-2, atol=0)


@needs_fp16
def test_nan_and_inf_propagate_as_in_f_linear():
    torch.manual_seed(13)
    x = torch.randn(4, 64).bfloat16()
    x[1, 7] = float("nan")
    x[2, 9] = float("inf")
    w = torch.randn(32, 64).bfloat16()
    _, out16, _ = both_paths(x, w)
    want = F.linear(x.float(), w.float())
    assert torch.equal(out16.isfinite(), want.isfinite())
    assert torch.equal(out16.isnan(), want.isnan())


def test_pack_fp16_is_exact_and_scaled_below_one():
    torch.manual_seed(14)
    w = (torch.randn(48, 64) * 37.0).bfloat16()
    packed, w_inv = pack_fp16(w)
    assert packed.dtype == torch.float16 and 0.5 <= packed.abs().max().item() < 1.0
    assert w_inv == 2.0 ** round(torch.log2(torch.tensor(w_inv)).item())  # a power of two
    torch.testing.assert_close(packed.float() * w_inv, pack_amx(w).float(), rtol=0, atol=0)
    zero, one = pack_fp16(torch.zeros(16, 32, dtype=torch.bfloat16))
    assert one == 1.0 and not zero.any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_pack_amx_puts_each_weight_in_its_tile(dtype):
    # element [c, k, r, n, e] = weight[16c + n, 32k + 2r + e], columns past N zero (N = 40: a padded last tile),
    # for the 16-bit dtypes' 32-bit-pair copy and the plain one alike
    w = torch.arange(40 * 64, dtype=torch.float32).reshape(40, 64).to(dtype)
    p = pack_amx(w)
    assert p.shape == (3, 2, 16, 16, 2) and p.dtype == dtype and p.is_contiguous()
    c, k, r, n, e = (t.flatten() for t in torch.meshgrid(*(torch.arange(s) for s in p.shape), indexing="ij"))
    rows, cols = 16 * c + n, 32 * k + 2 * r + e
    inside = rows < 40
    assert torch.equal(p.flatten()[inside], w[rows[inside], cols[inside]]) and not p.flatten()[~inside].any()


@needs_fp16
def test_bad_operands_get_clear_errors():
    x, w = torch.randn(2, 64).bfloat16(), torch.randn(32, 64).bfloat16()
    packed, w_inv = pack_fp16(w)
    out = torch.empty(2, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="w_inv must be a positive number"):
        ops.fma_linear(x, packed, None, out, 0.0)
    with pytest.raises(RuntimeError, match="x, out: bfloat16"):
        ops.fma_linear(x.half(), packed, None, out, w_inv)
    if ops.amx_linear_supported():  # the AMX kernel takes bf16 weights only
        with pytest.raises(RuntimeError, match="bfloat16 only"):
            ops.amx_linear(x, packed, None, out)


def test_engine_switch_and_agreement_with_fp32(gguf_path, fp32_reference):
    """The engine takes the fp16 sums by default where the CPU has them, not with
    reduced_precision_reduction=False; on the default model its teacher-forced top-1 agreement with fp32 (bench
    agreement's measure) stays at the issue's bar. Measured 2026-12-02: 0.9956 on workload_16 (0.9951 with fp32
    sums), 0.9941 with attention's fp16 sums too."""
    from pagellm import LLM

    off = LLM(model=str(gguf_path), dtype="bfloat16", kv_cache_memory="64MiB", reduced_precision_reduction=False)
    assert "fma_fp16" not in off.llm_engine.model.linear_kernels
    assert not off.llm_engine.model.backend.fp16_sums
    del off
    # (without the int8 path of CPUs with AVX512-VNNI but no AMX, whose agreement tests/test_vnni_int8_linear.py holds)
    llm = LLM(model=str(gguf_path), dtype="bfloat16", kv_cache_memory="64MiB", gguf_int8_activations=False)
    kernels = llm.llm_engine.model.linear_kernels
    assert ("fma_fp16" in kernels) == (ops.fma_linear_fp16_supported() and not ops.amx_linear_supported())
    # the paged attention kernel's prefill chunks too (tests/test_fp16_attention.py)
    assert llm.llm_engine.model.backend.fp16_sums == bool(ops.paged_attention_fp16_supported())
    assert teacher_forced_agreement(llm, fp32_reference) >= 0.97


def test_bad_reduced_precision_reduction_names_the_field():
    from pagellm.config import EngineConfig

    with pytest.raises(ValueError, match="reduced_precision_reduction"):
        EngineConfig(reduced_precision_reduction="yes")
