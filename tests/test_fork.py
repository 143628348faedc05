"""Forks (LLMEngine.fork_request): a request that continues a finished ``keep_kv`` request shares its blocks, the
partial last one copied on write, and computes only its new tokens.

* On a tiny random-weight model in fp32: forks generate what a fresh request with the same tokens generates,
  two forks of one parent writing into its partial block included; the pool is whole after release.
* A property test of the scheduler and KV cache manager alone with forks, followers (a request that takes the
  prompt K/V of another with the same prompt: parallel sampling), prefix caching and both preemption modes: a model
  of the cache's contents (what each block slot holds, copies and swaps applied as the runner applies them) must
  hold every request's computed tokens at their positions after every step.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagellm import LLM, SamplingParams
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.scheduler import Scheduler, SchedulerOutput
from pagellm.engine.request import Request, RequestStatus
from tests.conftest import pool_is_whole

BS = 8


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=str(tiny_checkpoint("llama")), dtype="float32", block_size=BS, kv_cache_memory="16MiB")


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _fresh(llm: LLM, prompt: list[int], max_tokens: int) -> list[int]:
    out = llm.generate({"prompt_token_ids": prompt}, _greedy(max_tokens), use_tqdm=False)
    return out[0].outputs[0].token_ids


def _drain(engine) -> dict[str, list[int]]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


@pytest.mark.parametrize("prompt_len", [2 * BS - 2, 2 * BS + 3])  # its computed tokens fill whole blocks, or not
def test_forks_generate_what_fresh_requests_generate(llm, prompt_len):
    engine = llm.llm_engine
    prompt = [(i * 37 + 5) % 200 + 3 for i in range(prompt_len)]
    parent = engine.add_request(prompt_token_ids=prompt, sampling_params=_greedy(3), keep_kv=True)
    first = _drain(engine)[parent]
    history = prompt + first[:-1]  # what the parent's blocks hold: its last token was never computed
    suffixes = [[17], [first[-1]], [23, 41, 9]]
    computed = engine.stats.prompt_tokens_computed
    copies = engine.kv_manager.num_copies
    kids = [engine.fork_request(parent, s, _greedy(6)) for s in suffixes]
    assert engine.release_kv(parent) and not engine.release_kv(parent)
    got = _drain(engine)
    assert engine.stats.prompt_tokens_computed - computed == sum(map(len, suffixes))  # only what the forks add
    # the partial block: all three write into it, so two of them copy it first; a full one is never copied
    assert engine.kv_manager.num_copies - copies == (2 if len(history) % BS else 0)
    assert pool_is_whole(llm)
    for kid, s in zip(kids, suffixes):
        assert got[kid] == _fresh(llm, history + s, 6)


def test_a_chain_of_forks_matches_one_request(llm):
    """Fork after fork, one token each (what beam search does), ends where one request's greedy run ends."""
    engine = llm.llm_engine
    prompt = [(i * 11 + 7) % 150 + 3 for i in range(BS + 5)]
    rid = engine.add_request(prompt_token_ids=prompt, sampling_params=_greedy(1), keep_kv=True)
    tokens = []
    for _ in range(2 * BS):
        tok = _drain(engine)[rid][0]
        tokens.append(tok)
        nxt = engine.fork_request(rid, [tok], _greedy(1), keep_kv=True)
        engine.release_kv(rid)
        rid = nxt
    tokens.append(_drain(engine)[rid][0])
    engine.release_kv(rid)
    assert pool_is_whole(llm)
    assert tokens == _fresh(llm, prompt, 2 * BS + 1)


def test_fork_errors_leave_the_engine_untouched(llm):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="parent_id 'nobody'"):
        engine.fork_request("nobody", [5], _greedy(1))
    with pytest.raises(ValueError, match="keep_kv"):
        engine.add_request(prompt_token_ids=[5, 6], sampling_params=SamplingParams(n=2), keep_kv=True)
    rid = engine.add_request(prompt_token_ids=[5, 6, 7], sampling_params=_greedy(2), keep_kv=True)
    _drain(engine)
    with pytest.raises(ValueError, match="token_ids must not be empty"):
        engine.fork_request(rid, [], _greedy(1))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.fork_request(rid, [10**9], _greedy(1))
    for bad in (SamplingParams(n=2), SamplingParams(best_of=3), SamplingParams(prompt_logprobs=1)):
        with pytest.raises(ValueError, match="a fork is one sequence, without prompt logprobs"):
            engine.fork_request(rid, [5], bad)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(prompt_token_ids=[5], request_id=rid)
    assert not engine.has_unfinished_requests()
    # an aborted keep_kv request keeps nothing
    other = engine.add_request(prompt_token_ids=[8, 9], sampling_params=_greedy(4), keep_kv=True)
    engine.step()
    engine.abort_request(other)
    assert not engine.release_kv(other)
    assert engine.release_kv(rid)
    assert pool_is_whole(llm)


def test_kept_blocks_give_way_when_the_pool_runs_dry(tiny_checkpoint):
    """Kept requests hold blocks only while nothing else needs them: the oldest gives its blocks back first, and a
    fork of it computes all of its tokens again (with the same result)."""
    llm = LLM(model=str(tiny_checkpoint("llama")), dtype="float32", block_size=BS, max_model_len=64,
              kv_cache_memory=6 * BS * 512, enable_prefix_caching=False)  # 6 blocks: 512 bytes a token's K and V
    engine = llm.llm_engine
    assert engine.kv_manager.num_blocks == 6
    prompts = [[(i * 13 + k) % 200 + 3 for i in range(BS + 1)] for k in range(3)]
    held = []
    for p in prompts:  # each keeps 2 blocks: the pool is full
        held.append(engine.add_request(prompt_token_ids=p, sampling_params=_greedy(1), keep_kv=True))
        _drain(engine)
    assert engine.kv_manager.pool.num_free_blocks == 0
    big = engine.add_request(prompt_token_ids=[4] * (2 * BS), sampling_params=_greedy(2))
    assert _drain(engine)[big]  # it ran: the two oldest kept requests gave their blocks back
    kept = engine.scheduler.kept
    assert [bool(kept[r].blocks) for r in held] == [False, False, True]
    computed = engine.stats.prompt_tokens_computed
    kids = [engine.fork_request(r, [7], _greedy(4)) for r in held]
    for r in held:
        assert engine.release_kv(r)
    got = _drain(engine)
    assert engine.stats.prompt_tokens_computed - computed == 2 * (BS + 2) + 1  # two forks computed whole, one not
    assert pool_is_whole(llm)
    for kid, p in zip(kids, prompts):
        assert got[kid] == _fresh(llm, p + [7], 4)


# ------------------------------------------------------------------ the cache's contents, without a model
class CacheModel:
    """What each slot of each device and host block holds, updated as ModelRunner updates the real cache."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.dev = [[None] * kv.block_size for _ in range(kv.num_blocks)]
        self.host = [[None] * kv.block_size for _ in range(kv.host_pool.num_blocks if kv.host_pool else 0)]

    def apply(self, out: SchedulerOutput) -> None:
        for d, h in out.swap_out:
            self.host[h] = list(self.dev[d])
        last = {dst: src for src, dst in out.copies}
        new = {dst: list(self.dev[src]) for dst, src in last.items()}  # every source read before any write
        for dst, slots in new.items():
            self.dev[dst] = slots
        for h, d in out.swap_in:
            self.dev[d] = list(self.host[h])
        bs = self.kv.block_size
        for s in out.scheduled:
            r = s.request
            for pos in range(s.start, s.start + s.num_tokens):
                self.dev[r.blocks[pos // bs].block_id][pos % bs] = r.token_at(pos, pos + 1)[0]

    def check(self, req: Request) -> None:
        bs = self.kv.block_size
        blocks, store = (req.host_blocks, self.host) if req.status == RequestStatus.SWAPPED else (req.blocks,
                                                                                                 self.dev)
        assert len(blocks) >= -(-req.num_computed_tokens // bs)
        for pos in range(req.num_computed_tokens):
            assert store[blocks[pos // bs].block_id][pos % bs] == req.token_at(pos, pos + 1)[0], (req, pos)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), num_blocks=st.integers(6, 24), block_size=st.sampled_from([2, 4, 8]),
       budget=st.integers(1, 48), host_blocks=st.sampled_from([0, 0, 6, 40]), caching=st.booleans(),
       max_seqs=st.integers(1, 4))
def test_forks_keep_every_request_s_tokens_in_place(data, num_blocks, block_size, budget, host_blocks, caching,
                                                   max_seqs):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching, num_host_blocks=host_blocks)
    sched = Scheduler(kv, max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    cache = CacheModel(kv)
    live: list[Request] = []
    kept = sched.kept  # finished keep_kv requests (the scheduler's)
    ids = iter(range(10**6))
    tokens_of: dict[bytes, list[int]] = {}  # a block hash -> the tokens it stands for (from the requests' hashes)

    def new_request(prompt, keep) -> Request | None:
        mt = data.draw(st.integers(1, 6))
        if kv.blocks_needed(len(prompt) + mt) > num_blocks:
            return None
        req = Request(str(next(ids)), None, prompt, SamplingParams(max_tokens=mt), mt, keep_kv=keep)
        live.append(req)
        return req

    def step() -> int:
        out = sched.schedule()
        cache.apply(out)
        for s in out.scheduled:
            r = s.request
            for i, h in enumerate(r.block_hashes):
                tokens_of.setdefault(h, r.token_at(i * block_size, (i + 1) * block_size))
            if s.samples:
                r.output_token_ids.append(100 + (int(r.request_id) * 7 + r.num_tokens) % 13)
                if r.num_output_tokens >= r.max_tokens:
                    sched.finish_request(r, RequestStatus.FINISHED_LENGTH)
                    live.remove(r)
                    assert (r.request_id in kept) == r.keep_kv
        for r in live + list(kept.values()):
            cache.check(r)
        for h, b in kv.pool.cached.items():  # a block the prefix cache lists holds what its hash stands for
            assert cache.dev[b.block_id] == tokens_of[h], (b, tokens_of[h])
        refs: dict[int, int] = {}
        for r in live + list(kept.values()):
            for b in r.blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        assert all(b.ref_cnt == refs.get(b.block_id, 0) for b in kv.pool.blocks)
        return len(out.scheduled)

    for _ in range(data.draw(st.integers(5, 50))):
        action = data.draw(st.sampled_from(["add", "fork", "fork", "follow", "step", "step", "step", "release",
                                            "abort"]))
        if action == "add":
            base = data.draw(st.sampled_from([[1] * 30, list(range(3, 33))]))
            req = new_request(base[:data.draw(st.integers(1, 30))], data.draw(st.booleans()))
            if req is not None:
                sched.add_request(req)
        elif action == "fork" and kept:
            parent = data.draw(st.sampled_from(list(kept.values())))
            head = parent.token_at(0, parent.num_tokens - 1)
            child = new_request(head + data.draw(st.lists(st.integers(50, 60), min_size=1, max_size=4)),
                                data.draw(st.booleans()))
            if child is not None:
                if parent.blocks:  # (unless the pool took them back: LLMEngine.fork_request)
                    kv.fork(parent, child)
                sched.add_request(child)
                cache.check(child)
        elif action == "follow" and live:
            lead = data.draw(st.sampled_from(live))  # (prefilling, generating, waiting, or a follower itself)
            req = new_request(list(lead.prompt_token_ids), data.draw(st.booleans()))
            if req is not None:
                sched.add_request(req, lead)
                cache.check(req)
        elif action == "release" and kept:
            assert sched.release(data.draw(st.sampled_from(list(kept))))
        elif action == "abort" and live:
            req = data.draw(st.sampled_from(live))
            sched.finish_request(req, RequestStatus.FINISHED_ABORTED)
            live.remove(req)
        elif action == "step":
            step()
    while live:  # everything finishes, kept blocks giving way where they must
        assert step(), "no request could run"
    for rid in list(kept):
        assert sched.release(rid)
    assert kv.pool.num_free_blocks == num_blocks and all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert not sched.followers and not sched._lead_of
    if kv.host_pool is not None:
        assert kv.host_pool.num_free_blocks == host_blocks


def test_waiting_forks_give_their_blocks_back_when_nothing_else_can_run():
    """A fork waits holding its parent's blocks; when the request in front of it can only run with them, they are
    taken back (the fork computes its tokens again later) rather than nothing ever running."""
    kv = KVCacheManager(4, 4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    cache = CacheModel(kv)
    parent = Request("p", None, list(range(3, 10)), SamplingParams(max_tokens=1), 1, keep_kv=True)
    sched.add_request(parent)
    cache.apply(sched.schedule())
    parent.output_token_ids.append(99)
    sched.finish_request(parent, RequestStatus.FINISHED_LENGTH)
    assert sched.kept == {"p": parent} and len(parent.blocks) == 2 and kv.pool.num_free_blocks == 2
    big = Request("big", None, [7] * 15, SamplingParams(max_tokens=1), 1)  # needs the whole pool
    sched.add_request(big)
    forks = []
    for i in range(2):
        child = Request(f"f{i}", None, parent.token_at(0, 7) + [50 + i], SamplingParams(max_tokens=1), 1)
        kv.fork(parent, child)
        sched.add_request(child)
        forks.append(child)
    assert sched.release("p")
    out = sched.schedule()
    assert [s.request for s in out.scheduled] == [big] and sched.num_preemptions == 2
    assert all(not f.blocks and f.num_computed_tokens == 0 for f in forks)
    cache.apply(out)
    big.output_token_ids.append(1)
    sched.finish_request(big, RequestStatus.FINISHED_LENGTH)
    out = sched.schedule()
    assert [s.request for s in out.scheduled] == forks and [s.num_tokens for s in out.scheduled] == [8, 8]
    cache.apply(out)
    for f in forks:
        cache.check(f)


def _finish(sched: Scheduler, req: Request) -> None:
    req.output_token_ids.append(99)
    sched.finish_request(req, RequestStatus.FINISHED_LENGTH)


def test_a_follower_copies_a_cached_block_it_holds_alone():
    """A follower added after its lead decoded past the prompt's last block shares that block partly filled, while
    the lead filled it and the prefix cache lists it; the lead gone, the follower is its last holder and must still
    copy it before writing, or the cache would hand out its K/V under the lead's hash."""
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    cache = CacheModel(kv)
    prompt = [1, 2, 3, 4, 5, 6]
    lead = Request("lead", None, prompt, SamplingParams(max_tokens=8), 8)
    sched.add_request(lead)
    while lead.num_computed_tokens < 9:  # block 1 holds [5, 6, 100, 101]: full, cached
        cache.apply(sched.schedule())
        lead.output_token_ids.append(100 + lead.num_output_tokens)
    follower = Request("f", None, list(prompt), SamplingParams(max_tokens=2), 2)
    sched.add_request(follower, lead)  # the lead has sampled: forks 5 tokens at once
    assert follower.num_computed_tokens == 5 and follower.blocks[1] is lead.blocks[1]
    sched.finish_request(lead, RequestStatus.FINISHED_ABORTED)
    out = sched.schedule()
    assert len(out.copies) == 1  # the follower's copy of block 1
    cache.apply(out)
    follower.output_token_ids.append(200)
    cache.apply(sched.schedule())  # it writes 200 at position 6: into its copy, not the cached block
    cache.check(follower)
    hit = kv.get_computed_blocks(Request("x", None, prompt + [100, 101, 7], SamplingParams(max_tokens=1), 1))
    assert len(hit) == 2 and cache.dev[hit[1].block_id] == [5, 6, 100, 101]


def test_a_waiting_fork_that_frees_blocks_gives_way_before_a_follower():
    """Under pressure a waiting fork that is its blocks' last holder gives them back first; a follower, whose blocks
    its running lead holds too, would give nothing back and lose its prompt."""
    kv = KVCacheManager(4, 4)
    sched = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=64)
    cache = CacheModel(kv)
    parent = Request("p", None, [3, 4, 5, 6, 7], SamplingParams(max_tokens=1), 1, keep_kv=True)
    sched.add_request(parent)
    cache.apply(sched.schedule())
    _finish(sched, parent)
    lead = Request("lead", None, list(range(10, 18)), SamplingParams(max_tokens=4), 4)  # 2 full blocks
    sched.add_request(lead)
    cache.apply(sched.schedule())
    fork = Request("g", None, parent.token_at(0, 5) + [50], SamplingParams(max_tokens=1), 1)
    kv.fork(parent, fork)
    sched.add_request(fork)
    assert sched.release("p")  # the fork holds the parent's 2 blocks alone: the pool is full
    follower = Request("f", None, list(range(10, 18)), SamplingParams(max_tokens=4), 4)
    sched.add_request(follower, lead)
    lead.output_token_ids.append(1)
    out = sched.schedule()  # the follower forks 7 tokens; the lead needs a third block
    assert [s.request for s in out.scheduled] == [lead] and list(sched.waiting) == [fork, follower]
    assert not fork.blocks and follower.num_computed_tokens == 7 and len(follower.blocks) == 2
    cache.apply(out)
    for r in (lead, follower):
        cache.check(r)
