"""The C++ layer loop (csrc/decoder_cpu.cpp) against the Python one it replaces in bf16, on CPUs with AMX, or with
AVX-512 or AVX2 and FMA (the FMA linear kernel's paths).

Both call the same kernels with the same routing, so every logprob must be bit-identical, step for step, across
the paths a step can take: decode rows, short chunks (paged kernel), longer chunks (AMX prefill kernel), chunks
over AMX_MAX_ROWS lowered to 512 (oneDNN), sliding windows, biases (q/k/v, o, MLP), and cascade attention over a
shared prefix.
"""
from __future__ import annotations

import pytest
import torch
import transformers

from pagellm import LLM, SamplingParams
from pagellm.model_executor.layers import linear
from pagellm.model_executor.models import llama

from conftest import pool_is_whole

COMMON = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)  # head_dim 32: the smallest the AMX attention kernels take
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    "mistral_window": lambda: transformers.MistralConfig(**COMMON, sliding_window=40),
    "qwen2_bias": lambda: transformers.Qwen2Config(**COMMON),
    "llama_all_biases": lambda: transformers.LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made = {}

    def make(arch: str):
        if arch not in made:
            torch.manual_seed(7)
            model = transformers.AutoModelForCausalLM.from_config(CONFIGS[arch](), dtype=torch.float32)
            with torch.no_grad():
                for p in model.parameters():
                    p.normal_(0, 0.3 if p.dim() > 1 else 0.5)  # decisive logits; non-zero biases for qwen2
            made[arch] = tmp_path_factory.mktemp(arch)
            model.save_pretrained(made[arch], safe_serialization=True)
        return str(made[arch])

    return make


class CountingDecoder:
    """The C++ decoder, with each forward call recorded."""

    def __init__(self, decoder, calls: list) -> None:
        self.decoder, self.calls = decoder, calls

    def bind_cache(self, *args):
        return self.decoder.bind_cache(*args)

    def forward(self, *args):
        self.calls.append(args[0].shape[0])
        return self.decoder.forward(*args)


def run(path: str, fused: bool, prompts, params, prune: bool = False, **kw):
    llm = LLM(model=path, dtype="bfloat16", kv_cache_memory="32MiB", **kw)
    model = llm.llm_engine.runner.model
    if model.decoder is None:
        pytest.skip("no C++ decoder here (CPU without AMX-BF16, AVX-512 or AVX2 with FMA)")
    calls = []
    if fused:  # count the steps it runs, so a test cannot pass by never taking it
        model.decoder = CountingDecoder(model.decoder, calls)
    else:
        model.decoder = None
    # The Python loop has no last-layer pruning; held bit-equal to it, the C++ loop runs without it too
    model.prune_last_layer = prune
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert pool_is_whole(llm)
    assert not fused or calls
    return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs]


def token_prompts(lengths, step: int) -> list[dict]:
    return [{"prompt_token_ids": [(i * step + n) % 500 + 3 for i in range(n)]} for n in lengths]


CHUNKED = dict(enable_prefix_caching=False, max_num_batched_tokens=1024)


@pytest.mark.parametrize("amx_max_rows", [None, 512], ids=["amx", "onednn_over_512"])
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_fused_layers_equal_the_python_loop(checkpoint, arch, amx_max_rows, monkeypatch):
    # prompts of 700 (over 512 rows in one chunk: oneDNN when AMX_MAX_ROWS is 512), 150, 33, 20 and 1 tokens, then
    # decode steps mixed with the later chunks; logprobs (not only tokens) must be identical
    if amx_max_rows is not None:
        monkeypatch.setattr(linear, "AMX_MAX_ROWS", amx_max_rows)
        monkeypatch.setattr(llama, "AMX_MAX_ROWS", amx_max_rows)
    lengths = (700, 150, 33, 20, 1)
    prompts = token_prompts(lengths, 31)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    path = checkpoint(arch)
    fused, loop = run(path, True, prompts, params, **CHUNKED), run(path, False, prompts, params, **CHUNKED)
    assert [len(t) for t, _ in fused] == [12] * len(lengths)
    assert fused == loop


@pytest.mark.parametrize("arch", ["llama", "mistral_window"])
def test_last_layer_pruning_keeps_the_outputs(checkpoint, arch):
    # In prefill steps the C++ loop's last layer computes attention, O and the MLP only for the rows that get
    # logits. A 1,500-token prompt over a 1,024-token budget: its first chunk samples nothing (no row kept).
    # Other kernels then handle the kept rows (the paged kernel, the AMX linear), so bf16 logprobs move by
    # rounding only; the greedy tokens (decisive logits here) stay.
    prompts = token_prompts((1500, 700, 150, 33, 1), 29)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
    path = checkpoint(arch)
    pruned = run(path, True, prompts, params, prune=True, **CHUNKED)
    full = run(path, True, prompts, params, **CHUNKED)
    assert [t for t, _ in pruned] == [t for t, _ in full]
    for (_, lp_pruned), (_, lp_full) in zip(pruned, full):
        for a, b in zip(lp_pruned, lp_full):
            assert [t for t, _ in a] == [t for t, _ in b]
            assert all(abs(x.logprob - y.logprob) < 0.1 for (_, x), (_, y) in zip(a, b))


def test_fused_cascade_equals_the_python_loop(checkpoint):
    # 10 requests behind a shared 288-token prefix (prefix cache on): their decode steps take cascade attention
    prefix = [(i * 53) % 500 + 3 for i in range(288)]
    prompts = [{"prompt_token_ids": prefix + [(i * 7 + j) % 400 + 50 for j in range(3 + i)]} for i in range(10)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    path = checkpoint("llama")
    llm = LLM(model=path, dtype="bfloat16", kv_cache_memory="32MiB")
    runner = llm.llm_engine.runner
    if runner.model.decoder is None or not runner.supports_cascade:
        pytest.skip("CPU without AMX-BF16")
    runner.model.prune_last_layer = False  # bit-equal to the Python loop (see run)
    prepare, used = runner._prepare, []

    def spy(so):
        inputs = prepare(so)
        used.append(inputs[2].cascade is not None)
        return inputs
    runner._prepare = spy
    fused = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert any(used)
    loop = run(path, False, prompts, params)
    assert [(t, [sorted(d.items()) for d in lp]) for t, lp in fused] == loop


def test_no_fused_decoder_where_it_does_not_apply(tiny_checkpoint):
    # Qwen3's per-head q/k norms and fp32 keep the Python loop (fp32 stays HF's exact GEMMs)
    for arch, dtype in (("qwen3", "bfloat16"), ("llama", "float32")):
        llm = LLM(model=str(tiny_checkpoint(arch)), dtype=dtype, kv_cache_memory="8MiB")
        assert llm.llm_engine.runner.model.decoder is None
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3


def test_greedy_batches_take_the_heads_argmax_kernel(checkpoint):
    # a plain greedy batch gets its tokens from the LM head's argmax kernel (AMX's, or the int8 screen; no logits):
    # the same tokens as the logits' argmax, step for step; a batch asking for logprobs still gets logits
    from pagellm.model_executor.layers.linear import CPULinear

    prompts = token_prompts((40, 9, 3, 17, 1), 13)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    llm = LLM(model=checkpoint("llama"), dtype="bfloat16", kv_cache_memory="32MiB")
    head = llm.llm_engine.runner.model.fast_lm_head
    if head is None or (head.kernels.amx_argmax is None and head.screen is None):
        pytest.skip("CPU without AMX-BF16, and no int8 screen for this head")
    taken = []
    head.argmax = lambda x: taken.append(CPULinear.argmax(head, x)) or taken[-1]
    fused = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    steps = len(taken)
    assert steps >= 10 and all(t is not None for t in taken)
    llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=2), use_tqdm=False)
    assert len(taken) == steps  # logprobs need the logits: the head's argmax is not asked for
    head.argmax = lambda x: None  # the logits and the sampler's argmax
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert fused == plain and all(len(t) == 10 for t in fused)
    assert pool_is_whole(llm)
