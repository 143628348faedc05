"""Shared fixtures: the default GGUF model, tiny random-weight HF checkpoints, and the HF transformers oracle."""
from __future__ import annotations

import pathlib

import pytest
import torch
import transformers

from pagellm.model_executor.default_model import default_model_path

ARCHS = ["llama", "llama3_rope", "mistral", "qwen2", "qwen3"]

# Prompts of mixed lengths (tokenized they span ~5 to ~300 tokens) for the greedy-exactness tests.
_SENT = ("The paged attention algorithm stores keys and values in fixed-size blocks, and a block table maps each "
         "sequence's logical blocks to physical ones. ")
TEXT_PROMPTS = [
    "Hello",
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived",
    "Explain why the sky is blue. " * 3,
    _SENT * 4 + "In summary,",
    "List three prime numbers: 2, 3,",
    _SENT * 12 + "Therefore the main advantage is",
]


@pytest.fixture(scope="session")
def gguf_path() -> pathlib.Path:
    return default_model_path(fetch=True)


def tiny_config(arch: str):
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "llama3_rope":
        return transformers.LlamaConfig(**common, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 128})
    if arch == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32)
    raise ValueError(arch)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """arch -> directory holding a random-weight fp32 checkpoint saved with save_pretrained (cached)."""
    made: dict[str, pathlib.Path] = {}

    def make(arch: str) -> pathlib.Path:
        if arch not in made:
            torch.manual_seed(1234)
            cfg = tiny_config(arch)
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
            # Random init at std 0.02 gives near-uniform logits; widen the weights so greedy picks are decisive.
            with torch.no_grad():
                for p in model.parameters():
                    if p.dim() > 1:
                        p.normal_(0, 0.3)
            d = tmp_path_factory.mktemp(f"tiny_{arch}")
            model.save_pretrained(d, safe_serialization=True)
            made[arch] = d
        return made[arch]

    return make


@pytest.fixture(scope="session")
def fp32_reference(gguf_path):
    """The default model's fp32 greedy continuations (24 tokens) of TEXT_PROMPTS: (prompt ids, continuations), the
    reference of the teacher-forced agreement tests (pagellm bench agreement's measure)."""
    from pagellm import LLM, SamplingParams

    ref = LLM(model=str(gguf_path), dtype="float32", kv_cache_memory="64MiB")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = ref.generate(TEXT_PROMPTS, params, use_tqdm=False)
    assert ref.llm_engine.model.linear_kernels == "torch"  # fp32: plain GEMMs, as HF
    return [o.prompt_token_ids for o in outs], [o.outputs[0].token_ids for o in outs]


def teacher_forced_agreement(llm, reference) -> float:
    """The share of the reference's continuation tokens that llm's top-1 matches, fed the reference's tokens."""
    from pagellm.entrypoints.bench_agreement import teacher_forced_top1

    ids, conts = reference
    hits = sum(p == c for i, cont in zip(ids, conts)
               for p, c in zip(teacher_forced_top1(llm.llm_engine, list(i) + list(cont), len(i)), cont))
    return hits / sum(map(len, conts))


def pool_is_whole(llm) -> bool:
    """After every request has ended, every block is free (or cached and evictable) and unreferenced."""
    pool = llm.llm_engine.kv_manager.pool
    return pool.num_free_blocks == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int, eos: int | None) -> list[list[int]]:
    """HF transformers greedy generate, one prompt at a time (no padding), fp32: the oracle."""
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs
