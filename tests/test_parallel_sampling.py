"""n > 1 and best_of: samples share the prompt's blocks; best_of keeps the most likely samples."""
from __future__ import annotations

import random

import pytest

from pagellm import LLM, SamplingParams
from tests.conftest import pool_is_whole


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


def _peak_blocks(path, n, prompt, max_tokens=16):
    llm = LLM(model=path, dtype="float32", block_size=16, kv_cache_memory="64MiB")
    params = SamplingParams(n=n, temperature=1.0, seed=3, max_tokens=max_tokens, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert pool_is_whole(llm)
    return llm.llm_engine.kv_manager.pool.peak_used, out


def test_n8_of_a_long_prompt_shares_its_blocks(tiny):
    rng = random.Random(0)
    prompt = [rng.randrange(3, 512) for _ in range(1000)]
    one, out1 = _peak_blocks(tiny, 1, prompt)
    eight, out8 = _peak_blocks(tiny, 8, prompt)
    assert len(out1.outputs) == 1 and len(out8.outputs) == 8
    assert [c.index for c in out8.outputs] == list(range(8))
    assert all(len(c.token_ids) == 16 for c in out8.outputs)
    assert len({tuple(c.token_ids) for c in out8.outputs}) > 1  # different samples
    assert eight < 1.5 * one, (one, eight)


def test_n_samples_are_reproducible_and_match_single_seeded_requests(tiny):
    llm = LLM(model=tiny, dtype="float32", kv_cache_memory="32MiB")
    prompt = {"prompt_token_ids": list(range(20, 60))}
    out = llm.generate(prompt, SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=10), use_tqdm=False)[0]
    singles = [llm.generate(prompt, SamplingParams(temperature=0.9, seed=11 + i, max_tokens=10),
                            use_tqdm=False)[0].outputs[0].token_ids for i in range(3)]
    assert [c.token_ids for c in out.outputs] == singles


def test_best_of_keeps_the_most_likely_samples(tiny):
    llm = LLM(model=tiny, dtype="float32", kv_cache_memory="32MiB")
    prompt = {"prompt_token_ids": list(range(100, 130))}
    all4 = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=8, logprobs=0),
                        use_tqdm=False)[0].outputs
    ranked = sorted(all4, key=lambda c: c.cumulative_logprob, reverse=True)
    best = llm.generate(prompt, SamplingParams(n=2, best_of=4, temperature=1.0, seed=5, max_tokens=8),
                        use_tqdm=False)[0].outputs
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked[:2]]
    assert all(c.logprobs is None for c in best)  # not asked for
