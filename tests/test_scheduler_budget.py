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
from pagellm.core.scheduler import Scheduler
from pagellm.engine.request import Request
from pagellm.model_executor.models.llama import ModelShape
from pagellm.sampling_params import SamplingParams


def make_request(i: int, prompt_len: int, max_tokens: int = 64) -> Request:
    return Request(request_id=str(i), prompt=None, prompt_token_ids=[1] * prompt_len,
                   sampling_params=SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens)


def scheduler(keys: float | None, budget: int = 2048, num_blocks: int = 4096) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, 16, enable_prefix_caching=False), max_num_seqs=64,
                     max_num_batched_tokens=budget, attention_keys_per_token=keys)


@settings(max_examples=300, deadline=None)
@given(gap=st.integers(1, 10_000), context=st.integers(0, 50_000), budget=st.floats(0, 5_000),
       keys=st.floats(0.5, 50_000))
def test_fit_is_the_longest_chunk_within_budget(gap, context, budget, keys):
    s = scheduler(keys)
    n = s.fit(gap, context, budget)
    if budget < 1:
        assert n == 0
        return
    assert 1 <= n <= gap
    assert n == 1 or s.cost(n, context) <= budget
    assert n == gap or s.cost(n + 1, context) > budget
    assert s.cost(1, context) == 1.0  # one token (a decode) counts one


def test_cost_counts_each_tokens_keys():
    s = scheduler(100.0)
    # 4 tokens after 10: they attend to 11, 12, 13, 14 keys
    assert s.cost(4, 10) == pytest.approx(4 + (11 + 12 + 13 + 14) / 100)
    assert scheduler(None).cost(4, 10) == 4.0


def run_long_prompt(keys: float | None) -> list[tuple[int, int, int]]:
    """Three requests generating while a 7,000-token prompt arrives: (context, chunk, decodes) per step."""
    s = scheduler(keys)
    short = [make_request(i, 20, max_tokens=1000) for i in range(3)]
    for r in short:
        s.add_request(r)
    s.schedule()  # the three prompts
    for r in short:
        r.output_token_ids.append(7)
    long = make_request(9, 7000, max_tokens=4)
    s.add_request(long)
    steps = []
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
    assert all(decodes == 3 for _, _, decodes in steps)
    chunks = [n for _, n, _ in steps]
    assert chunks == sorted(chunks, reverse=True) and chunks[0] < 2045 and chunks[-1] < chunks[0]
    # each chunk is the longest that fits beside the three decodes: its tokens plus keys come to the budget
    s = scheduler(3072.0)
    for context, n, _ in steps[:-1]:
        assert s.cost(n, context) <= 2045 < s.cost(n + 1, context)
    # a token-only budget takes the prompt in 2,045-token chunks; the one after 4,090 tokens costs (linears and
    # attention, in the same units) over 2.5 times the budget, the step every decode waits for
    plain = run_long_prompt(keys=None)
    assert [n for _, n, _ in plain] == [2045, 2045, 2045, 865]
    assert max(s.cost(n, context) for context, n, _ in plain) > 2.5 * 2048
    assert len(steps) > len(plain)


def test_prefill_chunk_leaves_room_for_younger_decodes():
    """An older request still prefilling takes only what the decodes behind it leave; the oldest always gets a
    token, even when the decodes would fill the budget."""
    for budget, want in [(10, 7), (3, 1), (2, 1)]:
        s = scheduler(None, budget=budget)
        old = make_request(0, 100)
        s.add_request(old)
        s.schedule()  # takes `budget` tokens of its prompt
        young = [make_request(i, 1) for i in range(1, 4)]
        s.running.extend(young)  # admitted and prefilled earlier in a real run: each has one token to decode
        for r in young:
            assert s.kv.allocate_slots(r, 0)
        out = s.schedule()
        got = {x.request.request_id: x.num_tokens for x in out.scheduled}
        assert got["0"] == want
        assert sum(got.values()) <= budget
        assert sum(r.request_id in got for r in young) == min(3, budget - want)


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
