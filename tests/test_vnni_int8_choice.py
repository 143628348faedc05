"""Where the engine takes the int8 dot-product linear (csrc/vnni_int8_linear_cpu.cpp; its math and packing:
test_vnni_int8_linear.py) on CPUs with AVX512-VNNI but no AMX: CPULinear picks it for a GGUF weight past
GEMV_MAX_ROWS rows, with a step per output column where that is fine enough, else per 32-deep block, else keeps the
bf16 paths; drops the forms no kernel reads then; and the C++ layer loop runs it, agreeing with fp32 and taking the
same outlier channels in every engine of a model."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from pagellm.model_executor.layers.linear import (GEMV_MAX_ROWS, VNNI_INT8_MAX_EXCESS, VNNI_INT8_MAX_K, CPULinear,
                                                  cpu_kernels)
from pagellm.model_executor.layers.quantized import GGUFWeight, pack_vnni_int8
from pagellm.model_executor.layers.weight_forms import vnni_int8_form
from test_gguf_linear import random_blocks
from test_vnni_int8_linear import excess_by_hand, int8_math, needs_vnni, ops


class NoAmx:
    """torch.ops.pagellm as a CPU without AMX sees it."""

    def __getattr__(self, name):
        if name == "amx_linear_supported":
            return lambda: False
        return getattr(ops, name)


@needs_vnni
def test_cpus_without_amx_pick_it_unless_told_not_to():
    kernels = cpu_kernels(NoAmx(), torch.bfloat16)
    assert kernels is not None and kernels.fma is not None and kernels.vnni_int8 is not None
    assert cpu_kernels(NoAmx(), torch.bfloat16, int8_activations=False).vnni_int8 is None
    assert cpu_kernels(ops, torch.float32) is None
    if ops.amx_linear_supported():
        assert cpu_kernels(ops, torch.bfloat16).vnni_int8 is None  # AMX's bf16 tiles are faster


@needs_vnni
def test_cpu_linear_routes_past_gemv_rows_to_it():
    kernels = cpu_kernels(NoAmx(), torch.bfloat16)
    q = GGUFWeight.from_blocks("Q4_1", random_blocks("Q4_1", 96, 256, seed=2))
    w = q.dequantize().bfloat16()
    lin = CPULinear(w, None, kernels)
    assert lin.amx_weight is not None
    assert lin.set_gguf(q) and lin.vnni_int8 is not None
    # the int8 kernels take every row count: no packed copy, nor the bf16 weight and the blocks (their shapes kept)
    assert lin.amx_weight is None and lin.tiled is None
    assert lin.weight.is_meta and lin.weight.shape == (96, 256) and lin.gguf.qs.is_meta and lin.gguf.shape == (96, 256)
    for rows in (1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 64, 300):
        x = torch.randn(rows, 256).bfloat16()
        int8 = torch.empty(rows, 96, dtype=torch.bfloat16)
        ops.vnni_int8_linear(x, *lin.vnni_int8, None, int8, False)  # the channels chosen on the first call
        want = int8
        if rows <= GEMV_MAX_ROWS:  # the few-row kernel on the blocks, x in int8 (test_gguf_int8_linear)
            want = torch.empty(rows, 96, dtype=torch.bfloat16)
            ops.gguf_int8_linear(x, *lin.gguf_int8[0], None, want)
            assert not torch.equal(int8, want)  # the two paths differ, so the check below tells them apart
        assert torch.equal(lin(x), want), rows
        act = lin.silu_and_mul(x)
        if rows > GEMV_MAX_ROWS:
            want = torch.empty(rows, 48, dtype=torch.bfloat16)
            ops.vnni_int8_linear(x, *lin.vnni_int8, None, want, True)
            assert torch.equal(act, want)
        else:
            assert act is None  # forward's GGUF kernel, then silu_and_mul
        # any other x goes as bf16 rows: leading dimensions, a stride, another dtype, no rows
        x3 = torch.randn(rows, 2, 512).bfloat16()
        want = lin(x3[..., ::2].reshape(2 * rows, 256).contiguous()).view(rows, 2, 96)
        assert torch.equal(lin(x3[..., ::2]), want)
        assert torch.equal(lin(x3[..., ::2].float()), want.float())
    assert lin(torch.randn(0, 256).bfloat16()).shape == (0, 96) and lin(torch.randn(2, 0, 256)).shape == (2, 0, 96)
    off = CPULinear(w, None, dataclasses.replace(kernels, vnni_int8=None))
    assert off.set_gguf(q) and off.vnni_int8 is None and off.amx_weight is not None
    # without the int8 form the packed copy serves past 4 rows: the plain weight goes all the same, and the blocks
    # where the few-row kernel has its regrouped form
    assert off.weight.is_meta and off.gguf.qs.is_meta == (off.gguf_int8 != [] and all(off.gguf_int8))
    # the blocks handed over at construction (the model's way): the same forms, and no packed copy made at all
    built = CPULinear(w, None, kernels, q)
    assert built.amx_weight is None and built.weight.is_meta and built.gguf.qs.is_meta
    x = torch.randn(64, 256).bfloat16()
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # (bytes: the int8 form's offsets are int32 bits)
               for a, b in zip(built.vnni_int8[:2] + built.gguf_int8[0][:2], lin.vnni_int8[:2] + lin.gguf_int8[0][:2]))
    for i in (2, 3):  # the outlier channels lin's first call chose, and the weight's values there
        built.vnni_int8[i].copy_(lin.vnni_int8[i])
    assert torch.equal(built(x), lin(x))
    kept = CPULinear(w, None, dataclasses.replace(kernels, vnni_int8=None), q)
    assert kept.amx_weight is not None and torch.equal(kept(x), off(x))
    # a weight the model left to its blocks (load_weights' defer): made from them only where a bf16 path reads it
    meta = torch.empty(96, 256, dtype=torch.bfloat16, device="meta")
    made = CPULinear(meta, None, dataclasses.replace(kernels, vnni_int8=None), q)
    assert torch.equal(made.amx_weight, off.amx_weight) and torch.equal(made(x), off(x)) and made.weight.is_meta
    assert CPULinear(meta, None, kernels, q).weight.is_meta
    with pytest.raises(ValueError, match=r"a \(96, 256\) linear weight left to GGUF blocks, but none were given"):
        CPULinear(meta, None, kernels)


@needs_vnni
@pytest.mark.parametrize("kind", ["Q6_K", "Q5_0", "Q8_0", "parts"])
def test_a_weight_of_5_to_8_bits_takes_it_past_the_few_rows(kind):
    # 5- to 8-bit weights, and a fused weight with such a part, take the int8 form past GEMV_MAX_ROWS as 4-bit ones
    # do (where the guard lets them), and their blocks up to it: the exact kernel, or for a 4-bit part its own;
    # neither the plain weight nor the packed copy stays, the blocks do. The LM head (int8_form=False) keeps its
    # exact logits.
    kernels = cpu_kernels(NoAmx(), torch.bfloat16)
    if kind == "parts":
        q = GGUFWeight.cat([GGUFWeight.from_blocks("Q4_1", random_blocks("Q4_1", 64, 256, seed=1)),
                            GGUFWeight.from_blocks("Q6_K", random_blocks("Q6_K", 32, 256, seed=2))])
    elif kind == "Q8_0":  # as llama.cpp writes it (random quants need not reach +-127 in a block)
        w = torch.randn(96, 256, generator=torch.Generator().manual_seed(2)) * 0.05
        raw = gguf_quants.quantize(w.numpy(), GGMLQuantizationType.Q8_0)
        q = GGUFWeight.from_blocks("Q8_0", torch.from_numpy(raw.view("uint8").reshape(96, -1)))
    else:
        q = GGUFWeight.from_blocks(kind, random_blocks(kind, 96, 256, seed=2))
    # Q8_0: a step per column is far too coarse, one per 32-deep block is not
    per_block = kind == "Q8_0"
    assert (pack_vnni_int8(q)[2] < VNNI_INT8_MAX_EXCESS) != per_block
    assert pack_vnni_int8(q, per_block=True)[2] < VNNI_INT8_MAX_EXCESS
    w = q.dequantize().bfloat16()
    lin = CPULinear(w, None, kernels, q)
    assert lin.vnni_int8 is not None and lin.amx_weight is None and lin.weight.is_meta
    assert lin.vnni_int8[1].dim() == (4 if per_block else 3)
    assert not any(piece.qs.is_meta for piece, _ in lin.gguf.pieces)  # a piece without a few-row int8 form
    assert [f is not None for f in lin.gguf_int8] == [p.kind == "q4_1" for p, _ in q.pieces]
    for rows in (1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 64):
        x = torch.randn(rows, 256).bfloat16()
        want = torch.empty(rows, 96, dtype=torch.bfloat16)
        if rows > GEMV_MAX_ROWS:
            ops.vnni_int8_linear(x, *lin.vnni_int8, None, want, False)
        else:
            for (piece, col), form in zip(q.pieces, lin.gguf_int8):
                part = want[:, col:col + piece.shape[0]]
                if form is not None:
                    ops.gguf_int8_linear(x, *form, None, part)
                else:
                    ops.gguf_linear(x, piece.qs, piece.scales, None, part)
        assert torch.equal(lin(x), want), rows
    head = CPULinear(w, None, kernels)
    assert head.set_gguf(q, int8_form=False) and head.vnni_int8 is None and head.amx_weight is not None

@needs_vnni
def test_a_weight_deeper_than_the_int32_sums_allow_takes_a_step_per_block():
    # past VNNI_INT8_MAX_K the int32 sums of a step per column could overflow (the kernel refuses that form:
    # test_vnni_int8_linear.py): CPULinear takes a step per 32-deep block, whose sums run 32 deep
    deep = GGUFWeight.from_blocks("Q4_1", random_blocks("Q4_1", 16, VNNI_INT8_MAX_K + 32))
    lin = CPULinear(deep.dequantize().bfloat16(), None, cpu_kernels(NoAmx(), torch.bfloat16))
    assert lin.set_gguf(deep) and lin.vnni_int8 is not None and lin.vnni_int8[1].dim() == 4
    xd = torch.randn(8, VNNI_INT8_MAX_K + 32).bfloat16()
    got = lin(xd)
    want, size = int8_math(xd, deep, per_block=True, channels=lin.vnni_int8[2])  # (the channels that call chose)
    assert ((got.double() - want).abs() <= 2**-8 * want.abs() + 2**-18 * size).all()


@needs_vnni
def test_a_column_made_coarse_takes_a_step_per_block_or_the_bf16_paths():
    # The int8 form's step is a column's max|w| / 127: a block of large values (here constant: d = 0, m = 40, where
    # the others' d are at most 0.028) coarsens the whole column past its 4-bit steps. pack_vnni_int8 measures that
    # (its excess as computed by hand), and CPULinear takes a step per 32-deep block for such a weight, where the
    # block's own values set it (a constant block: exact). A block whose values sit far from zero against their
    # spread (d = 0.01, m = 40) is coarse even so: that weight keeps the dot-product kernel's bf16 path.
    kernels = cpu_kernels(NoAmx(), torch.bfloat16)
    raw = random_blocks("Q4_1", 96, 256, seed=5)
    fine = GGUFWeight.from_blocks("Q4_1", raw)
    weights = [fine]
    for d in (0.0, 0.01):
        bad = raw.clone()
        bad.view(96, 8, 20)[5, 3, :4] = torch.tensor([d, 40.0]).half().view(torch.uint8)
        weights.append(GGUFWeight.from_blocks("Q4_1", bad))
    fine, coarse, offset = weights
    excess = [pack_vnni_int8(q)[2] for q in weights]
    assert excess == [pytest.approx(excess_by_hand(q), rel=1e-4) for q in weights]
    assert excess[0] < 0.2 < VNNI_INT8_MAX_EXCESS < 10 < min(excess[1:])
    by_block = [pack_vnni_int8(q, per_block=True)[2] for q in weights]
    assert by_block == [pytest.approx(excess_by_hand(q, per_block=True), rel=1e-4, abs=1e-9) for q in weights]
    assert by_block[1] < VNNI_INT8_MAX_EXCESS < 10 < by_block[2]
    assert vnni_int8_form(coarse, max_excess=VNNI_INT8_MAX_EXCESS) is None and vnni_int8_form(coarse) is not None
    x = torch.randn(64, 256).bfloat16()
    for q, form in ((fine, 3), (coarse, 4), (offset, None)):  # the int8 form's scales: a step per column / block
        w = q.dequantize().bfloat16()
        lin, bf16 = CPULinear(w, None, kernels), CPULinear(w, None, dataclasses.replace(kernels, vnni_int8=None))
        assert lin.set_gguf(q) and bf16.set_gguf(q)
        assert (None if lin.vnni_int8 is None else lin.vnni_int8[1].dim()) == form
        assert torch.equal(lin(x), bf16(x)) == (form is None)


def int8_engine(gguf_path, per_block: bool = False, **kw):
    """The default model's bf16 engine with every layer linear on the int8 path, as a CPU without AMX builds it
    (here also on AMX machines, whose attention and LM head stay theirs): each 4-bit linear handed its int8 form,
    the C++ decoder rebuilt on them, and the engine's calibration run (LLMEngine.choose_int8_outliers). per_block:
    the forms with a step per 32-deep block (built by an engine without int8 forms of its own, so its blocks stay
    to make them from)."""
    from pagellm import LLM

    if per_block:
        kw["gguf_int8_activations"] = False
    llm = LLM(model=str(gguf_path), dtype="bfloat16", kv_cache_memory="64MiB", **kw)
    model = llm.llm_engine.model
    if model.decoder is None:
        pytest.skip("no C++ decoder here")
    swapped = {}
    for m in model.layers.modules():
        if isinstance(m, CPULinear) and m.gguf is not None:
            if m.vnni_int8 is None:  # else the engine made it (and dropped the blocks: CPULinear.set_gguf)
                m.amx_q4, m.vnni_int8 = None, vnni_int8_form(m.gguf, per_block=per_block)
            m.kernels = swapped.setdefault(id(m.kernels),
                                           dataclasses.replace(m.kernels, vnni_int8=ops.vnni_int8_linear.default))
    assert swapped
    model.decoder, model._bound_caches = model._build_decoder(next(iter(swapped.values()))), None
    llm.llm_engine.choose_int8_outliers()
    return llm


@needs_vnni
@pytest.mark.parametrize("per_block", [False, True])
def test_the_cpp_loop_takes_it_and_agrees_with_fp32(gguf_path, fp32_reference, per_block):
    # The C++ layer loop runs vnni_int8_linear for prefill and for decode steps of more than 4 rows, and the pool ends
    # whole. Teacher-forced top-1 agreement with fp32: the measure (`pagellm bench agreement`, workload_16,
    # 2,048 positions) gave 99.02% on Zen 4, 2026-12-06 (99.07% with a step per 32-deep block of the weight,
    # 99.46-99.56% with the 4-bit weight as it is and x rounded per 32-deep block), against 99.71% on the bf16
    # weights; workload_64 (8,192 positions) 98.54% (98.73% with a step per block). The tests' text prompts are 192
    # positions, one of them 0.52%: 95.3% here (96.9% with a step per block; x per block: 96.4-97.9% over 4-32
    # outlier channels, 95.8% with none), and bf16 paths 97.4% (bf16 x on the same weights in the Python loop) to
    # 99.0% (AMX). A broken kernel falls far below.
    from torch.profiler import ProfilerActivity, profile

    from conftest import pool_is_whole, teacher_forced_agreement
    from pagellm import SamplingParams

    llm = int8_engine(gguf_path, per_block)
    prompts = [{"prompt_token_ids": [(13 * i + 7 * j) % 6000 + 200 for j in range(8 + i % 9)]} for i in range(12)]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    names = {e.name for e in prof.events()}
    assert "pagellm::vnni_int8_linear" in names and "pagellm::vnni_int8_linear_silu_mul" in names
    assert "pagellm::amx_q4_linear" not in names
    assert all(m.vnni_int8[1].dim() == (4 if per_block else 3) for m in llm.llm_engine.model.layers.modules()
               if isinstance(m, CPULinear))
    assert pool_is_whole(llm)
    assert teacher_forced_agreement(llm, fp32_reference) >= 0.94


@needs_vnni
def test_every_engine_takes_the_calibrated_channels(gguf_path):
    # The engine makes each weight's first call on a fixed prompt: two engines then hold the same channels, and a
    # prompt prefilled in chunks of 64 gets the tokens and logprobs of one prefilled whole (x is quantized row by
    # row). Without the calibration each engine's first call chose: 18 of the 120 weights' channels agreed, and the
    # logprobs did not. The calibration leaves the pool whole.
    from conftest import pool_is_whole
    from pagellm import SamplingParams

    prompt = {"prompt_token_ids": [(i * 37) % 4000 + 100 for i in range(300)]}
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    outs, chans = [], []
    for budget in (64, 2048):
        llm = int8_engine(gguf_path, max_num_batched_tokens=budget)
        chans.append([m.vnni_int8[2].clone() for m in llm.llm_engine.model.layers.modules()
                      if isinstance(m, CPULinear) and m.vnni_int8 is not None])
        assert pool_is_whole(llm)
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        outs.append((out.token_ids, [sorted((t, lp.logprob) for t, lp in d.items()) for d in out.logprobs]))
        assert pool_is_whole(llm)
    assert len(chans[0]) == 120 and all((c >= 0).all() for c in chans[0])
    assert all(torch.equal(a, b) for a, b in zip(*chans))
    assert len(outs[0][0]) == 8 and outs[0] == outs[1]


def test_bad_gguf_int8_activations_names_the_field():
    from pagellm.config import EngineConfig

    with pytest.raises(ValueError, match="gguf_int8_activations"):
        EngineConfig(gguf_int8_activations="yes")
