"""GGUF weights in the linears' few-row path (layers/quantized.py, csrc/gguf_linear_cpu.cpp): the loader keeps a
linear weight's quants (Q4_0/1, Q5_0/1, Q8_0, Q4_K, Q5_K, Q6_K, re-packed into the kernel's four layouts) next to
its dequantized copy, the model fuses them as it fuses the parameters, and at up to 4 rows the kernel multiplies x by
the exact fp32 weights (gguf's own values), reading 6-10 bits a weight instead of bf16's 16."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from pagellm.model_executor.gguf_loader import _dequantize_torch
from pagellm.model_executor.layers.cpu_kernels import load_extension
from pagellm.model_executor.layers.linear import VNNI_INT8_MAX_EXCESS
from pagellm.model_executor.layers.quantized import GGUF_BLOCKS, GGUFParts, GGUFWeight, pack_vnni_int8
from pagellm.model_executor.layers.weight_forms import pack_amx

ops = load_extension()
needs_kernel = pytest.mark.skipif(not ops.gguf_linear_supported(), reason="CPU without AVX-512 or AVX2 with FMA")
QTYPES = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}


# where each type keeps its fp16 scales in a block: (offset, spread) of d, and of m / dmin where it has one
SCALES = {"Q4_0": [(0, 0.04)], "Q4_1": [(0, 0.04), (2, 0.2)], "Q5_0": [(0, 0.02)], "Q5_1": [(0, 0.02), (2, 0.2)],
          "Q8_0": [(0, 0.004)], "Q4_K": [(0, 0.001), (2, 0.002)], "Q5_K": [(0, 0.0005), (2, 0.002)],
          "Q6_K": [(208, 0.0005)]}


def random_blocks(kind: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """uint8 [n, k / block weights * block bytes] of GGUF type kind: random quants (and K-quants' packed 6-bit
    scales), fp16 scales of either sign in the model's range."""
    kind = kind.upper()
    per, size = GGUF_BLOCKS[kind]
    g = torch.Generator().manual_seed(seed)
    nb = n * k // per
    raw = torch.randint(0, 256, (nb, size), dtype=torch.uint8, generator=g)
    for at, spread in SCALES[kind]:
        v = ((torch.rand(nb, generator=g) - (0.3 if at == 0 or kind.endswith("_K") else 0.7)) * spread).half()
        raw[:, at:at + 2] = v.view(torch.uint8).view(nb, 2)
    return raw.reshape(n, k // per * size)


@pytest.mark.parametrize("kind", sorted(GGUF_BLOCKS))
def test_every_type_unpacks_to_gguf_exact_weights(kind):
    # each weight, bit for bit, what gguf.quants.dequantize makes of the file's block; 512 columns: two K-quant
    # super-blocks a row
    raw = random_blocks(kind, 12, 512, seed=len(kind))
    want = gguf_quants.dequantize(raw.numpy(), GGMLQuantizationType[kind])
    q = GGUFWeight.from_blocks(kind, raw)
    assert q.shape == (12, 512) and q.qs.shape[:2] == (12, 16) and q.scales.dtype == torch.float32
    got = q.dequantize()
    assert got.shape == want.shape and torch.equal(got, torch.from_numpy(want))
    assert np.isfinite(want).all() and (want != 0).mean() > 0.9  # a test that can fail: varied, finite weights


@pytest.mark.parametrize("kind", sorted(GGUF_BLOCKS))
def test_dequantize_in_pieces_is_the_same(kind, monkeypatch):
    # dequantize makes DEQUANT_FLOATS values at a time: 300 of 512 a row is one row a piece, 1,100 two rows and a
    # last piece of one; each rounded once to the dtype asked for
    from pagellm.model_executor.layers import quantized

    q = GGUFWeight.from_blocks(kind, random_blocks(kind, 5, 512, seed=4))
    whole = q.dequantize()
    for floats in (300, 1100):
        monkeypatch.setattr(quantized, "DEQUANT_FLOATS", floats)
        assert torch.equal(q.dequantize(), whole)
        assert torch.equal(q.dequantize(torch.bfloat16), whole.bfloat16())


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
    o = GGUFWeight.from_blocks(other, random_blocks(other, 8, 96))
    mixed = GGUFWeight.cat([q, q, o])  # runs of one layout merge: two parts, rows in order
    assert isinstance(mixed, GGUFParts) and [p.kind for p in mixed.parts] == [kind, other]
    assert mixed.shape == (56, 96) and [col for _, col in mixed.pieces] == [0, 48]
    assert torch.equal(mixed.dequantize(), torch.cat([q.dequantize(), q.dequantize(), o.dequantize()]))


@needs_kernel
@pytest.mark.parametrize("kind", sorted(GGUF_BLOCKS))
@pytest.mark.parametrize("rows", [1, 4])
def test_kernel_reads_every_layout(kind, rows):
    # the kernel on each type's re-packed quants is the product with gguf's fp32 weights, rounded once to bf16
    n, k = 70, 768
    q = GGUFWeight.from_blocks(kind, random_blocks(kind, n, k, seed=rows))
    w = torch.from_numpy(gguf_quants.dequantize(random_blocks(kind, n, k, seed=rows).numpy(),
                                                GGMLQuantizationType[kind])).double()
    x = torch.randn(rows, k).bfloat16()
    out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16)
    ops.gguf_linear(x, q.qs, q.scales, None, out)
    ref = x.double() @ w.T
    err = (out.double() - ref).abs()
    assert (err <= ref.abs() * 2.0 ** -8 + 1e-6 * ref.abs().max()).all(), err.max()


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
def test_a_linear_of_mixed_parts_writes_each_into_its_columns():
    # CPULinear with a fused weight of three parts in two layouts and a bias: at up to 4 rows, one kernel call a
    # part into its columns (bias sliced alike) is the product with the whole fp32 weight (x as it is: the 4-bit
    # part's int8 kernel is test_gguf_int8_linear's)
    from pagellm.model_executor.layers.linear import CPULinear, cpu_kernels

    parts = [GGUFWeight.from_blocks(kind, random_blocks(kind, n, 512, seed=n)) for kind, n in
             (("Q4_K", 40), ("Q4_K", 24), ("Q6_K", 24))]
    fused = GGUFWeight.cat(parts)
    w = fused.dequantize()
    bias = torch.randn(88).bfloat16()
    lin = CPULinear(w.bfloat16(), bias, cpu_kernels(ops, torch.bfloat16, int8_activations=False))
    assert lin.set_gguf(fused) and len(fused.pieces) == 2
    for rows in (1, 3):
        x = torch.randn(rows, 512).bfloat16()
        ref = x.double() @ w.double().T + bias.double()
        err = (lin(x).double() - ref).abs()
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
        ops.gguf_linear(x, q8.qs.view(torch.uint8), q8.scales, None, out)  # uint8 quants need d and m
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.gguf_linear(torch.randn(2, 48).bfloat16(), q.qs, q.scales, None, out)
    with pytest.raises(RuntimeError, match="bias: bfloat16"):
        ops.gguf_linear(x, q.qs, q.scales, torch.randn(15).bfloat16(), out)


@pytest.fixture(scope="module")
def gguf_llm(gguf_path):
    from pagellm import LLM

    return LLM(model=str(gguf_path), dtype="bfloat16", kv_cache_memory="64MiB")


def ungrouped(form: tuple[torch.Tensor, ...], n: int) -> GGUFWeight:
    """The q4_1 weight [n, K] whose blocks gguf_int8_form regrouped into form (its inverse)."""
    qs, scales = form[0], form[1]
    n16, kb = qs.shape[0], qs.shape[1]
    return GGUFWeight("q4_1", qs.view(n16, kb, 4, 16, 4).permute(0, 3, 1, 2, 4).reshape(n16 * 16, kb, 16)[:n],
                      scales.permute(0, 3, 1, 2).reshape(n16 * 16, kb, 2)[:n])


@needs_kernel
def test_the_default_model_takes_its_blocks(gguf_llm, gguf_path):
    # every layer linear holds its (fused, q/k un-permuted) Q4_1 blocks and the LM head the tied embeddings' Q8_0
    # ones: dequantized and rounded to bf16 they are the checkpoint's weight exactly, which fails for a row out of
    # place. A linear whose int8 kernels take every row count (CPUs with AVX512-VNNI but no AMX) holds no packed
    # copy, nor its bf16 weight and blocks: there the regrouped blocks are checked the same way.
    from pagellm.model_executor.loader import load_checkpoint

    weights = load_checkpoint(gguf_path, torch.bfloat16).weights
    model = gguf_llm.llm_engine.model
    assert model.linear_kernels.endswith("+gguf_int8" if ops.gguf_int8_linear_supported() else "+gguf")
    assert model.fast_lm_head.gguf.kind == "q8_0"
    head = model.fast_lm_head  # (its plain weight is the embeddings'; the head drops its own where unread)
    assert torch.equal(head.gguf.dequantize().bfloat16(), weights["model.embed_tokens.weight"])
    assert torch.equal(model.embed_tokens.weight, weights["model.embed_tokens.weight"])
    assert head.weight.is_meta == (head.screen is None and head.amx_weight is not None)
    lean = 0
    for i, layer in enumerate(model.layers):
        for name, parts in (("self_attn.qkv_proj", ["q", "k", "v"]), ("self_attn.o_proj", ["o"]),
                            ("mlp.gate_up_proj", ["gate", "up"]), ("mlp.down_proj", ["down"])):
            lin = layer.get_submodule(name)
            src = name.split(".")[0]
            want = torch.cat([weights[f"model.layers.{i}.{src}.{p}_proj.weight"] for p in parts])
            assert lin.gguf is not None and lin.gguf.kind == "q4_1" and lin.weight.shape == want.shape
            covered = lin.vnni_int8 is not None and all(lin.gguf_int8)
            assert (lin.amx_weight is None) == covered and lin.gguf.qs.is_meta == (lin.gguf_int8 != [])
            assert lin.weight.is_meta == (covered or lin.amx_weight is not None)  # (the packed copy serves)
            lean += covered
            if lin.gguf_int8:
                assert torch.equal(ungrouped(lin.gguf_int8[0], want.shape[0]).dequantize().bfloat16(), want)
            else:
                assert torch.equal(lin.gguf.dequantize().bfloat16(), want)
            if not lin.weight.is_meta:
                assert torch.equal(lin.weight, want)
            elif lin.amx_weight is not None and lin.amx_weight.dtype == torch.bfloat16:  # B-tile order (pack_amx)
                assert torch.equal(lin.amx_weight, pack_amx(want))
    assert lean in (0, 4 * len(model.layers))


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
    # are 0.5 nats or more apart, the bf16 engine must pick its token, with the blocks and without them (random
    # token ids make flat distributions: measured on the AVX-512 VM, with the blocks 45 of 48 equal, without them
    # 44, every miss at a gap under 0.2; on the AVX2 VM (AMD Zen 3) 44 and 43, the largest gap missed 0.47, with
    # the blocks and by the plain torch path alike, while its bf16 linears and the fp32 reference run other GEMMs).
    from pagellm import LLM, SamplingParams

    prompts = [{"prompt_token_ids": [(13 * i + 7 * j) % 6000 + 200 for j in range(2 + i % 3)]} for i in range(48)]
    ref = LLM(model=str(gguf_path), dtype="float32", kv_cache_memory="64MiB")
    want, decided = [], []
    for o in ref.generate(prompts, SamplingParams(max_tokens=1, temperature=0, logprobs=2), use_tqdm=False):
        top = sorted((lp.logprob for lp in o.outputs[0].logprobs[0].values()), reverse=True)
        want.append(o.outputs[0].token_ids)
        decided.append(top[0] - top[1] >= 0.5)
    del ref
    assert sum(decided) >= 20  # 24 on the AVX2 VM
    off = LLM(model=str(gguf_path), dtype="bfloat16", kv_cache_memory="64MiB", gguf_quantized_linears=False)
    assert "gguf" not in off.llm_engine.model.linear_kernels
    params = SamplingParams(max_tokens=1, temperature=0)
    for llm in (gguf_llm, off):  # one request at a time: one step of 2-4 rows each
        got = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        assert all(g == w for g, w, d in zip(got, want, decided) if d)


def mixed_gguf(path, types: dict[str, str]):
    """A tiny llama (hidden 256, intermediate 512) whose 2-D weights named in types (by module: "q_proj", ...,
    "lm_head", "embed_tokens") are random blocks of those GGUF types, written as llama.cpp writes them (q/k rows
    permuted) -> (path, its config, the blocks by GGUF name: (type, uint8 [rows, row bytes]))."""
    from checkpoint_files import hf_to_gguf_name, random_state_dict, tiny_config, write_gguf

    cfg = tiny_config("llama", hidden_size=256, intermediate_size=512)
    _, sd = random_state_dict(cfg)
    raw = {}
    for name, t in sd.items():
        kind = types.get(name.split(".")[-2])
        if kind and t.dim() == 2:
            raw[hf_to_gguf_name(name)] = (kind, random_blocks(kind, t.shape[0], t.shape[1], seed=len(raw)).numpy())
    return write_gguf(path, "llama", cfg, sd, tokenizer=False, raw=raw), cfg, raw


@needs_kernel
def test_a_k_quant_file_takes_its_blocks(tmp_path):
    # A tiny llama written with K-quant blocks mixed as llama.cpp's Q4_K_M mixes them: every linear takes its quants
    # (dequantized and rounded to bf16 they are its weight), qkv as two parts (q and k in Q4_K, then v in Q6_K),
    # each into its columns. Both layer loops then decode alike, and the pool ends whole.
    from checkpoint_files import hf_to_gguf_name

    from conftest import pool_is_whole
    from pagellm import LLM, SamplingParams

    path, _, raw = mixed_gguf(tmp_path / "k.gguf", {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K",
                                                     "o_proj": "Q5_K", "gate_proj": "Q4_K", "up_proj": "Q4_K",
                                                     "down_proj": "Q6_K", "lm_head": "Q6_K"})
    llm = LLM(model=str(path), dtype="bfloat16", kv_cache_memory="16MiB")
    model = llm.llm_engine.model
    assert model.linear_kernels.endswith("+gguf_int8" if ops.gguf_int8_linear_supported() else "+gguf")
    assert model.fast_lm_head.gguf.kind == "q8_2"
    from pagellm.model_executor.loader import load_checkpoint

    weights = load_checkpoint(path, torch.bfloat16).weights  # (each weight dequantized whole by the loader)
    assert torch.equal(model.fast_lm_head.gguf.dequantize().bfloat16(), weights["lm_head.weight"])
    for i, layer in enumerate(model.layers):
        a, m = layer.self_attn, layer.mlp
        assert [p.kind for p in a.qkv_proj.gguf.parts] == ["q4_1", "q8_2"]
        assert (a.o_proj.gguf.kind, m.gate_up_proj.gguf.kind, m.down_proj.gguf.kind) == ("u8_1", "q4_1", "q8_2")
        for lin, parts in ((a.qkv_proj, ["self_attn.q", "self_attn.k", "self_attn.v"]), (a.o_proj, ["self_attn.o"]),
                           (m.gate_up_proj, ["mlp.gate", "mlp.up"]), (m.down_proj, ["mlp.down"])):
            want = torch.cat([weights[f"model.layers.{i}.{p}_proj.weight"] for p in parts])
            # the blocks, or where the few-row int8 kernel's form replaced them (the 4-bit gate/up), that form
            got = (lin.gguf.dequantize() if not lin.gguf.pieces[0][0].qs.is_meta else
                   ungrouped(lin.gguf_int8[0], want.shape[0]).dequantize())
            assert torch.equal(got.bfloat16(), want)
    # without AMX, with AVX512-VNNI: each layer linear whose int8 form passes the guard (a step per column, else per
    # 32-deep block; mixed parts too) takes it past 4 rows and drops its packed copy; the LM head keeps its exact
    # logits
    int8 = model.fast_lm_head.kernels.vnni_int8 is not None
    taken = 0
    for i, layer in enumerate(model.layers):
        for name, parts in (("self_attn.qkv_proj", "qkv"), ("self_attn.o_proj", ["o"]),
                            ("mlp.gate_up_proj", ["gate", "up"]), ("mlp.down_proj", ["down"])):
            lin, src = layer.get_submodule(name), name.split(".")[0]
            keys = [hf_to_gguf_name(f"model.layers.{i}.{src}.{p}_proj.weight") for p in parts]
            q = GGUFWeight.cat([GGUFWeight.from_blocks(raw[k][0], torch.from_numpy(raw[k][1])) for k in keys])
            passes = int8 and (pack_vnni_int8(q, VNNI_INT8_MAX_EXCESS) is not None
                               or pack_vnni_int8(q, VNNI_INT8_MAX_EXCESS, per_block=True) is not None)
            assert (lin.vnni_int8 is not None) == passes, (i, name)
            if passes:
                assert lin.amx_weight is None and lin.weight.is_meta
                assert lin.gguf.pieces[0][0].qs.is_meta == (lin.gguf_int8 != [] and all(lin.gguf_int8))
            taken += passes
    assert model.fast_lm_head.vnni_int8 is None
    assert taken > 0 or not int8
    prompts = [{"prompt_token_ids": [(11 * i + 5 * n) % 200 + 3 for i in range(n)]} for n in (1, 3)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    runs, decoder = [], model.decoder
    try:
        for fused in ((True, False) if decoder is not None else (False,)):
            model.decoder = decoder if fused else None
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs.append([(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs])
            assert pool_is_whole(llm)
    finally:
        model.decoder = decoder
    assert all(r == runs[0] for r in runs) and all(len(ids) == 6 for ids, _ in runs[0])


def test_bad_gguf_quantized_linears_names_the_field():
    from pagellm.config import EngineConfig

    with pytest.raises(ValueError, match="gguf_quantized_linears"):
        EngineConfig(gguf_quantized_linears="yes")
