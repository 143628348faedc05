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


@pytest.mark.parametrize("early_stopping", [False, True])
def test_top_beam_matches_hf(hf_and_prompts, gguf_path, early_stopping):
    hf, tok, prompts = hf_and_prompts
    expected = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=4, do_sample=False,
                              max_new_tokens=MAX_NEW, length_penalty=1.0, early_stopping=early_stopping,
                              num_return_sequences=1, pad_token_id=tok.eos_token_id)
            expected.append(_first_eos_cut(out[0, len(p):].tolist(), tok.eos_token_id))
    # 16-token blocks: these short histories fill whole blocks, which is what the beams share through the cache
    llm = LLM(model=str(gguf_path), dtype="float32", block_size=16, kv_cache_memory="256MiB")
    params = BeamSearchParams(beam_width=4, max_tokens=MAX_NEW, length_penalty=1.0, early_stopping=early_stopping)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    got = [o.sequences[0].tokens[len(p):] for o, p in zip(outs, prompts)]
    assert got == expected
    for o in outs:
        assert len(o.sequences) == 4
        scores = [s.score for s in o.sequences]
        assert scores == sorted(scores, reverse=True)
    assert llm.llm_engine.kv_manager.prefix_hits > 0  # beams share their history through the prefix cache
    assert pool_is_whole(llm)


def test_beam_search_params_are_validated():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")
