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


def test_seeds_at_the_ends_of_the_range_wrap(tiny):
    """Choice i is seeded seed + i, wrapped into a generator's seeds: 2**64 - 1 then 0 (it once overflowed for
    choice 1, leaving choice 0 queued without its request, which broke the next generate)."""
    llm = LLM(model=tiny, dtype="float32", kv_cache_memory="32MiB")
    prompt = {"prompt_token_ids": list(range(20, 50))}

    def one(seed, n=1):
        params = SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True)
        return [c.token_ids for c in llm.generate(prompt, params, use_tqdm=False)[0].outputs]

    top = one(2**64 - 1, n=2)
    assert top == one(-1) + one(0)  # a generator reads -1 as 2**64 - 1
    assert one(-2**63, n=2) == one(2**63) + one(2**63 + 1)
    assert pool_is_whole(llm) and not llm.llm_engine.parents and not llm.llm_engine.parent_of


def test_a_choices_id_is_not_free_for_another_request(tiny):
    llm = LLM(model=tiny, dtype="float32", kv_cache_memory="32MiB")
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    engine.add_request(prompt_token_ids=list(range(20, 40)), sampling_params=params, request_id="a#0")
    with pytest.raises(ValueError, match="'a#0' is already a request's id"):
        engine.add_request(prompt_token_ids=list(range(50, 60)), sampling_params=SamplingParams(n=2, max_tokens=5),
                           request_id="a")
    engine.add_request(prompt_token_ids=list(range(50, 60)), sampling_params=SamplingParams(n=2, max_tokens=5),
                       request_id="b")
    with pytest.raises(ValueError, match="'b#1' is already"):
        engine.add_request(prompt_token_ids=[5, 6], sampling_params=params, request_id="b#1")
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(finished) == ["a#0", "b"] and len(finished["b"].outputs) == 2
    assert len(finished["a#0"].outputs[0].token_ids) == 5
    assert pool_is_whole(llm) and not engine.parents and not engine.parent_of


def test_aborting_a_choice_aborts_its_request(tiny):
    llm = LLM(model=tiny, dtype="float32", kv_cache_memory="32MiB")
    engine = llm.llm_engine
    engine.add_request(prompt_token_ids=list(range(20, 120)), request_id="p",
                       sampling_params=SamplingParams(n=3, temperature=1.0, max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.abort_request("p#1")
    assert not engine.has_unfinished_requests() and not engine.abort_request("p")
    assert pool_is_whole(llm) and not engine.parents and not engine.parent_of and not engine.requests


def test_a_finished_choices_id_stays_taken_until_its_request_ends(tiny):
    llm = LLM(model=tiny, dtype="float32", kv_cache_memory="32MiB")
    engine = llm.llm_engine
    # half the vocabulary stops a choice: seeded, choice 0 stops first (after 1 token), choice 1 runs on
    params = SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=40, stop_token_ids=list(range(256)))
    engine.add_request(prompt_token_ids=list(range(300, 340)), sampling_params=params, request_id="p")
    while "p#0" in engine.requests:
        assert not engine.step()
    assert "p#1" in engine.requests and "p" in engine.parents
    with pytest.raises(ValueError, match="'p#0' is already"):
        engine.add_request(prompt_token_ids=[5, 6], sampling_params=SamplingParams(max_tokens=2), request_id="p#0")
    assert engine.abort_request("p#0")  # the request, by its finished choice's id: its other choice stops too
    assert not engine.has_unfinished_requests()
    assert pool_is_whole(llm) and not engine.parents and not engine.parent_of and not engine.requests
