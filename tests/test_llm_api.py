"""The offline API on the default model: strings, chat, stop strings, bad input next to good requests, CLI."""
from __future__ import annotations

import json
import subprocess
import sys
import pathlib

import pytest
import torch

from pagellm import LLM, SamplingParams
from tests.conftest import pool_is_whole

WORKLOAD_16 = pathlib.Path(__file__).resolve().parents[2] / "shared" / "workloads" / "workload_16.json"


@pytest.fixture(scope="module")
def llm(gguf_path):
    return LLM(model=None, dtype="float32", kv_cache_memory="256MiB", max_model_len=2048)


def test_string_prompts_keep_input_order_and_fields(llm):
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Hello"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    tok = llm.get_tokenizer()
    for o in outs:
        assert o.prompt_token_ids == tok.encode(o.prompt)
        c = o.outputs[0]
        assert c.finish_reason in ("stop", "length") and 1 <= len(c.token_ids) <= 8
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    assert "Paris" in outs[0].outputs[0].text
    assert pool_is_whole(llm)


def test_chat_applies_the_template(llm):
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    expected = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert out.prompt == expected and "<|im_start|>assistant" in out.prompt
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # the model ends its turn with <|im_end|> (EOS)


def test_chat_template_kwargs_and_template_errors(llm):
    import copy

    from pagellm.entrypoints.chat_utils import render_chat

    msgs = [{"role": "user", "content": "Hi"}]
    template = "{{ greeting }}, {{ messages[0]['content'] }}!"
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False, chat_template=template,
                   chat_template_kwargs={"greeting": "Hello"})[0]
    assert out.prompt == "Hello, Hi!"
    tok = copy.deepcopy(llm.get_tokenizer())
    with pytest.raises(ValueError, match=r"^chat_template_kwargs: add_generation_prompt, tokenize cannot be set"):
        render_chat(tok, msgs, True, chat_template_kwargs={"tokenize": True, "add_generation_prompt": False})
    with pytest.raises(ValueError, match=r"^chat_template_kwargs: conversations, messages cannot be set"):
        render_chat(tok, msgs, True, chat_template_kwargs={"messages": [], "conversations": []})
    with pytest.raises(ValueError, match=r"^messages: the model's chat template rejected them"):  # a TypeError
        render_chat(tok, msgs, chat_template="{{ messages[0]['content'] + 1 }}")
    tok.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(ValueError, match=r"^messages: the model's chat template rejected them: Conversation roles"):
        render_chat(tok, msgs)
    tok.chat_template = None
    with pytest.raises(ValueError, match=r"^messages: this model has no chat template"):
        render_chat(tok, msgs)
    assert render_chat(tok, msgs, chat_template=template, chat_template_kwargs={"greeting": "Yo"}) == "Yo, Hi!"


def test_stop_strings_across_token_boundaries(llm):
    prompt = "Count: 1, 2, 3, 4, 5, 6,"
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    text = base.text
    assert len(text) > 10
    stop = text[4:9]  # a piece of text that may span several tokens
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, stop=[stop]), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[:text.index(stop)]
    inc = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, stop=stop,
                                              include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert inc.text == text[:text.index(stop) + len(stop)]


def test_bad_input_is_rejected_and_other_requests_still_finish(llm):
    engine = llm.llm_engine
    good_prompts = [{"prompt_token_ids": list(range(20, 60))}, {"prompt_token_ids": list(range(100, 110))}]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(good_prompts, params, use_tqdm=False)]

    ids = [engine.add_request(prompt_token_ids=p["prompt_token_ids"], sampling_params=params) for p in good_prompts]
    engine.step()  # the good requests are running when the bad ones arrive
    vocab = engine.vocab_size
    bad = [
        (dict(prompt_token_ids=[]), "empty"),
        (dict(prompt_token_ids=[5] * 2048), "max_model_len"),
        (dict(prompt_token_ids=[5, vocab]), "vocabulary"),
        (dict(prompt_token_ids=[5, -1]), "vocabulary"),
        (dict(prompt_token_ids=[5] * 100, sampling_params=SamplingParams(max_tokens=2000)), "max_tokens"),
        (dict(prompt_token_ids=[5, 6.0]), "token id 6.0 is not an integer"),
        # a stop token the model cannot produce: min_tokens' mask indexed past the logits (the step loop died)
        (dict(prompt_token_ids=[5, 6], sampling_params=SamplingParams(min_tokens=1, stop_token_ids=[vocab])),
         "stop_token_ids: token id"),
    ]
    for kwargs, match in bad:
        with pytest.raises(ValueError, match=match):
            engine.add_request(**kwargs)
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request(prompt_token_ids=[5, 6], sampling_params=SamplingParams(top_p=2.0))
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    assert [done[i] for i in ids] == expected
    assert pool_is_whole(llm)


def test_numpy_and_torch_token_ids_are_taken(llm):
    import numpy as np

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = list(range(40, 60))
    want = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids
    for p in (np.array(ids), torch.tensor(ids), np.array(ids, dtype=np.int32)):
        out = llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0]
        assert out.prompt_token_ids == ids and all(type(t) is int for t in out.prompt_token_ids)
        assert out.outputs[0].token_ids == want
    assert pool_is_whole(llm)


def test_generate_rejects_a_bad_prompt_before_running_any(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": []}], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert pool_is_whole(llm)


def test_abort_frees_blocks(llm):
    engine = llm.llm_engine
    rid = engine.add_request(prompt_token_ids=list(range(30, 330)), sampling_params=SamplingParams(max_tokens=50))
    engine.step()
    assert engine.kv_manager.pool.num_used_blocks > 0
    assert engine.abort_request(rid)
    assert not engine.has_unfinished_requests()
    assert pool_is_whole(llm)


def test_request_that_exceeds_the_whole_pool_is_rejected(gguf_path):
    # 4 blocks of 16 tokens
    small = LLM(model=str(gguf_path), dtype="float32", block_size=16, kv_cache_memory=4 * 737280)
    with pytest.raises(ValueError, match="KV blocks"):
        small.generate({"prompt_token_ids": list(range(40, 100))}, SamplingParams(max_tokens=10), use_tqdm=False)
    out = small.generate({"prompt_token_ids": list(range(40, 60))}, SamplingParams(max_tokens=10), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1
    assert small.llm_engine.stats.kv_cache_bytes == 4 * 737280


def test_cuda_kv_budget_and_its_errors():
    """The default KV budget on CUDA (the arithmetic; the device's figures are its arguments): the device's share
    less what the process holds; an engine still alive in the process, or other processes' memory, gets an error
    that says which, with the way out."""
    from pagellm.config import cuda_kv_budget

    gib = 2**30
    assert cuda_kv_budget(100 * gib, 95 * gib, 0.9, 5 * gib) == int(100 * gib * 0.9) - 5 * gib
    with pytest.raises(ValueError, match=r"allocated 92\.0 GiB .* leaves nothing for the KV cache: free the other "
                                         r"engine \(del llm\)"):
        cuda_kv_budget(100 * gib, 8 * gib, 0.9, 92 * gib)  # the first engine's cache is still allocated
    with pytest.raises(ValueError, match=r"only 30\.0 GiB can be allocated .* to at most 0\.31,") as e:
        cuda_kv_budget(100 * gib, 30 * gib, 0.9, 1 * gib)  # another process holds most of the device
    assert "gpu_memory_utilization=0.9" in str(e.value)
    assert cuda_kv_budget(100 * gib, 30 * gib, 0.31, 1 * gib) == int(100 * gib * 0.31) - 1 * gib


def test_bf16_long_prompt_in_chunks_matches_one_chunk(gguf_path):
    # bf16 runs the CPU kernels: a prompt longer than the token budget is prefilled in chunks, the first of which
    # sample nothing (an LM head over zero rows) and attend through the AMX prefill kernel after a cached context
    prompt = {"prompt_token_ids": [(i * 37) % 4000 + 100 for i in range(300)]}
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = []
    for budget in (64, 2048):
        llm = LLM(model=str(gguf_path), dtype="bfloat16", kv_cache_memory="64MiB", max_num_batched_tokens=budget)
        outs.append(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)
        assert pool_is_whole(llm)
    assert len(outs[0]) == 8 and outs[0] == outs[1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_cache_left_unwritten_never_leaks_into_attention(gguf_path, dtype):
    # With the CPU kernels the KV cache is allocated without zero-filling (ModelRunner): the kernels must never
    # read a slot no token was written to. Poison every slot with NaN before generating: prompts of mixed lengths,
    # prefilled in chunks (budget 64) and decoded together, must give the tokens of an engine whose cache is
    # fresh, untouched memory (zero pages).
    prompts = [{"prompt_token_ids": [(i * 31 + j * 7) % 4000 + 100 for j in range(n)]}
               for i, n in enumerate((5, 33, 150, 70))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = []
    for poison in (False, True):
        llm = LLM(model=str(gguf_path), dtype=dtype, kv_cache_memory="32MiB", max_num_batched_tokens=64)
        runner = llm.llm_engine.runner
        if runner.model.backend.needs_zeroed_cache:
            pytest.skip("the CPU kernels are unavailable here (torch reference backend)")
        if poison:
            runner.kv_cache.fill_(float("nan"))
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert pool_is_whole(llm)
    assert all(len(t) == 12 for t in outs[0]) and outs[1] == outs[0]


# Run in a fresh process: there the cache is fresh memory, where in a process that has built and freed engines
# before, the allocator may hand it memory already resident.
_PREFAULT_PROBE = """
import ctypes, json, mmap, sys
from pagellm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="bfloat16", kv_cache_memory="64MiB", kv_cache_prefault=sys.argv[2])
runner = llm.llm_engine.runner
t = runner.kv_cache
libc = ctypes.CDLL(None, use_errno=True)
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
page = mmap.PAGESIZE
lo = t.data_ptr() // page * page
n = (t.data_ptr() + t.numel() * t.element_size() - lo + page - 1) // page
vec = (ctypes.c_ubyte * n)()
assert libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(n * page), vec) == 0, ctypes.get_errno()
resident = sum(v & 1 for v in vec) * page
out = llm.generate([{"prompt_token_ids": list(range(100, 140))}],
                   SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
print(json.dumps({"zeroed": runner.model.backend.needs_zeroed_cache, "resident": resident,
                  "tokens": len(out[0].outputs[0].token_ids), "free": llm.llm_engine.kv_manager.pool.num_free_blocks,
                  "blocks": llm.llm_engine.kv_manager.pool.num_blocks}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux mincore")
def test_kv_cache_prefault_maps_the_first_blocks_only(gguf_path):
    # A CPU cache left unwritten is mapped page by page on first writes; kv_cache_prefault maps the blocks the pool
    # hands out first at start-up: a quarter of a 64 MiB pool here, in every layer's K and V. Without it the
    # pool's pages are not resident until tokens land in it; either way generation works and the pool is whole.
    from pagellm.config import EngineConfig

    mib = 2**20
    resident = {}
    for prefault in ("16MiB", "0"):
        proc = subprocess.run([sys.executable, "-c", _PREFAULT_PROBE, str(gguf_path), prefault], capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        if r["zeroed"]:
            pytest.skip("the CPU kernels are unavailable here (torch reference backend: the cache is zero-filled)")
        assert r["tokens"] == 4 and r["free"] == r["blocks"]
        resident[prefault] = r["resident"]
    assert 16 * mib <= resident["16MiB"] < 24 * mib
    assert resident["0"] < 2 * mib
    for bad in ("lots", -1, True):
        with pytest.raises(ValueError, match="kv_cache_prefault"):
            EngineConfig(kv_cache_prefault=bad)


def test_prefault_kv_cache_maps_only_never_used_blocks(tiny_checkpoint):
    # The server maps the pool's blocks past kv_cache_prefault while idle (LLMEngine.prefault_kv_cache), a chunk
    # a call. It must never write into a block a request has used: here a request holds its blocks mid-generation
    # while every other block gets mapped; its blocks keep their contents and its tokens are those of a run
    # without the prefault.
    path = str(tiny_checkpoint("llama"))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompt = list(range(3, 70))
    llm = LLM(model=path, dtype="float32", block_size=16, kv_cache_memory="4MiB", kv_cache_prefault=0)
    eng, runner = llm.llm_engine, llm.llm_engine.runner
    if runner.model.backend.needs_zeroed_cache:
        pytest.skip("the CPU kernels are unavailable here (torch reference backend: the cache is zero-filled)")
    want = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    pool = eng.kv_manager.pool
    total = pool.num_blocks
    assert runner.mapped_blocks == 0 and 0 < pool.first_unused < total
    rid = eng.add_request(prompt_token_ids=prompt, sampling_params=params)
    for _ in range(3):
        eng.step()
    used = pool.first_unused  # the blocks both requests have been handed so far
    before = runner.kv_cache[:, :, :used].clone()
    calls = 0
    while eng.prefault_kv_cache(runner.bytes_per_block * 3):
        calls += 1
    assert runner.mapped_blocks == total and calls >= (total - used) // 3 - 1
    # bit patterns, not values: slots past a context were never written and hold what the allocator left there,
    # which may read as NaN (unequal to itself)
    assert torch.equal(runner.kv_cache[:, :, :used].view(torch.int32), before.view(torch.int32))
    assert not eng.prefault_kv_cache(2**20), "nothing is left to map"
    got = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id == rid and out.finished:
                got = out.outputs[0].token_ids
    assert got == want and pool_is_whole(llm)


def test_server_loop_maps_the_kv_cache_while_idle(tiny_checkpoint):
    # AsyncLLMEngine's loop maps the cache's unmapped blocks while no request runs (prefault_when_idle), and
    # leaves them with prefault_when_idle=False; requests are served either way.
    import asyncio
    import time

    from pagellm.config import EngineConfig
    from pagellm.engine.async_engine import AsyncLLMEngine

    async def one(engine):
        async for out in engine.generate(None, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                                         prompt_token_ids=list(range(5, 25))):
            last = out
        return last.outputs[0].token_ids

    for idle in (True, False):
        cfg = EngineConfig(model=str(tiny_checkpoint("llama")), dtype="float32", kv_cache_memory="8MiB",
                           kv_cache_prefault=0)
        engine = AsyncLLMEngine(cfg, prefault_when_idle=idle)
        try:
            runner = engine.engine.runner
            if runner.model.backend.needs_zeroed_cache:
                pytest.skip("the CPU kernels are unavailable here (torch reference backend: the cache is zero-filled)")
            total = engine.engine.kv_manager.num_blocks
            deadline = time.monotonic() + 60
            while idle and runner.mapped_blocks < total and time.monotonic() < deadline:
                time.sleep(0.05)
            if not idle:
                time.sleep(0.5)
            assert runner.mapped_blocks == (total if idle else 0)
            assert len(asyncio.run(one(engine))) == 5
        finally:
            engine.shutdown()


def test_server_engine_is_built_on_its_loop_thread(tiny_checkpoint, monkeypatch):
    # AsyncLLMEngine builds its LLMEngine on the loop thread that steps it, so that one thread starts every OpenMP
    # region (with two, libgomp stops spinning between regions: ~20% slower steps, async_engine.py); what building
    # it raises reaches the caller.
    import threading

    from pagellm.config import EngineConfig
    from pagellm.engine import async_engine

    built_on = []
    real = async_engine.LLMEngine

    class Recording(real):
        def __init__(self, config):
            built_on.append(threading.current_thread().name)
            super().__init__(config)

    monkeypatch.setattr(async_engine, "LLMEngine", Recording)
    engine = async_engine.AsyncLLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), dtype="float32",
                                                      kv_cache_memory="8MiB"))
    try:
        assert built_on == ["pagellm-engine"] and engine.is_alive
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="holds no KV block"):
        async_engine.AsyncLLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), kv_cache_memory="1KiB"))


def test_stepping_on_another_thread_warns_once(tiny_checkpoint, caplog):
    # An engine stepped on another thread than the one that built it runs its kernels with a second OpenMP pool,
    # ~20% slower on CPU (async_engine.py): the engine says so, once, and still generates the same tokens.
    import logging
    import threading

    llm = LLM(model=str(tiny_checkpoint("llama")), dtype="float32", kv_cache_memory="8MiB")
    eng = llm.llm_engine
    if eng.config.torch_device.type != "cpu":
        pytest.skip("OpenMP's pools are a CPU matter: the engine warns on CPU only")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = llm.generate([{"prompt_token_ids": list(range(4, 30))}], params, use_tqdm=False)[0].outputs[0].token_ids
    assert "another thread" not in caplog.text
    got = []

    def drive():
        rid = eng.add_request(prompt_token_ids=list(range(4, 30)), sampling_params=params)
        while eng.has_unfinished_requests():
            got.extend(o.outputs[0].token_ids for o in eng.step() if o.request_id == rid and o.finished)

    with caplog.at_level(logging.WARNING, logger="pagellm"):
        for _ in range(2):
            t = threading.Thread(target=drive)
            t.start()
            t.join()
    assert caplog.text.count("stepped on another thread") == 1
    assert got == [want, want]


def test_bf16_cascade_attention_for_a_shared_prefix(gguf_path):
    # 10 requests share a 320-token prefix through the prefix cache: their decode steps attend it once for all
    # (cascade attention, on CPUs with AMX), and the pool is whole after. The kernels' numbers are checked against
    # a dense fp64 attention in test_attention.py; here the greedy tokens must agree with the cascade off except
    # at bf16 near-ties, which these random-token prompts produce (52 of 60 tokens agreed when written; a wrong
    # merge agrees on almost none after the first).
    prefix = [(i * 53) % 4000 + 100 for i in range(320)]
    prompts = [{"prompt_token_ids": prefix + [(i * 7 + j) % 3000 + 200 for j in range(5 + i)]} for i in range(10)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm = LLM(model=str(gguf_path), dtype="bfloat16", kv_cache_memory="64MiB")
    runner = llm.llm_engine.runner
    if not runner.supports_cascade:
        pytest.skip("CPU without AMX")
    used = []  # per step: was a cascade prefix found?
    prepare = runner._prepare

    def spy(so):
        inputs = prepare(so)
        used.append(inputs[2].cascade is not None)
        return inputs
    runner._prepare = spy
    on = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert any(used) and pool_is_whole(llm)
    runner.supports_cascade = False
    used.clear()
    off = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert not any(used) and [len(t) for t in on] == [6] * 10
    assert sum(a == b for x, y in zip(on, off) for a, b in zip(x, y)) >= 48


def test_cli_generate_and_bench(gguf_path, tmp_path):
    run = lambda *args: subprocess.run([sys.executable, "-m", "pagellm", *args], capture_output=True, text=True,  # noqa
                                       timeout=600)
    r = run("generate", "The capital of France is", "--max-tokens", "6", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    if not WORKLOAD_16.exists():
        pytest.skip("shared workloads not present")
    r = run("bench", "throughput", "--workload", str(WORKLOAD_16), "--num-prompts", "4", "--dtype", "bfloat16",
            "--kv-cache-memory", "512MiB")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("engine", "dtype", "requests", "prompt_tokens", "output_tokens", "wall_s", "output_tok_per_s",
                "total_tok_per_s", "peak_rss_mb", "kv_slot_efficiency"):
        assert key in res
    assert res["requests"] == 4 and res["output_tokens"] == 4 * 128 and res["dtype"] == "bfloat16"
    assert 0.9 <= res["kv_slot_efficiency"] <= 1.0
    # without a workload file: vLLM's random dataset from --input-len / --output-len / --num-prompts
    r = run("bench", "throughput", "--input-len", "24", "--output-len", "3", "--num-prompts", "3", "--dtype",
            "bfloat16", "--kv-cache-memory", "256MiB")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert (res["requests"], res["prompt_tokens"], res["output_tokens"]) == (3, 3 * 24, 3 * 3)
    # parallel sampling: n sequences a prompt, the prompt computed once (and its last token once per more sample)
    r = run("bench", "throughput", "--input-len", "24", "--output-len", "3", "--num-prompts", "3", "--n", "4",
            "--temperature", "0.8", "--dtype", "bfloat16", "--kv-cache-memory", "256MiB", "--no-prefix-caching")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert (res["requests"], res["output_tokens"], res["sampling"]["n"]) == (3, 3 * 4 * 3, 4)
    assert res["prompt_tokens_computed"] == 3 * (24 + 3) and "ttft_ms" not in res
    for args, named in ((["--output-len", "3"], "--input-len"),
                        (["--input-len", "8", "--output-len", "3", "--n", "0"], "--n"),
                        (["--input-len", "8", "--output-len", "0"], "--output-len"),
                        (["--workload", str(WORKLOAD_16), "--input-len", "8"], "--input-len")):
        r = run("bench", "throughput", *args)  # refused before the model loads
        assert r.returncode != 0 and named in r.stderr, r.stderr


def test_random_workload_is_fixed_by_its_seed_and_skips_special_tokens(llm):
    from pagellm.entrypoints.bench import random_lengths, random_prompts

    lengths = random_lengths(200, 100, 0.25, seed=3)
    assert lengths == random_lengths(200, 100, 0.25, seed=3) != random_lengths(200, 100, 0.25, seed=4)
    assert min(lengths) >= 75 and max(lengths) <= 125 and len(set(lengths)) > 20
    tok = llm.get_tokenizer()
    prompts = random_prompts(lengths, 3, llm.llm_engine.vocab_size, tok)
    assert [len(p) for p in prompts] == lengths and prompts == random_prompts(lengths, 3, llm.llm_engine.vocab_size,
                                                                              tok)
    used = {t for p in prompts for t in p}
    assert not used & (set(tok.all_special_ids) | set(tok.added_tokens_decoder))
    assert max(used) < llm.llm_engine.vocab_size
    with pytest.raises(ValueError, match="random-range-ratio"):
        random_lengths(4, 100, 1.0, seed=0)

