"""prompt_logprobs (vLLM's): each prompt token's logprob given the tokens before it, against HF transformers."""
from __future__ import annotations

import random

import pytest
import torch
import transformers

from pagellm import LLM, SamplingParams
from tests.conftest import pool_is_whole


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


def _hf_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """[L - 1, V]: row j - 1 is the distribution over prompt token j."""
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)


def _check(plp, prompt: list[int], ref: torch.Tensor, k: int, tol: float = 1e-4) -> None:
    assert len(plp) == len(prompt) and plp[0] is None
    for j in range(1, len(prompt)):
        row, entry, tok = ref[j - 1], plp[j], prompt[j]
        assert next(iter(entry)) == tok  # the prompt's own token first
        assert entry[tok].logprob == pytest.approx(row[tok].item(), abs=tol)
        assert entry[tok].rank == int((row > row[tok]).sum()) + 1
        top = row.topk(k)
        assert set(entry) == {tok} | set(top.indices.tolist())
        for rank, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert entry[t].logprob == pytest.approx(v, abs=tol)
            assert entry[t].rank == (rank if t != tok else entry[tok].rank)


def test_prompt_logprobs_match_hf(tiny):
    """In chunks (a 64-token budget), beside requests without them, again where the prefix cache holds the prompt
    (it computes it anyway), and for n = 2 (once, from the first choice)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    llm = LLM(model=tiny, dtype="float32", kv_cache_memory="32MiB", max_num_batched_tokens=64,
              enable_prefix_caching=True)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 100, 150, 2)]
    with_lp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    without = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts] * 2, [with_lp] * 4 + [without] * 4,
                            use_tqdm=False)
        for out, p in zip(outs[:4], prompts):
            _check(out.prompt_logprobs, p, _hf_logprobs(hf, p), 2)
        assert all(o.prompt_logprobs is None for o in outs[4:])
        assert [o.outputs[0].token_ids for o in outs[:4]] == [o.outputs[0].token_ids for o in outs[4:]]
    assert llm.llm_engine.kv_manager.prefix_hits > 0  # (the requests without prompt logprobs hit the cache)
    two = llm.generate({"prompt_token_ids": prompts[1]}, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=4,
                                                                         prompt_logprobs=0), use_tqdm=False)[0]
    assert len(two.outputs) == 2
    _check(two.prompt_logprobs, prompts[1], _hf_logprobs(hf, prompts[1]), 0)
    assert pool_is_whole(llm)


def test_prompt_logprobs_survive_preemption(tiny):
    """A pool too small for all requests: some are preempted and recompute their prompts; each prompt token still
    gets exactly one entry, HF's."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    per_block = LLM(model=tiny, dtype="float32", block_size=16, kv_cache_memory="1MiB").llm_engine.kv_manager
    per_block = (1 << 20) // per_block.num_blocks
    llm = LLM(model=tiny, dtype="float32", kv_cache_memory=24 * per_block, block_size=16, max_num_batched_tokens=64)
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(40, 120))] for _ in range(8)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, prompt_logprobs=1),
                        use_tqdm=False)
    assert llm.llm_engine.stats.num_preemptions > 0
    for out, p in zip(outs, prompts):
        _check(out.prompt_logprobs, p, _hf_logprobs(hf, p), 1)
    assert pool_is_whole(llm)


def test_bf16_prompt_logprobs_from_the_fused_loop(gguf_path):
    """The default model in bf16 (the C++ layer loop, whose last layer keeps only the rows read): close to fp32's."""
    text = ("The paged attention algorithm stores keys and values in fixed-size blocks, and a block table maps each "
            "sequence's logical blocks to physical ones, so memory is allocated on demand.")
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    got = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(dtype=dtype, kv_cache_memory="128MiB", max_num_batched_tokens=32)
        out = llm.generate(text, params, use_tqdm=False)[0]
        got[dtype] = out.prompt_logprobs
        assert pool_is_whole(llm)
        del llm
    prompt, f32, b16 = out.prompt_token_ids, got["float32"], got["bfloat16"]
    assert len(b16) == len(prompt) and b16[0] is None
    diffs = [abs(b16[j][prompt[j]].logprob - f32[j][prompt[j]].logprob) for j in range(1, len(prompt))]
    top1 = [list(b16[j])[-1] == list(f32[j])[-1] for j in range(1, len(prompt))]  # (the top-1 comes last)
    # (on Zen 4's int8 linears: mean 0.13, top-1 agreement 94%; rows out of place would agree at random)
    assert sum(diffs) / len(diffs) < 0.3 and sum(top1) >= 0.85 * len(top1), (diffs, top1)


def test_bad_prompt_logprobs_names_the_field():
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs must be an integer in"):
            SamplingParams(prompt_logprobs=bad)
