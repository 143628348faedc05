"""n > 1 and best_of: samples share the prompt's blocks and its computation (the first sample computes the prompt,
the others follow it: Scheduler's followers); best_of keeps the most likely samples."""
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


@pytest.mark.parametrize("caching", [True, False])
def test_n_samples_are_reproducible_and_match_single_seeded_requests(tiny, caching):
    llm = LLM(model=tiny, dtype="float32", kv_cache_memory="32MiB", enable_prefix_caching=caching)
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



def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _drain(engine) -> dict[str, list[list[int]]]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
    return done


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("prompt_len", [47, 48, 49])  # the shared tokens end inside a block, or at its end
def test_samples_compute_the_prompt_once(tiny, caching, prompt_len):
    """Greedy samples are the greedy run; the prompt is computed once, plus its last token per further sample, and
    the samples hold one copy of the prompt's full blocks, with or without prefix caching."""
    llm = LLM(model=tiny, dtype="float32", block_size=16, kv_cache_memory="32MiB", enable_prefix_caching=caching)
    engine = llm.llm_engine
    prompt = [(i * 31 + 7) % 400 + 3 for i in range(prompt_len)]
    rid = engine.add_request(prompt_token_ids=prompt, sampling_params=_greedy(20, n=4))
    samples = _drain(engine)[rid]
    assert engine.stats.prompt_tokens_computed == prompt_len + 3
    full, partial = divmod(prompt_len - 1, 16)  # the blocks the samples share: the followers copy a partial one
    assert engine.kv_manager.num_copies == (3 if partial else 0)
    # each sample's own blocks hold its K/V past the shared blocks (prompt + 19 tokens at its end)
    assert engine.kv_manager.pool.peak_used == full + 4 * -(-(prompt_len + 19 - 16 * full) // 16)
    assert pool_is_whole(llm) and not engine.scheduler.followers
    single = llm.generate({"prompt_token_ids": prompt}, _greedy(20), use_tqdm=False)[0].outputs[0].token_ids
    assert samples == [single] * 4


def test_samples_follow_a_first_one_that_stops_at_once(tiny):
    """Choice 0 ends with its first token (its blocks are freed in that step): the others still take its prompt."""
    llm = LLM(model=tiny, dtype="float32", kv_cache_memory="32MiB", enable_prefix_caching=False)
    engine = llm.llm_engine
    prompt = {"prompt_token_ids": list(range(300, 340))}
    params = SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=12, stop_token_ids=list(range(256)))
    singles = [llm.generate(prompt, SamplingParams(temperature=1.0, seed=i, max_tokens=12,
                                                   stop_token_ids=list(range(256))), use_tqdm=False)[0]
               for i in range(3)]
    singles = [o.outputs[0].token_ids for o in singles]
    assert len(singles[0]) == 1 and len(singles[1]) > 1  # (seeded: choice 0 stops after 1 token)
    engine.reset_stats()
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == singles
    assert engine.stats.prompt_tokens_computed == 40 + 2
    assert pool_is_whole(llm)


def test_share_prompt_with(tiny):
    """The engine's hint: a follower takes its lead's prompt K/V (added while the lead prefills, or after it has
    sampled), takes what an aborted lead computed, and runs on its own where the hint does not apply."""
    llm = LLM(model=tiny, dtype="float32", block_size=16, kv_cache_memory="32MiB", enable_prefix_caching=False,
              max_num_batched_tokens=64, enable_chunked_prefill=True)
    engine = llm.llm_engine
    prompt = [(i * 13 + 5) % 300 + 3 for i in range(150)]
    single = llm.generate({"prompt_token_ids": prompt}, _greedy(8), use_tqdm=False)[0].outputs[0].token_ids

    def run(steps_between=0, abort_lead_after=None) -> int:
        """A lead and its follower; the prompt tokens computed."""
        before = engine.stats.prompt_tokens_computed
        lead = engine.add_request(prompt_token_ids=prompt, sampling_params=_greedy(8))
        for _ in range(steps_between):
            engine.step()
        follower = engine.add_request(prompt_token_ids=prompt, sampling_params=_greedy(8), share_prompt_with=lead)
        for _ in range(abort_lead_after or 0):
            engine.step()
        if abort_lead_after is not None:
            assert 0 < engine.requests[lead].num_computed_tokens < 150  # (k, 150 - k above)
            assert engine.abort_request(lead)
        done = _drain(engine)
        assert done[follower] == [single] and (abort_lead_after is not None or done[lead] == [single])
        assert pool_is_whole(llm) and not engine.scheduler.followers
        return engine.stats.prompt_tokens_computed - before

    assert run() == 150 + 1
    assert run(steps_between=4) == 150 + 1  # the lead has sampled: the follower forks at once
    # the lead is aborted after its first chunk (of k tokens): the follower takes those and computes the others
    assert run(abort_lead_after=1) == 150
    # a waiting follower aborted: the lead runs on
    before = engine.stats.prompt_tokens_computed
    lead = engine.add_request(prompt_token_ids=prompt, sampling_params=_greedy(8))
    follower = engine.add_request(prompt_token_ids=prompt, sampling_params=_greedy(8), share_prompt_with=lead)
    engine.step()
    assert engine.abort_request(follower) and not engine.scheduler.followers
    assert _drain(engine) == {lead: [single]} and engine.stats.prompt_tokens_computed - before == 150
    # where the hint does not apply: another prompt, another cache salt, prompt logprobs, an unknown lead
    before = engine.stats.prompt_tokens_computed
    lead = engine.add_request(prompt_token_ids=prompt, sampling_params=_greedy(8))
    other = engine.add_request(prompt_token_ids=prompt[:-1] + [9], sampling_params=_greedy(8),
                               share_prompt_with=lead)
    kw = dict(prompt_token_ids=prompt, share_prompt_with=lead)
    alone = [engine.add_request(sampling_params=_greedy(8), cache_salt="x", **kw),
             engine.add_request(sampling_params=_greedy(8, prompt_logprobs=0), **kw),
             engine.add_request(prompt_token_ids=prompt, sampling_params=_greedy(8), share_prompt_with="nobody")]
    assert not engine.scheduler.followers
    done = _drain(engine)
    assert all(done[r] == [single] for r in [lead, *alone]) and len(done[other][0]) == 8
    assert engine.stats.prompt_tokens_computed - before == 5 * 150
    # nor does a request's own id (or, with n > 1, its first choice's): it would wait for itself
    engine.add_request(prompt_token_ids=prompt, sampling_params=_greedy(8), request_id="me", share_prompt_with="me")
    engine.add_request(prompt_token_ids=prompt, sampling_params=_greedy(8, n=2), request_id="us",
                       share_prompt_with="us#0")
    assert _drain(engine) == {"me": [single], "us": [single] * 2}
    assert pool_is_whole(llm)


@pytest.mark.parametrize("caching", [True, False])
def test_samples_in_a_small_pool(tiny, caching):
    """Many n > 1 requests in a pool that holds a few of them: followers wait, fork, are preempted, and give blocks
    back, yet every greedy sample is the greedy run of its prompt, and the pool ends whole."""
    roomy = LLM(model=tiny, dtype="float32", block_size=16, kv_cache_memory="16MiB")
    small = LLM(model=tiny, dtype="float32", block_size=16, kv_cache_memory=10 * 16 * 512, max_model_len=128,
                enable_prefix_caching=caching)  # 10 blocks (512 bytes a token's K and V)
    assert small.llm_engine.kv_manager.num_blocks == 10
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(rng.randrange(10, 60))]} for _ in range(6)]
    singles = [o.outputs[0].token_ids for o in roomy.generate(prompts, _greedy(12), use_tqdm=False)]
    outs = small.generate(prompts, _greedy(12, n=3), use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[s] * 3 for s in singles]
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert pool_is_whole(small) and not small.llm_engine.scheduler.followers
