"""Automatic prefix caching: identical greedy output with caching on and off, real reuse, salts, invariants."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagellm import LLM, SamplingParams
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.scheduler import Scheduler
from pagellm.engine.request import Request, RequestStatus
from tests.conftest import pool_is_whole

BS = 8
SHARED_BLOCKS = [0, 1, 15, 16, 17, 100]


def _prompts(seed: int = 0) -> list[list[int]]:
    """For each shared length k (in blocks): two prompts with the same k*BS-token prefix (plus a partial block for
    some) and different tails."""
    rng = random.Random(seed)
    out = []
    for k in SHARED_BLOCKS:
        prefix = [rng.randrange(3, 512) for _ in range(k * BS + (3 if k % 2 else 0))]
        for _ in range(2):
            out.append(prefix + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 12))])
    return out


def _run(llm: LLM, prompts, max_tokens=12):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], outs


@pytest.fixture(scope="module")
def tiny_path(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def reference(tiny_path):
    llm = LLM(model=tiny_path, dtype="float32", block_size=BS, kv_cache_memory="64MiB", enable_prefix_caching=False)
    prompts = _prompts()
    # one at a time: no batch effects at all in the reference
    return prompts, [_run(llm, [p])[0][0] for p in prompts]


@pytest.mark.parametrize("budget", [None, 40])
def test_caching_on_matches_off(tiny_path, reference, budget):
    prompts, expected = reference
    llm = LLM(model=tiny_path, dtype="float32", block_size=BS, kv_cache_memory="64MiB",
              max_num_batched_tokens=budget)
    # One prompt at a time: the second prompt of each pair finds the first one's blocks.
    got = []
    for i in range(0, len(prompts), 2):
        got += [_run(llm, [p])[0][0] for p in prompts[i:i + 2]]
    assert got == expected
    kv = llm.llm_engine.kv_manager
    # every second prompt re-finds its partner's full prefix blocks (the 0-block pair shares nothing)
    assert kv.prefix_hits >= sum(k * BS for k in SHARED_BLOCKS)
    assert pool_is_whole(llm)
    # The same prompts again, all in one batch: now served from the cache, still identical.
    hits_before = kv.prefix_hits
    again, outs = _run(llm, prompts)
    assert again == expected
    assert kv.prefix_hits > hits_before
    assert max(o.metrics["num_cached_tokens"] for o in outs) >= 100 * BS


@pytest.mark.parametrize("budget,mode", [(64, "recompute"), (256, "recompute"), (64, "swap"), (256, "swap")])
def test_caching_under_preemption(tiny_path, reference, budget, mode):
    prompts, expected = reference
    per_block = 2 * 2 * BS * 2 * 16 * 4  # layers * (K,V) * block * kv_heads * head_dim * fp32
    # 104 blocks: just enough for the longest request (826 tokens) alone, so the batch must preempt.
    llm = LLM(model=tiny_path, dtype="float32", block_size=BS, kv_cache_memory=104 * per_block,
              max_num_batched_tokens=budget, preemption_mode=mode, swap_space=400 * per_block)
    assert llm.llm_engine.kv_manager.num_blocks == 104
    got, _ = _run(llm, prompts)
    assert got == expected
    stats, kv = llm.llm_engine.stats, llm.llm_engine.kv_manager
    assert stats.num_preemptions > 0
    if mode == "recompute":
        assert kv.prefix_hits > 0  # preempted requests re-find their own blocks
    else:
        assert stats.num_swaps_out > 0 and kv.host_pool.num_free_blocks == kv.host_pool.num_blocks
    assert pool_is_whole(llm)


def test_cache_salt_prevents_sharing(tiny_path):
    llm = LLM(model=tiny_path, dtype="float32", block_size=BS, kv_cache_memory="16MiB")
    prompt = list(range(10, 10 + 5 * BS + 3))
    params = SamplingParams(temperature=0, max_tokens=4)
    kv = llm.llm_engine.kv_manager
    a = llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}, params, use_tqdm=False)
    assert kv.prefix_hits == 0
    b = llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-b"}, params, use_tqdm=False)
    assert kv.prefix_hits == 0
    c = llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}, params, use_tqdm=False)
    assert kv.prefix_hits == 5 * BS
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids == c[0].outputs[0].token_ids


# ---------------------------------------------------------------- invariants with hashed blocks and eviction
def _check(sched: Scheduler, live: list[Request]) -> None:
    pool = sched.kv.pool
    refs: dict[int, int] = {}
    for r in live:
        for b in r.blocks:
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
    free_ids = {b.block_id for b in pool.free_queue}
    for b in pool.blocks:
        assert b.ref_cnt == refs.get(b.block_id, 0) >= 0
        assert (b.ref_cnt == 0) == (b.block_id in free_ids)
    for h, b in pool.cached.items():
        assert b.block_hash == h
    host = sched.kv.host_pool
    if host is not None:  # host blocks: owned by exactly the swapped requests
        owned = [b.block_id for r in live for b in r.host_blocks]
        assert len(owned) == len(set(owned)) == host.num_used_blocks
        assert all((r.status == RequestStatus.SWAPPED) == bool(r.host_blocks) for r in live)
        assert all(not r.blocks for r in live if r.status == RequestStatus.SWAPPED)
    for r in live:
        # the leading blocks of a request hold exactly its tokens' chained hashes where registered
        for i in range(r.num_cached_blocks):
            if r.blocks[i].block_hash is not None and pool.cached.get(r.blocks[i].block_hash) is r.blocks[i]:
                assert r.blocks[i].block_hash == r.block_hashes[i]


def _step(sched: Scheduler, live: list[Request]) -> int:
    """One schedule plus what the engine does after sampling; returns how many requests were scheduled."""
    out = sched.schedule()
    for s in out.scheduled:
        if s.samples:
            s.request.output_token_ids.append(7)
            if s.request.num_output_tokens >= s.request.max_tokens:
                sched.finish_request(s.request, RequestStatus.FINISHED_LENGTH)
                live.remove(s.request)
    return len(out.scheduled)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), num_blocks=st.integers(6, 30), block_size=st.sampled_from([2, 4, 8]),
       budget=st.integers(1, 64), host_blocks=st.sampled_from([0, 0, 4, 40]),
       keys=st.sampled_from([None, 4.0, 64.0]))
def test_random_interleavings_never_leak(data, num_blocks, block_size, budget, host_blocks, keys):
    """Prefix caching (hashed blocks, eviction) with recompute or swap preemption (host pool of 4 or 40), with a
    token-only or an attention-aware budget (cached prefixes count as context)."""
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True, num_host_blocks=host_blocks)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=budget, attention_keys_per_token=keys)
    prefixes = [[1] * 40, [2] * 40, list(range(3, 43))]
    live: list[Request] = []
    for step in range(data.draw(st.integers(5, 40))):
        action = data.draw(st.sampled_from(["add", "add", "step", "step", "step", "abort"]))
        if action == "add":
            pre = data.draw(st.sampled_from(prefixes))[:data.draw(st.integers(1, 40))]
            prompt = pre + data.draw(st.lists(st.integers(50, 60), max_size=5))
            mt = data.draw(st.integers(1, 8))
            if kv.blocks_needed(len(prompt) + mt) > num_blocks:
                continue
            req = Request(str(step), None, prompt, SamplingParams(max_tokens=mt), mt,
                          cache_salt=data.draw(st.sampled_from([None, None, "s"])))
            sched.add_request(req)
            live.append(req)
        elif action == "abort" and live:
            req = data.draw(st.sampled_from(live))
            sched.finish_request(req, RequestStatus.FINISHED_ABORTED)
            live.remove(req)
        else:
            _step(sched, live)
        _check(sched, live)
    while live:  # drain: everything finishes, nothing deadlocks
        assert _step(sched, live)
        _check(sched, live)
    pool = kv.pool
    assert pool.num_free_blocks == num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)
    if kv.host_pool is not None:
        assert kv.host_pool.num_free_blocks == host_blocks
        assert all(b.ref_cnt == 0 for b in kv.host_pool.blocks)
