"""GGUF weights in the linears' few-row path (layers/quantized.py, csrc/gguf_linear_cpu.cpp): the loader keeps a
Q4_1 or Q8_0 linear weight's blocks next to its dequantized copy, the model fuses them as it fuses the parameters,
and at up to 4 rows the kernel multiplies x by the exact fp32 weights (d * q + m, q * d), reading a third / half of
bf16's bytes."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from pagellm.model_executor.gguf_loader import _dequantize_torch
from pagellm.model_executor.layers.cpu_kernels import load_extension
from pagellm.model_executor.layers.quantized import BLOCK_BYTES, GGUFWeight

ops = load_extension()
needs_kernel = pytest.mark.skipif(not ops.gguf_linear_supported(), reason="CPU without AVX-512")
QTYPES = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}


def random_blocks(kind: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """uint8 [n, k/32 * block bytes]: blocks with random quants, d of either sign (and Q4_1's m around the range)."""
    g = torch.Generator().manual_seed(seed)
    nb, size = n * k // 32, BLOCK_BYTES[kind]
    raw = torch.randint(0, 256, (nb, size), dtype=torch.uint8, generator=g)
    d = ((torch.rand(nb, generator=g) - 0.3) * (0.04 if kind == "q4_1" else 0.004)).half()
    raw[:, 0:2] = d.view(torch.uint8).view(nb, 2)
    if kind == "q4_1":
        raw[:, 2:4] = ((torch.rand(nb, generator=g) - 0.7) * 0.2).half().view(torch.uint8).view(nb, 2)
    return raw.reshape(n, k // 32 * size)


@pytest.mark.parametrize("kind", sorted(QTYPES))
def test_blocks_dequantize_as_the_loader(kind):
    raw = random_blocks(kind, 24, 96)
    want = _dequantize_torch(raw.numpy().reshape(-1), QTYPES[kind]).reshape(24, 96)
    q = GGUFWeight.from_blocks(kind, raw)
    assert q.shape == (24, 96) and q.qs.shape == (24, 3, 16 if kind == "q4_1" else 32)
    assert q.scales.dtype == torch.float32 and torch.equal(q.dequantize(), torch.from_numpy(want))
    both = GGUFWeight.cat([q, GGUFWeight.from_blocks(kind, random_blocks(kind, 8, 96, seed=1))])
    assert both.shape == (32, 96) and torch.equal(both.dequantize()[:24], q.dequantize())
    other = "q8_0" if kind == "q4_1" else "q4_1"
    assert GGUFWeight.cat([q, GGUFWeight.from_blocks(other, random_blocks(other, 8, 96))]) is None


@needs_kernel
@pytest.mark.parametrize("kind", sorted(QTYPES))
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(13, 64), (70, 576), (960, 576), (64, 1536)])
def test_kernel_is_the_fp32_weights_product(kind, rows, n, k):
    # N not a multiple of the kernel's 4 columns (13, 70); x rows strided; with and without bias. The result is the
    # fp32 weights' product rounded once to bf16 (the fp32 sums' own error is far below that rounding).
    q = GGUFWeight.from_blocks(kind, random_blocks(kind, n, k, seed=n + k))
    w = q.dequantize().double()
    x = torch.randn(rows, k + 32).bfloat16()[:, :k]
    for bias in (None, torch.randn(n).bfloat16()):
        out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16)
        ops.gguf_linear(x, q.qs, q.scales, bias, out)
        ref = x.double() @ w.T + (0 if bias is None else bias.double())
        err = (out.double() - ref).abs()
        assert (err <= ref.abs() * 2.0 ** -8 + 1e-6 * ref.abs().max()).all(), err.max()


@needs_kernel
def test_bad_operands_get_clear_errors():
    q = GGUFWeight.from_blocks("q4_1", random_blocks("q4_1", 16, 64))
    q8 = GGUFWeight.from_blocks("q8_0", random_blocks("q8_0", 16, 64))
    x, out = torch.randn(2, 64).bfloat16(), torch.empty(2, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="1 to 4 rows"):
        ops.gguf_linear(torch.randn(5, 64).bfloat16(), q.qs, q.scales, None, torch.empty(5, 16).bfloat16())
    with pytest.raises(RuntimeError, match="x, out: bfloat16"):
        ops.gguf_linear(x.float(), q.qs, q.scales, None, out)
    with pytest.raises(RuntimeError, match="qs: uint8"):
        ops.gguf_linear(x, q.qs[:8], q.scales, None, out)
    with pytest.raises(RuntimeError, match="qs: uint8"):
        ops.gguf_linear(x, q.qs.view(torch.int8), q.scales, None, out)  # int8 quants are Q8_0's: 32 a block
    with pytest.raises(RuntimeError, match="scales: float32"):
        ops.gguf_linear(x, q.qs, q.scales.half(), None, out)
    with pytest.raises(RuntimeError, match="scales: float32"):
        ops.gguf_linear(x, q8.qs, q.scales, None, out)  # Q8_0 has one scale a block
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.gguf_linear(torch.randn(2, 48).bfloat16(), q.qs, q.scales, None, out)
    with pytest.raises(RuntimeError, match="bias: bfloat16"):
        ops.gguf_linear(x, q.qs, q.scales, torch.randn(15).bfloat16(), out)


@pytest.fixture(scope="module")
def gguf_llm(gguf_path):
    from pagellm import LLM

    return LLM(model=str(gguf_path), dtype="bfloat16", kv_cache_memory="64MiB")


@needs_kernel
def test_the_default_model_takes_its_blocks(gguf_llm):
    # every layer linear holds its (fused, q/k un-permuted) Q4_1 blocks and the LM head the tied embeddings' Q8_0
    # ones: dequantized and rounded to bf16 they are the model's weight exactly, which fails for a row out of place
    model = gguf_llm.llm_engine.model
    assert model.linear_kernels.endswith("+gguf")
    assert model.fast_lm_head.gguf.kind == "q8_0"
    assert torch.equal(model.fast_lm_head.gguf.dequantize().bfloat16(), model.fast_lm_head.weight)
    for layer in model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert lin.gguf is not None and lin.gguf.kind == "q4_1"
            assert torch.equal(lin.gguf.dequantize().bfloat16(), lin.weight)


@needs_kernel
def test_the_cpp_loop_takes_them_as_the_python_loop(gguf_llm):
    # requests of 1-3 tokens decoding alone and in pairs: every linear step has at most 4 rows, so both loops run
    # the GGUF kernel; logprobs identical step for step
    from pagellm import SamplingParams

    from conftest import pool_is_whole

    model = gguf_llm.llm_engine.model
    if model.decoder is None:
        pytest.skip("no C++ decoder here")
    prompts = [{"prompt_token_ids": [(7 * i + 3 * n) % 4000 + 100 for i in range(n)]} for n in (1, 3, 2, 1)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    runs, decoder = [], model.decoder
    try:
        for fused in (True, False):
            model.decoder = decoder if fused else None
            outs = gguf_llm.generate(prompts[:2], params, use_tqdm=False)
            outs += gguf_llm.generate(prompts[2:], params, use_tqdm=False)
            runs.append([(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs])
            assert pool_is_whole(gguf_llm)
    finally:
        model.decoder = decoder
    assert runs[0] == runs[1]


@needs_kernel
def test_short_prompts_agree_with_fp32(gguf_path, gguf_llm):
    # A prompt of 2-4 tokens prefills in one step of at most 4 rows. Wherever the fp32 engine's top two next tokens
    # are 0.25 nats or more apart, the bf16 engine must pick its token, with the blocks and without them (random
    # token ids make flat distributions: measured, with the blocks 45 of 48 equal, without them 44, every miss at
    # a gap under 0.2).
    from pagellm import LLM, SamplingParams

    prompts = [{"prompt_token_ids": [(13 * i + 7 * j) % 6000 + 200 for j in range(2 + i % 3)]} for i in range(48)]
    ref = LLM(model=str(gguf_path), dtype="float32", kv_cache_memory="64MiB")
    want, decided = [], []
    for o in ref.generate(prompts, SamplingParams(max_tokens=1, temperature=0, logprobs=2), use_tqdm=False):
        top = sorted((lp.logprob for lp in o.outputs[0].logprobs[0].values()), reverse=True)
        want.append(o.outputs[0].token_ids)
        decided.append(top[0] - top[1] >= 0.25)
    del ref
    assert sum(decided) >= 30
    off = LLM(model=str(gguf_path), dtype="bfloat16", kv_cache_memory="64MiB", gguf_quantized_linears=False)
    assert "gguf" not in off.llm_engine.model.linear_kernels
    params = SamplingParams(max_tokens=1, temperature=0)
    for llm in (gguf_llm, off):  # one request at a time: one step of 2-4 rows each
        got = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        assert all(g == w for g, w, d in zip(got, want, decided) if d)


def test_bad_gguf_quantized_linears_names_the_field():
    from pagellm.config import EngineConfig

    with pytest.raises(ValueError, match="gguf_quantized_linears"):
        EngineConfig(gguf_quantized_linears="yes")
