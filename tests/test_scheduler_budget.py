"""The scheduler's attention-aware token budget and its decode-first rule (pagellm/core/scheduler.py).

A prefill chunk of n tokens after c computed ones costs n + (n c + n (n + 1) / 2) / A; ``fit`` picks the longest
chunk whose cost fits. A long prompt next to generating requests: every step keeps the decodes, and its chunks
shrink as its context grows so that each step costs the budget, not several times it. The engine-level check (the
tokens stay HF's with the shrunken chunks) is in test_correctness_hf.py.
"""
from __future__ import annotations

import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.config import EngineConfig
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.scheduler import Scheduler, _keys
from pagellm.engine.request import Request
from pagellm.model_executor.models.llama import ModelShape
from pagellm.sampling_params import SamplingParams


def make_request(i: int, prompt_len: int, max_tokens: int = 64) -> Request:
    return Request(request_id=str(i), prompt=None, prompt_token_ids=[1] * prompt_len,
                   sampling_params=SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens)


def scheduler(keys: float | None, budget: int = 2048, num_blocks: int = 4096, windows=()) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, 16, enable_prefix_caching=False), max_num_seqs=64,
                     max_num_batched_tokens=budget, attention_keys_per_token=keys, attention_windows=windows)


WINDOWS = st.sampled_from([(), (), (None, None), (4096,), (64, None), (1, 300, None, None)])


@settings(max_examples=300, deadline=None)
@given(gap=st.integers(1, 10_000), context=st.integers(0, 50_000), budget=st.floats(0, 5_000),
       keys=st.floats(0.5, 50_000), windows=WINDOWS)
def test_fit_is_the_longest_chunk_within_budget(gap, context, budget, keys, windows):
    s = scheduler(keys, windows=windows)
    n = s.fit(gap, context, budget)
    if budget < 1:
        assert n == 0
        return
    assert 1 <= n <= gap
    assert s.cost(n, context) <= budget
    assert n == gap or s.cost(n + 1, context) > budget
    assert s.fit(0, context, budget) == 0


def test_one_token_counts_one():
    # a decode, or a chunk of one: the floor that keeps every request moving
    assert scheduler(1.0).cost(1, 10**6) == 1.0
    assert scheduler(1.0).fit(500, 10**6, 1.5) == 1


def test_cost_counts_each_tokens_keys():
    s = scheduler(100.0)
    # 4 tokens after 10: they attend to 11, 12, 13, 14 keys
    assert s.cost(4, 10) == pytest.approx(4 + (11 + 12 + 13 + 14) / 100)
    assert scheduler(None).cost(4, 10) == 4.0
    # half the layers with a window of 12 keys: those see 11, 12, 12, 12
    assert scheduler(100.0, windows=(12, None)).cost(4, 10) == pytest.approx(4 + (47 + 50) / 2 / 100)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 300), context=st.integers(0, 600), window=st.none() | st.integers(1, 700))
def test_keys_are_each_tokens_window(n, context, window):
    want = sum(context + i + 1 if window is None else min(context + i + 1, window) for i in range(n))
    assert _keys(n, context, window) == want


def test_sliding_windows_lengthen_deep_chunks():
    """Mistral-style layers that see at most 4,096 keys: deep into a long prompt a chunk's attention stops
    growing, so its chunks stay longer than full attention's."""
    full, windowed = scheduler(3072.0), scheduler(3072.0, windows=(4096,) * 30)
    assert windowed.fit(7000, 1000, 2048) == full.fit(7000, 1000, 2048)  # inside the window: the same
    assert windowed.fit(7000, 6000, 2048) > 1.3 * full.fit(7000, 6000, 2048)
    assert windowed.fit(7000, 6000, 2048) == windowed.fit(7000, 20_000, 2048)  # past it: context no longer counts
    with pytest.raises(ValueError, match="attention_windows"):
        scheduler(3072.0, windows=(0,))


def run_long_prompt(keys: float | None) -> list[tuple[int, int, int]]:
    """A 7,000-token prompt, admitted first, with three requests generating behind it (admitted on what its
    chunks left over, as the attention-aware budget allows): (context, chunk, decodes) per step."""
    s = scheduler(keys)
    long = make_request(9, 7000, max_tokens=4)
    s.add_request(long)
    steps = []
    out = s.schedule()  # the long prompt's first chunk
    steps.append((0, out.scheduled[0].num_tokens, 0))
    short = [make_request(i, 1, max_tokens=1000) for i in range(3)]
    s.running.extend(short)  # one token each to compute: generating
    for r in short:
        assert s.kv.allocate_slots(r, 0)
    while long.num_computed_tokens < long.num_prompt_tokens:
        out = s.schedule()
        assert out.total_num_tokens <= 2048
        assert sum(s.cost(x.num_tokens, x.start) for x in out.scheduled) <= 2048 + 1e-9
        chunk = [x for x in out.scheduled if x.request is long]
        steps.append((chunk[0].start, chunk[0].num_tokens, sum(x.request in short for x in out.scheduled)))
        for x in out.scheduled:
            if x.samples:
                x.request.output_token_ids.append(7)
    return steps


def test_long_prompt_chunks_shrink_with_context_and_decodes_keep_their_token():
    steps = run_long_prompt(keys=3072.0)  # SmolLM2-135M's A
    assert all(decodes == 3 for _, _, decodes in steps[1:])  # behind the prefill, yet every step
    chunks = [n for _, n, _ in steps]
    assert chunks == sorted(chunks, reverse=True) and chunks[0] < 2045 and chunks[-1] < chunks[0]
    # each chunk is the longest that fits beside the three decodes: its tokens plus keys come to the budget
    s = scheduler(3072.0)
    for context, n, decodes in steps[:-1]:
        assert s.cost(n, context) <= 2048 - decodes < s.cost(n + 1, context)
    # a token-only budget takes the prompt in 2,045-token chunks; the one after 4,090 tokens costs (linears and
    # attention, in the same units) over 2.5 times the budget, the step every decode waits for
    plain = run_long_prompt(keys=None)
    assert [n for _, n, _ in plain] == [2048, 2045, 2045, 862]
    assert max(s.cost(n, context) for context, n, _ in plain) > 2.5 * 2048
    assert len(steps) > len(plain)


@pytest.mark.parametrize("keys", [None, 3072.0])
def test_prefill_chunk_leaves_room_for_younger_decodes(keys):
    """An older request still prefilling takes only what the decodes behind it leave; the oldest always gets a
    token, even when the decodes would fill the budget."""
    for budget, want in [(10, 7), (3, 1), (2, 1)]:
        s = scheduler(keys, budget=budget)
        old = make_request(0, 100)
        s.add_request(old)
        s.schedule()  # takes `budget` tokens of its prompt
        young = [make_request(i, 1) for i in range(1, 4)]
        s.running.extend(young)  # admitted and prefilled earlier in a real run: each has one token to decode
        for r in young:
            assert s.kv.allocate_slots(r, 0)
        expect = s.fit(old.num_tokens - old.num_computed_tokens, old.num_computed_tokens, budget - 3) or 1
        assert keys is not None or expect == want
        out = s.schedule()
        got = {x.request.request_id: x.num_tokens for x in out.scheduled}
        assert got["0"] == expect
        assert sum(got.values()) <= budget
        assert sum(r.request_id in got for r in young) == min(3, budget - expect)


def test_a_recompute_preemption_frees_the_victims_reservation():
    """4 blocks of 16: r0 decodes into a new block, which preempts r2 (a decode, by recomputation); r1's chunk
    then keeps no token for r2."""
    s = Scheduler(KVCacheManager(4, 16, enable_prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=10)
    r0, r1, r2 = make_request(0, 16), make_request(1, 40), make_request(2, 2)
    s.running = [r0, r1, r2]
    assert s.kv.allocate_slots(r0, 16) and s.kv.allocate_slots(r1, 20) and s.kv.allocate_slots(r2, 1)
    r0.num_computed_tokens, r1.num_computed_tokens, r2.num_computed_tokens = 16, 20, 1
    assert s.kv.pool.num_free_blocks == 0
    r0.output_token_ids.append(7)  # r0 has one token to compute: a decode that needs a fourth block
    out = s.schedule()
    assert out.preempted == [r2]
    assert [(x.request.request_id, x.num_tokens) for x in out.scheduled] == [("0", 1), ("1", 9)]


def test_model_shape_keys_per_token():
    smollm2 = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                       num_attention_heads=9, num_key_value_heads=3, vocab_size=49152)
    assert ModelShape(smollm2, "LlamaForCausalLM").attention_keys_per_token() == 3072.0
    llama3_8b = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                         num_attention_heads=32, num_key_value_heads=8)
    # larger models spend more on linears per key of attention
    assert ModelShape(llama3_8b, "LlamaForCausalLM").attention_keys_per_token() == pytest.approx(26_624)


def test_bad_values_name_the_field():
    with pytest.raises(ValueError, match="attention_aware_budget"):
        EngineConfig(attention_aware_budget="yes")
    with pytest.raises(ValueError, match="attention_keys_per_token"):
        scheduler(0.0)
