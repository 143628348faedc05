"""The AMX tile linear on a 4-bit GGUF weight's nibbles (csrc/amx_q4_panels.h, amx_linear_cpu.cpp: amx_q4_linear;
layers/quantized.py: pack_amx_q4): each B tile rebuilt in bf16 from the nibbles just before its multiplies. Its
output must be amx_linear's on the loader's bf16 weight bit for bit, for every 4-bit type and any shape, and the
engine must route decode batches of 5 to AMX_Q4_MAX_ROWS rows to it without changing a token or a logprob."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from pagellm.model_executor.layers.cpu_kernels import load_extension
from pagellm.model_executor.layers.linear import AMX_Q4_MAX_ROWS, GEMV_MAX_ROWS
from pagellm.model_executor.layers.weight_forms import pack_amx
from pagellm.model_executor.layers.quantized import GGUFWeight
from test_gguf_linear import gguf_llm, random_blocks  # noqa: F401 (gguf_llm: a fixture)

ops = load_extension()
needs_amx = pytest.mark.skipif(not ops.amx_q4_linear_supported(), reason="CPU without AMX-BF16 and AVX512-BF16")


def loader_weight(kind: str, raw: torch.Tensor) -> torch.Tensor:
    """The bf16 weight the loader makes of the blocks: gguf's fp32 values, rounded to nearest even."""
    return torch.from_numpy(gguf_quants.dequantize(raw.numpy(), GGMLQuantizationType[kind])).bfloat16()


def test_pack_amx_q4_puts_each_weight_where_the_tile_reads_it():
    # unpacked by hand (no kernel): byte b of k-pair row p of tile t, step kc, holds column 16 t + b // 2 (low nibble)
    # and 16 t + 8 + b // 2 (high) at depth 32 kc + 2 p + b % 2; scales d then m per column; 40 columns: the
    # third tile's last 8 columns are zeros
    q = GGUFWeight.from_blocks("Q4_1", random_blocks("Q4_1", 40, 96, seed=3))
    q4, sc = q.pack_amx_q4()
    assert q4.shape == (3, 3, 16, 16) and q4.dtype == torch.uint8 and sc.shape == (3, 3, 2, 16)
    lanes = torch.stack([q4 & 0x0F, q4 >> 4], dim=3).reshape(3, 3, 16, 16, 2)  # [t, kc, p, n, j]
    nib = lanes.permute(0, 3, 1, 2, 4).reshape(48, 96).float()  # [t n, kc p j]
    d = sc[:, :, 0].permute(0, 2, 1).reshape(48, 3, 1).expand(48, 3, 32).reshape(48, 96)
    m = sc[:, :, 1].permute(0, 2, 1).reshape(48, 3, 1).expand(48, 3, 32).reshape(48, 96)
    w = d * nib + m
    assert torch.equal(w[:40], q.dequantize()) and not w[40:].any()
    with pytest.raises(ValueError, match="q4_1 layout, not q8_0"):
        GGUFWeight.from_blocks("Q8_0", random_blocks("Q8_0", 16, 64)).pack_amx_q4()


@needs_amx
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40, 64, 300])
def test_the_same_bits_as_amx_linear_on_the_loaders_weight(kind, rows):
    # plain with and without bias, N not a multiple of 32 (a lone 16-column tile, 8 padded columns), K = 1,536
    # (down's), and silu(gate) * up; x rows strided; 300 rows: two 256-row chunks, each rebuilding the panels
    for n, k in ((40, 256), (96, 1536), (576, 512)):
        raw = random_blocks(kind, n, k, seed=rows + n)
        q = GGUFWeight.from_blocks(kind, raw)
        w = loader_weight(kind, raw)
        assert torch.equal(q.dequantize().bfloat16(), w)
        x = torch.randn(rows, k + 32).bfloat16()[:, :k]
        for bias in (None, torch.randn(n).bfloat16()):
            want = torch.empty(rows, n, dtype=torch.bfloat16)
            got = torch.full((rows, n), float("nan"), dtype=torch.bfloat16)
            ops.amx_linear(x, pack_amx(w), bias, want)
            ops.amx_q4_linear(x, *q.pack_amx_q4(), bias, got, False)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (n, k, bias is None)
            assert got.abs().sum() > 0  # a test that can fail: outputs, not zeros
    raw = random_blocks(kind, 96, 512, seed=rows)  # gate | up, 48 each
    q, w = GGUFWeight.from_blocks(kind, raw), loader_weight(kind, raw)
    x = torch.randn(rows, 512).bfloat16()
    want = torch.empty(rows, 48, dtype=torch.bfloat16)
    got = torch.full((rows, 48), float("nan"), dtype=torch.bfloat16)
    ops.amx_linear_silu_mul(x, pack_amx(w), None, want)
    ops.amx_q4_linear(x, *q.pack_amx_q4(), None, got, True)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@needs_amx
def test_bad_operands_get_clear_errors():
    q4, sc = GGUFWeight.from_blocks("Q4_1", random_blocks("Q4_1", 32, 64)).pack_amx_q4()
    x, out = torch.randn(3, 64).bfloat16(), torch.empty(3, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="q4: uint8"):
        ops.amx_q4_linear(x, q4.view(torch.int8), sc, None, out, False)
    with pytest.raises(RuntimeError, match="q4: uint8"):
        ops.amx_q4_linear(torch.randn(3, 96).bfloat16(), q4, sc, None, out, False)  # K does not match
    with pytest.raises(RuntimeError, match="scales: float32"):
        ops.amx_q4_linear(x, q4, sc.half(), None, out, False)
    with pytest.raises(RuntimeError, match="x, out: bfloat16"):
        ops.amx_q4_linear(x.float(), q4, sc, None, out, False)
    with pytest.raises(RuntimeError, match="N matching q4"):
        ops.amx_q4_linear(x, q4, sc, None, torch.empty(3, 48, dtype=torch.bfloat16), False)
    with pytest.raises(RuntimeError, match="intermediate size"):
        ops.amx_q4_linear(x, q4, sc, None, torch.empty(3, 8, dtype=torch.bfloat16), True)
    with pytest.raises(RuntimeError, match="bias: bfloat16"):
        ops.amx_q4_linear(x, q4, sc, torch.randn(31).bfloat16(), out, False)


@needs_amx
def test_the_engine_decodes_batches_on_it_with_the_same_logprobs(gguf_llm):
    # the default model's Q4_1 layer linears hold their nibbles; 12 requests decode 12-row steps, which the C++ loop
    # runs on amx_q4_linear (the profiler sees it), and, rebuilt with the nibbles dropped, on the bf16 weight:
    # tokens and logprobs identical step for step
    from torch.profiler import ProfilerActivity, profile

    from pagellm import SamplingParams

    from conftest import pool_is_whole

    model = gguf_llm.llm_engine.model
    lins = [lin for layer in model.layers for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                     layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    assert all(lin.amx_q4 is not None for lin in lins) and model.fast_lm_head.amx_q4 is None  # the head is Q8_0
    assert "+amx_q4+gguf" in model.linear_kernels  # what the benchmarks' JSON lines report
    if model.decoder is None:
        pytest.skip("no C++ decoder here")
    assert GEMV_MAX_ROWS < 12 <= AMX_Q4_MAX_ROWS
    prompts = [{"prompt_token_ids": [(11 * i + 5 * n) % 4000 + 100 for i in range(n)]} for n in range(3, 15)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
    runs, decoder, nibbles = [], model.decoder, [lin.amx_q4 for lin in lins]
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            outs = gguf_llm.generate(prompts, params, use_tqdm=False)
        assert any(e.key.startswith("pagellm::amx_q4_linear") for e in prof.key_averages())
        runs.append(outs)
        for lin in lins:
            lin.amx_q4 = None
        model.decoder, model._bound_caches = model._build_decoder(lins[0].kernels), None  # on the bf16 weights
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            runs.append(gguf_llm.generate(prompts, params, use_tqdm=False))
        assert not any(e.key.startswith("pagellm::amx_q4_linear") for e in prof.key_averages())
        assert pool_is_whole(gguf_llm)
    finally:
        model.decoder, model._bound_caches = decoder, None
        for lin, q in zip(lins, nibbles):
            lin.amx_q4 = q
    a, b = ([(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in r] for r in runs)
    assert a == b


@needs_amx
def test_cpu_linear_routes_rows_past_the_gguf_kernel_to_it():
    # CPULinear (the Python loop's linear): a Q4_1 weight holds its nibbles after set_gguf; 5-128 rows take them (the
    # same bits as the packed bf16 weight, plain and silu * up), 1-4 rows the GGUF kernel, 129 the bf16 panels.
    # A Q8_0 weight keeps no nibbles.
    from pagellm.model_executor.layers.linear import CPULinear, cpu_kernels

    kernels = cpu_kernels(ops, torch.bfloat16)
    raw = random_blocks("Q4_1", 96, 256, seed=7)
    q = GGUFWeight.from_blocks("Q4_1", raw)
    lin = CPULinear(loader_weight("Q4_1", raw), None, kernels)
    assert lin.set_gguf(q) and lin.amx_q4 is not None
    for rows in (4, 5, 37, 128, 129):
        x = torch.randn(rows, 256).bfloat16()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            got, got_act = lin(x), lin.silu_and_mul(x)
        took = any("amx_q4_linear" in e.key for e in prof.key_averages())
        assert took == (GEMV_MAX_ROWS < rows <= AMX_Q4_MAX_ROWS), rows
        nibbles, lin.amx_q4 = lin.amx_q4, None
        want, want_act = lin(x), lin.silu_and_mul(x)
        lin.amx_q4 = nibbles
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        if rows > GEMV_MAX_ROWS:
            assert torch.equal(got_act.view(torch.int16), want_act.view(torch.int16))
    q8 = GGUFWeight.from_blocks("Q8_0", random_blocks("Q8_0", 96, 256))
    lin8 = CPULinear(q8.dequantize().bfloat16(), None, kernels)
    assert lin8.set_gguf(q8) and lin8.amx_q4 is None
