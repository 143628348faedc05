"""Greedy fp32 output is token-identical to HF transformers, with all prompts in one batch.

On SmolLM2 from the GGUF and on tiny random checkpoints of every supported architecture; with block sizes
8/16/32, under forced preemption, and with prompts chunked by a small token budget.
"""
from __future__ import annotations

import random

import pytest
import torch
import transformers

from pagellm import LLM, SamplingParams
from tests.conftest import ARCHS, TEXT_PROMPTS, hf_greedy, pool_is_whole

MAX_NEW = 24


def run_engine(llm: LLM, prompts: list[list[int]], max_tokens: int):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return outs, [o.outputs[0].token_ids for o in outs]


# ---------------------------------------------------------------- SmolLM2 (GGUF)
@pytest.fixture(scope="module")
def smol(gguf_path):
    tok = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    prompts = [tok.encode(t) for t in TEXT_PROMPTS]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32,
        quantization_config=transformers.GgufConfig(dequantize=True)).eval()
    expected = hf_greedy(hf, prompts, MAX_NEW, eos=tok.eos_token_id)
    del hf
    return prompts, expected


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_smollm2_gguf_matches_hf(smol, gguf_path, block_size):
    prompts, expected = smol
    assert len({len(p) for p in prompts}) == len(prompts) >= 8
    llm = LLM(model=str(gguf_path), dtype="float32", block_size=block_size, kv_cache_memory="256MiB")
    _, got = run_engine(llm, prompts, MAX_NEW)
    assert got == expected
    assert pool_is_whole(llm)


@pytest.mark.parametrize("prefix_caching,num_blocks", [(False, 40), (True, 26)])
def test_smollm2_gguf_preemption_and_chunking_match_hf(smol, gguf_path, prefix_caching, num_blocks):
    prompts, expected = smol
    # The longest request alone needs ~22 blocks of 16 tokens, so the batch must preempt.
    llm = LLM(model=str(gguf_path), dtype="float32", block_size=16, kv_cache_memory=num_blocks * 737280,
              max_num_batched_tokens=64, enable_prefix_caching=prefix_caching)
    outs, got = run_engine(llm, prompts, MAX_NEW)
    assert got == expected
    assert llm.llm_engine.stats.num_preemptions > 0
    assert max(o.metrics["num_prefill_chunks"] for o in outs) > 1
    assert pool_is_whole(llm)


# ---------------------------------------------------------------- tiny random checkpoints
TINY_LENS = [3, 9, 17, 31, 64, 100, 150, 250]


@pytest.fixture(scope="module")
def tiny_expected(tiny_checkpoint):
    cache = {}

    def get(arch):
        if arch not in cache:
            path = tiny_checkpoint(arch)
            rng = random.Random(7)
            prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in TINY_LENS]
            hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            cache[arch] = (path, prompts, hf_greedy(hf, prompts, MAX_NEW, eos=2))
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_tiny_architectures_match_hf(tiny_expected, arch, block_size):
    path, prompts, expected = tiny_expected(arch)
    llm = LLM(model=str(path), dtype="float32", block_size=block_size, kv_cache_memory="64MiB")
    _, got = run_engine(llm, prompts, MAX_NEW)
    assert got == expected
    assert pool_is_whole(llm)


@pytest.mark.parametrize("arch,mode", [("llama", "recompute"), ("qwen3", "recompute"), ("llama", "swap"),
                                       ("qwen2", "swap")])
def test_tiny_preemption_matches_hf(tiny_expected, arch, mode):
    path, prompts, expected = tiny_expected(arch)
    llm = LLM(model=str(path), dtype="float32", block_size=16, max_num_seqs=8)
    per_block = llm.llm_engine.runner.kv_cache_bytes // llm.llm_engine.kv_manager.num_blocks
    llm = LLM(model=str(path), dtype="float32", block_size=16, kv_cache_memory=24 * per_block,
              preemption_mode=mode, swap_space=64 * per_block, max_num_batched_tokens=64)
    assert llm.llm_engine.kv_manager.num_blocks == 24
    _, got = run_engine(llm, prompts, MAX_NEW)
    assert got == expected
    stats = llm.llm_engine.stats
    assert stats.num_preemptions > 0
    assert (stats.num_swaps_out > 0) == (mode == "swap")
    assert pool_is_whole(llm)
    host = llm.llm_engine.kv_manager.host_pool
    assert host is None or host.num_free_blocks == host.num_blocks


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_chunked_prefill_matches_hf(tiny_expected, arch):
    path, prompts, expected = tiny_expected(arch)
    llm = LLM(model=str(path), dtype="float32", block_size=8, max_num_batched_tokens=40, kv_cache_memory="64MiB")
    outs, got = run_engine(llm, prompts, MAX_NEW)
    assert got == expected
    chunks = {len(o.prompt_token_ids): o.metrics["num_prefill_chunks"] for o in outs}
    assert chunks[250] >= 250 // 40
    assert pool_is_whole(llm)


def test_tiny_no_chunked_prefill_matches_hf(tiny_expected):
    path, prompts, expected = tiny_expected("mistral")
    llm = LLM(model=str(path), dtype="float32", enable_chunked_prefill=False, kv_cache_memory="64MiB")
    outs, got = run_engine(llm, prompts, MAX_NEW)
    assert got == expected
    assert all(o.metrics["num_prefill_chunks"] == 1 for o in outs)


def test_tiny_attention_aware_chunks_match_hf(tiny_expected):
    """A small budget with the attention-aware cost (the default) shrinks the chunks of the longer prompts as their
    context grows (the tiny model's A is 288 keys); the tokens stay HF's either way."""
    path, prompts, expected = tiny_expected("llama")
    chunks = {}
    for aware in (True, False):
        llm = LLM(model=str(path), dtype="float32", block_size=16, max_num_batched_tokens=64,
                  attention_aware_budget=aware)
        assert llm.llm_engine.scheduler.attention_keys_per_token == (288.0 if aware else None)
        outs, got = run_engine(llm, prompts, MAX_NEW)
        assert got == expected
        assert pool_is_whole(llm)
        chunks[aware] = outs[-1].metrics["num_prefill_chunks"]  # the 250-token prompt
        del llm  # before the next engine: on CUDA each one's KV cache takes 90% of the device by default
    assert chunks[True] > chunks[False]
