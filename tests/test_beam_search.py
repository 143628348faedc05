"""Beam search returns HF transformers' top beam (num_beams=4, greedy beams) on SmolLM2 in fp32."""
from __future__ import annotations

import pytest
import torch
import transformers

from pagellm import LLM, BeamSearchParams
from tests.conftest import pool_is_whole

PROMPTS = ["The capital of France is", "Once upon a time, there was a", "def add(a, b):",
           "The three primary colors are"]
MAX_NEW = 12


def _first_eos_cut(tokens: list[int], eos: int) -> list[int]:
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.fixture(scope="module")
def hf_and_prompts(gguf_path):
    tok = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32,
        quantization_config=transformers.GgufConfig(dequantize=True)).eval()
    return hf, tok, [tok.encode(p) for p in PROMPTS]


@pytest.mark.parametrize("early_stopping, prefix_caching", [(False, True), (True, False)])
def test_top_beam_matches_hf(hf_and_prompts, gguf_path, early_stopping, prefix_caching):
    hf, tok, prompts = hf_and_prompts
    expected = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=4, do_sample=False,
                              max_new_tokens=MAX_NEW, length_penalty=1.0, early_stopping=early_stopping,
                              num_return_sequences=1, pad_token_id=tok.eos_token_id)
            expected.append(_first_eos_cut(out[0, len(p):].tolist(), tok.eos_token_id))
    # 16-token blocks: the beams share whole blocks and write into partial ones
    llm = LLM(model=str(gguf_path), dtype="float32", block_size=16, kv_cache_memory="256MiB",
              enable_prefix_caching=prefix_caching)
    params = BeamSearchParams(beam_width=4, max_tokens=MAX_NEW, length_penalty=1.0, early_stopping=early_stopping)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    got = [o.sequences[0].tokens[len(p):] for o, p in zip(outs, prompts)]
    assert got == expected
    for o in outs:
        assert len(o.sequences) == 4
        scores = [s.score for s in o.sequences]
        assert scores == sorted(scores, reverse=True)
    # each beam is a fork of the request it came from: a step computes one token a beam, the prompts once
    engine = llm.llm_engine
    assert engine.stats.prompt_tokens_computed <= sum(map(len, prompts)) + 4 * MAX_NEW * len(prompts)
    assert engine.kv_manager.num_copies > 0  # beams that came from one beam copy its partial block
    assert pool_is_whole(llm) and not engine.scheduler.kept


def test_beam_search_params_are_validated():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")


def test_beam_search_errors_leave_the_pool_whole(tiny_checkpoint, monkeypatch):
    llm = LLM(model=str(tiny_checkpoint("llama")), dtype="float32", block_size=8, max_model_len=64,
              kv_cache_memory="4MiB")
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="max_tokens=8 plus a prompt's 60 tokens exceeds max_model_len=64"):
        llm.beam_search([{"prompt_token_ids": [5] * 60}], BeamSearchParams(beam_width=2, max_tokens=8))
    fork, calls = engine.fork_request, []

    def failing_fork(*args, **kwargs):  # the fifth fork fails, mid-step, with beams running and kept
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("interrupted")
        return fork(*args, **kwargs)

    monkeypatch.setattr(engine, "fork_request", failing_fork)
    with pytest.raises(RuntimeError, match="interrupted"):
        llm.beam_search([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9] * 11}],
                        BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))
    assert len(calls) == 5 and not engine.scheduler.kept and not engine.has_unfinished_requests() and pool_is_whole(llm)


def test_beam_search_in_a_small_pool_finds_the_same_beams(tiny_checkpoint):
    """In a pool that holds a few beams at a time (kept blocks give way, waiting forks give theirs back and compute
    their tokens again), beam search returns what it returns in a roomy pool."""
    prompts = [{"prompt_token_ids": [(i * 17 + k) % 400 + 3 for i in range(11 + 5 * k)]} for k in range(3)]
    params = BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)
    results = []
    for blocks in (512, 7):  # 7 blocks of 8 tokens: a beam (up to 31 tokens) fits, not the whole search
        llm = LLM(model=str(tiny_checkpoint("llama")), dtype="float32", block_size=8, max_model_len=64,
                  kv_cache_memory=blocks * 8 * 512)
        outs = llm.beam_search(prompts, params)
        assert pool_is_whole(llm) and not llm.llm_engine.scheduler.kept
        assert (llm.llm_engine.scheduler.num_preemptions > 0) == (blocks == 7)
        results.append(outs)
    roomy, small = results
    for a, b in zip(roomy, small):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert [s.score for s in a.sequences] == pytest.approx([s.score for s in b.sequences], abs=1e-4)
