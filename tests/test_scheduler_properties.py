"""Property tests for the scheduler + KV cache manager (pagellm/core/scheduler.py); no model needed.

The model/engine side is simulated: after each ``schedule()``, every ``ScheduledRequest`` that samples gets one
token appended to ``output_token_ids`` (what the engine does after sampling), and a request that reached its
``max_tokens`` is ended with ``finish_request(req, FINISHED_LENGTH)``. Every request is valid the way the engine
validates it: ``ceil((prompt + max_tokens) / block_size) <= num_blocks`` (it fits in the pool on its own).

* ``SchedulerMachine`` (RuleBasedStateMachine): add / step / stop a running request / abort, with small pools and
  budgets, chunked prefill on and off. Block ownership, queue membership, FCFS order and per-step budgets are
  checked after every rule; draining, or finishing everything, frees every block.
* Liveness: without aborts every request finishes within a bound on the number of steps, the oldest running
  request is never preempted, and identical requests finish in arrival order.
* A deterministic preemption scenario: the victim goes back to the FRONT of the waiting queue, reset.
"""
from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagellm.core.kv_cache_manager import KVCacheManager, cdiv
from pagellm.core.scheduler import Scheduler, SchedulerOutput
from pagellm.engine.request import Request, RequestStatus
from pagellm.sampling_params import SamplingParams

MAX_PROMPT = 200
MAX_GEN = 40
BLOCK_SIZES = [8, 16, 32]


# ---------------------------------------------------------------------------------------------- helpers
def make_request(i: int, prompt_len: int, max_tokens: int) -> Request:
    req = Request(request_id=str(i), prompt=None, prompt_token_ids=[1] * prompt_len,
                  sampling_params=SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens)
    req.arrival_idx = i  # test-only tag: global arrival order (FCFS checks)
    return req


def make_scheduler(num_blocks: int, block_size: int, max_num_seqs: int, budget: int, chunked: bool,
                   keys: float | None = None, windows: tuple = ()) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, block_size), max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=budget, enable_chunked_prefill=chunked, attention_keys_per_token=keys,
                     attention_windows=windows)


# The attention-aware budget's A (None: every token counts one); small values make chunks shrink within the
# short prompts used here.
KEYS = st.sampled_from([None, None, 1.0, 8.0, 64.0])


@st.composite
def request_shape(draw, capacity: int):
    """(prompt_len, max_tokens) that fits the pool on its own: prompt + max_tokens <= num_blocks * block_size."""
    p = draw(st.integers(1, min(MAX_PROMPT, capacity - 1)))
    m = draw(st.integers(1, min(MAX_GEN, capacity - p)))
    return p, m


def step_and_check(sched: Scheduler, finished: list[Request] | None = None) -> SchedulerOutput:
    """One engine step: schedule, check the per-step properties, then simulate sampling.

    Per-step properties: the token budget (with the attention-aware cost when the scheduler has one) and
    max_num_seqs hold; every scheduled request is running and scheduled once with >= 1 token from where it
    stood; running decodes are never left out for a prefill chunk while the budget has room for them and the
    oldest request's token; the oldest running request always computes; preemption takes the youngest running
    requests (a suffix of the running list, never the oldest), puts them at the front of the waiting queue reset
    to zero, and blocks any admission in that step; and there is progress whenever something is unfinished (no
    deadlock).
    """
    running_before = list(sched.running)
    waiting_before = list(sched.waiting)
    computed_before = {id(r): r.num_computed_tokens for r in running_before + waiting_before}
    decodes_before = [r for r in running_before if r.num_tokens - r.num_computed_tokens == 1]
    had_work = sched.has_unfinished()

    out = sched.schedule()

    # budget, seqs, progress
    assert out.total_num_tokens <= sched.max_num_batched_tokens
    assert sum(sched.cost(s.num_tokens, s.start) for s in out.scheduled) <= sched.max_num_batched_tokens + 1e-9
    assert len(sched.running) <= sched.max_num_seqs
    assert not had_work or not out.is_empty, "unfinished requests but nothing scheduled: deadlock"
    # each scheduled request: running, once, >= 1 token, starting at its computed count, within its tokens
    assert len({id(s.request) for s in out.scheduled}) == len(out.scheduled)
    for s in out.scheduled:
        r = s.request
        assert r.status == RequestStatus.RUNNING and any(x is r for x in sched.running)
        assert s.num_tokens >= 1
        assert s.start == computed_before[id(r)] == r.num_computed_tokens - s.num_tokens
        assert r.num_computed_tokens <= r.num_tokens
        assert s.samples == (r.num_computed_tokens == r.num_tokens)
        if not sched.enable_chunked_prefill:
            assert s.samples, "without chunked prefill every scheduled request computes all its tokens"
    # scheduled in running order (oldest first); the running list only grows at its end
    pos = {id(r): k for k, r in enumerate(sched.running)}
    assert [pos[id(s.request)] for s in out.scheduled] == sorted(pos[id(s.request)] for s in out.scheduled)
    # decodes first; the oldest running request always computes
    scheduled = {id(s.request) for s in out.scheduled}
    if not out.preempted and len(decodes_before) < sched.max_num_batched_tokens:
        assert all(id(r) in scheduled for r in decodes_before), "a decode was left out for a prefill chunk"
    if running_before and not (out.preempted and out.preempted[-1] is running_before[0]):
        assert id(running_before[0]) in scheduled, "the oldest running request computed nothing"
    # preemption
    if out.preempted:
        victims = out.preempted
        k = len(victims)
        assert [id(v) for v in victims] == [id(r) for r in reversed(running_before[-k:])], \
            "victims must be the most recently admitted running requests, youngest first"
        assert [id(r) for r in sched.running] == [id(r) for r in running_before[:-k]], \
            "no admission in a step that preempted"
        assert victims[-1] is not running_before[0], "the oldest running request was preempted"
        assert [id(r) for r in list(sched.waiting)[:k]] == [id(v) for v in reversed(victims)], \
            "preempted requests go back to the front of the waiting queue, in admission order"
        for v in victims:
            assert v.status == RequestStatus.PREEMPTED and v.num_computed_tokens == 0 and v.blocks == []
    else:
        # admissions come from the front of the waiting queue, in order
        new = [r for r in sched.running if all(r is not x for x in running_before)]
        assert [id(r) for r in new] == [id(r) for r in waiting_before[:len(new)]]
        assert [id(r) for r in sched.running[:len(running_before)]] == [id(r) for r in running_before]

    # simulated sampling + length stop
    for s in out.scheduled:
        if s.samples:
            r = s.request
            r.output_token_ids.append(7)
            if r.num_output_tokens >= r.max_tokens:
                sched.finish_request(r, RequestStatus.FINISHED_LENGTH)
                if finished is not None:
                    finished.append(r)
    return out


def check_invariants(sched: Scheduler, requests: list[Request]) -> None:
    """State invariants; ``requests`` is every request ever added (finished ones included)."""
    pool = sched.kv.pool
    bs = sched.kv.block_size
    running, waiting = list(sched.running), list(sched.waiting)
    # queues: disjoint, no duplicates, exactly the unfinished requests
    queued = [id(r) for r in running + waiting]
    assert len(set(queued)) == len(queued), "a request is queued twice"
    assert set(queued) == {id(r) for r in requests if not r.is_finished}
    assert len(running) <= sched.max_num_seqs
    # strict FCFS: running (admission order) then waiting is sorted by arrival, so the oldest is never behind
    order = [r.arrival_idx for r in running + waiting]
    assert order == sorted(order), f"not FCFS: {order}"

    for r in running:
        assert r.status == RequestStatus.RUNNING
        assert len(r.blocks) == cdiv(r.num_computed_tokens, bs), "running request must hold ceil(computed/bs)"
    for r in waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.blocks == [] and r.num_computed_tokens == 0, "waiting/preempted requests hold nothing"
        if r.status == RequestStatus.PREEMPTED:
            assert r.num_preemptions > 0
    for r in requests:
        if r.is_finished:
            assert r.blocks == [], "finished requests hold no blocks"
        else:
            assert r.num_computed_tokens < r.num_tokens, "an unfinished request always has work left"
            assert r.num_output_tokens < r.max_tokens
        assert len({id(b) for b in r.blocks}) == len(r.blocks), "a block twice in one block table"
    assert sum(r.num_preemptions for r in requests) == sched.num_preemptions

    # block ownership: the multiset of block ids in all block tables == the ref counts, exactly
    owned = Counter(b.block_id for r in requests for b in r.blocks)
    assert all(pool.blocks[b.block_id] is b for r in requests for b in r.blocks), "a block not from this pool"
    refs = {b.block_id: b.ref_cnt for b in pool.blocks if b.ref_cnt != 0}
    assert owned == refs, f"block tables {dict(owned)} != ref counts {refs}"
    assert all(b.ref_cnt >= 0 for b in pool.blocks)
    free_ids = [b.block_id for b in pool.free_queue]
    assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks
    assert not set(free_ids) & set(owned), "a block is both free and referenced"
    assert pool.num_free_blocks + len(owned) == pool.num_blocks
    assert len(owned) <= pool.peak_used <= pool.num_blocks


def assert_all_free(sched: Scheduler) -> None:
    pool = sched.kv.pool
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert sorted(b.block_id for b in pool.free_queue) == list(range(pool.num_blocks))
    assert pool.num_free_blocks == pool.num_blocks and pool.num_used_blocks == 0


def step_bound(requests: list[Request]) -> int:
    """Upper bound on steps to finish these requests: every step the oldest running request (admitted that
    step if none was running) computes >= 1 token and is never preempted, and a request needs at most
    prompt + max_tokens - 1 computed tokens before its last sample."""
    return sum(r.num_prompt_tokens + r.max_tokens for r in requests)


# ------------------------------------------------------------------------------------- state machine
class SchedulerMachine(RuleBasedStateMachine):
    CHUNKED: bool = True

    @initialize(data=st.data())
    def setup(self, data):
        # small pools (more memory pressure, hence preemption) are drawn more often
        num_blocks = data.draw(st.integers(4, 12) | st.integers(4, 40), label="num_blocks")
        block_size = data.draw(st.sampled_from(BLOCK_SIZES), label="block_size")
        self.capacity = num_blocks * block_size
        if self.CHUNKED:
            budget = data.draw(st.integers(1, 300), label="budget")  # any budget >= 1 works when chunking
        else:
            # Without chunking a request is prefilled whole: the budget must cover the longest request.
            budget = data.draw(st.integers(min(MAX_PROMPT + MAX_GEN, self.capacity), 300), label="budget")
        max_num_seqs = data.draw(st.integers(1, 8), label="max_num_seqs")
        keys = data.draw(KEYS, label="attention_keys_per_token")
        windows = data.draw(st.sampled_from([(), (16, None), (50,)]), label="attention_windows")
        self.sched = make_scheduler(num_blocks, block_size, max_num_seqs, budget, self.CHUNKED, keys, windows)
        self.requests: list[Request] = []

    def unfinished(self) -> list[Request]:
        return [r for r in self.requests if not r.is_finished]

    @precondition(lambda self: len(self.unfinished()) < 12)
    @rule(data=st.data(), k=st.integers(1, 4))
    def add_requests(self, data, k):
        """k requests arrive (several at once, to build up memory pressure)."""
        for _ in range(k):
            p, m = data.draw(request_shape(self.capacity), label="prompt_len, max_tokens")
            req = make_request(len(self.requests), p, m)
            self.requests.append(req)
            self.sched.add_request(req)
            assert req.status == RequestStatus.WAITING and self.sched.waiting[-1] is req

    @rule(n=st.integers(1, 16))
    def step(self, n):
        """n engine steps (several per rule so that requests grow far enough to exhaust the pool)."""
        for _ in range(n):
            step_and_check(self.sched)
            check_invariants(self.sched, self.requests)

    @precondition(lambda self: bool(self.sched.running))
    @rule(data=st.data())
    def stop_running(self, data):
        """The engine saw a stop token/string for a running request."""
        req = data.draw(st.sampled_from(self.sched.running))
        self.sched.finish_request(req, RequestStatus.FINISHED_STOPPED)
        assert req.status == RequestStatus.FINISHED_STOPPED and req.blocks == []

    @precondition(lambda self: bool(self.sched.running or self.sched.waiting))
    @rule(data=st.data())
    def abort(self, data):
        """The user aborts any unfinished request: waiting, preempted or running."""
        req = data.draw(st.sampled_from(self.unfinished()))
        self.sched.finish_request(req, RequestStatus.FINISHED_ABORTED)
        assert req.status == RequestStatus.FINISHED_ABORTED and req.blocks == []

    @rule()
    def drain(self):
        """Step until everything is done: must finish within the liveness bound and free every block."""
        live = self.unfinished()
        bound = step_bound(live)
        for _ in range(bound):
            if not self.sched.has_unfinished():
                break
            step_and_check(self.sched)
        assert not self.sched.has_unfinished(), f"not done after {bound} steps"
        assert all(r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == r.max_tokens
                   for r in live)
        assert_all_free(self.sched)

    @invariant()
    def invariants(self):
        if hasattr(self, "sched"):
            check_invariants(self.sched, self.requests)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        # Finishing / aborting everything still live leaves every block free with ref_cnt 0.
        for r in list(self.sched.running):
            self.sched.finish_request(r, RequestStatus.FINISHED_STOPPED)
        for r in list(self.sched.waiting):
            self.sched.finish_request(r, RequestStatus.FINISHED_ABORTED)
        assert not self.sched.has_unfinished()
        check_invariants(self.sched, self.requests)
        assert_all_free(self.sched)


class ChunkedSchedulerMachine(SchedulerMachine):
    CHUNKED = True


class UnchunkedSchedulerMachine(SchedulerMachine):
    CHUNKED = False


_machine_settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
ChunkedSchedulerMachine.TestCase.settings = _machine_settings
UnchunkedSchedulerMachine.TestCase.settings = _machine_settings
TestSchedulerChunked = ChunkedSchedulerMachine.TestCase
TestSchedulerUnchunked = UnchunkedSchedulerMachine.TestCase


# ------------------------------------------------------------------------------------------- liveness
@st.composite
def workload(draw):
    num_blocks = draw(st.integers(4, 40))
    block_size = draw(st.sampled_from(BLOCK_SIZES))
    chunked = draw(st.booleans())
    cap = num_blocks * block_size
    budget = draw(st.integers(1, 300) if chunked else st.integers(min(MAX_PROMPT + MAX_GEN, cap), 300))
    max_num_seqs = draw(st.integers(1, 8))
    shapes = draw(st.lists(request_shape(cap), min_size=1, max_size=10))
    arrivals = draw(st.lists(st.integers(0, 15), min_size=len(shapes), max_size=len(shapes)).map(sorted))
    return num_blocks, block_size, chunked, budget, max_num_seqs, shapes, arrivals, draw(KEYS)


@settings(max_examples=150, deadline=None)
@given(workload())
def test_every_request_finishes_within_bound(w):
    """No aborts: stepping always finishes every request (no deadlock, no livelock) within a bounded number of
    steps, each with exactly max_tokens outputs, and leaves the pool empty."""
    num_blocks, block_size, chunked, budget, max_num_seqs, shapes, arrivals, keys = w
    sched = make_scheduler(num_blocks, block_size, max_num_seqs, budget, chunked, keys)
    reqs = [make_request(i, p, m) for i, (p, m) in enumerate(shapes)]
    bound = arrivals[-1] + 1 + step_bound(reqs)
    step = 0
    pending = list(zip(arrivals, reqs))
    arrived: list[Request] = []
    while pending or sched.has_unfinished():
        assert step <= bound, f"livelock: not finished after {bound} steps"
        while pending and pending[0][0] <= step:
            arrived.append(pending.pop(0)[1])
            sched.add_request(arrived[-1])
        step_and_check(sched)
        check_invariants(sched, arrived)
        step += 1
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == r.max_tokens
    assert_all_free(sched)
    assert sched.kv.pool.peak_used <= num_blocks


def test_oldest_request_is_never_starved():
    """Identical requests arriving together under memory pressure: the first admitted is never preempted, the
    oldest running request is never the victim while a younger one runs (checked in step_and_check), and they
    finish in arrival order. Preemption must actually occur in some of the examples."""
    preemptions_seen = []

    @settings(max_examples=150, deadline=None)
    @given(data=st.data())
    def run(data):
        block_size = data.draw(st.sampled_from(BLOCK_SIZES))
        p = data.draw(st.integers(1, 3 * block_size))
        m = data.draw(st.integers(2, MAX_GEN))
        per_req = cdiv(p + m, block_size)
        n = data.draw(st.integers(2, 8))
        # pool: fits one request alone, but not all n at their full length
        num_blocks = data.draw(st.integers(per_req, max(per_req, n * per_req - 1)))
        chunked = data.draw(st.booleans())
        budget = data.draw(st.integers(1, 300) if chunked else st.integers(p + m, 300))
        sched = make_scheduler(num_blocks, block_size, n, budget, chunked, data.draw(KEYS))
        reqs = [make_request(i, p, m) for i in range(n)]
        for r in reqs:
            sched.add_request(r)
        finished: list[Request] = []
        for _ in range(step_bound(reqs) + 1):
            if not sched.has_unfinished():
                break
            step_and_check(sched, finished)
            check_invariants(sched, reqs)
            assert reqs[0].num_preemptions == 0, "the first-admitted request was preempted"
        assert not sched.has_unfinished()
        assert [r.arrival_idx for r in finished] == list(range(n)), "identical requests must finish FCFS"
        assert_all_free(sched)
        preemptions_seen.append(sched.num_preemptions)

    run()
    assert any(preemptions_seen), "memory pressure never caused a preemption: the test is not exercising it"


# ---------------------------------------------------------------------------------------- deterministic
def test_preempted_request_goes_to_front_of_waiting_reset():
    """4 blocks of 4 tokens; A and B (prompt 4, up to 8 new tokens, 3 blocks each at most) both fit at first,
    but fill the pool by 8 tokens each; A's next block preempts B, which goes back in FRONT of C."""
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2, budget=64, chunked=True)
    a, b, c = (make_request(i, 4, 8) for i in range(3))
    for r in (a, b, c):
        sched.add_request(r)
    requests = [a, b, c]
    out = step_and_check(sched)
    assert [s.request for s in out.scheduled] == [a, b]  # max_num_seqs=2 keeps C waiting
    assert list(sched.waiting) == [c]
    for _ in range(10):
        out = step_and_check(sched)
        check_invariants(sched, requests)
        if out.preempted:
            break
    assert out.preempted == [b]
    assert sched.num_preemptions == 1 and b.num_preemptions == 1
    assert list(sched.waiting) == [b, c], "the victim goes to the FRONT of the waiting queue"
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.blocks == []
    assert b.num_output_tokens > 0  # keeps its generated tokens; they are recomputed on readmission
    assert sched.running == [a] and len(a.blocks) == 3
    # B is readmitted before C and everything completes
    finished: list[Request] = []
    while sched.has_unfinished():
        step_and_check(sched, finished)
        check_invariants(sched, requests)
    assert finished == [a, b, c]
    assert all(r.num_output_tokens == 8 for r in requests)
    assert_all_free(sched)
