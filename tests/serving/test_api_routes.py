"""The routes against the offline engine: plain and streamed completions and chats, 32 concurrent streams, and
clients that go away mid-request."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import pagellm
from pagellm.model_executor.default_model import DEFAULT_MODEL_NAME

from .harness import (API_KEY, CAPITAL_PROMPT, CHAT_CONTENT, CONCURRENT_MAX_TOKENS, CONCURRENT_PROMPTS, MAX_MODEL_LEN,
                      STORY_PROMPT, assert_error_shape, greedy, scrape, val, wait_idle)


# ------------------------------------------------------------------------------------------------ simple routes
def test_health_version_models(server, http, client):
    assert httpx.get(f"{server.base}/health").status_code == 200  # not behind the API key
    assert http.get("/version").json() == {"version": pagellm.__version__}
    models = client.models.list().data
    assert len(models) == 1
    assert models[0].id == DEFAULT_MODEL_NAME and models[0].owned_by == "pagellm"
    raw = http.get("/v1/models").json()
    assert raw["object"] == "list" and raw["data"][0]["max_model_len"] == MAX_MODEL_LEN


def test_tokenize_detokenize_round_trip(http, llm):
    text = "PagedAttention stores the KV cache in blocks: 16 tokens each, héllo wörld!"
    r = http.post("/tokenize", json={"prompt": text})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == llm.get_tokenizer().encode(text)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    back = http.post("/detokenize", json={"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    # chat messages are tokenized through the template, as /v1/chat/completions sees them
    msgs = [{"role": "user", "content": "Hi there"}]
    chat = http.post("/tokenize", json={"messages": msgs}).json()
    expected = llm.chat(msgs, greedy(1), use_tqdm=False)[0].prompt_token_ids
    assert chat["tokens"] == expected
    assert_error_shape(http.post("/detokenize", json={"tokens": [10 ** 9]}), 400, "tokens")


def test_generate_route_matches_offline(http, ref):
    r = http.post("/generate", json={"prompt": CAPITAL_PROMPT, "temperature": 0, "max_tokens": 8})
    assert r.status_code == 200
    assert r.json() == {"text": ref["capital8"].outputs[0].text}


# ------------------------------------------------------------------------------------------------ 1. greedy == offline
def test_completion_sync_matches_offline(client, ref, model_name):
    out = ref["story16"]
    r = client.completions.create(model=model_name, prompt=STORY_PROMPT, temperature=0, max_tokens=16)
    assert r.object == "text_completion" and r.model == model_name and len(r.choices) == 1
    assert r.choices[0].text == out.outputs[0].text
    assert r.choices[0].finish_reason == out.outputs[0].finish_reason
    n_prompt, n_gen = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, n_gen,
                                                                                       n_prompt + n_gen)


def test_completion_stream_matches_offline(client, ref, model_name):
    out = ref["story16"]
    stream = client.completions.create(model=model_name, prompt=STORY_PROMPT, temperature=0, max_tokens=16,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1  # really streamed
    assert "".join(c.choices[0].text for c in text_chunks) == out.outputs[0].text
    assert text_chunks[-1].choices[0].finish_reason == out.outputs[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert all(c.usage is None for c in text_chunks)
    last = chunks[-1]  # the stream ends at [DONE]; the chunk just before it carries usage only
    assert last.choices == [] and last.usage is not None
    n_prompt, n_gen = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (
        n_prompt, n_gen, n_prompt + n_gen)
    assert len({c.id for c in chunks}) == 1


def test_stream_sse_framing(http, ref):
    """Raw SSE: every event is ``data: <json>``, the usage chunk comes right before ``data: [DONE]``."""
    body = {"prompt": "Hello", "temperature": 0, "max_tokens": 6, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {"prompt_tokens": 1, "completion_tokens": 6,
                                                                    "total_tokens": 7}
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == ref["hello6"].outputs[0].text


def test_chat_sync_matches_offline(client, ref, model_name):
    out = ref["chat16"]
    r = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": CHAT_CONTENT}],
                                       temperature=0, max_tokens=16)
    assert r.object == "chat.completion" and len(r.choices) == 1
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == out.outputs[0].text
    assert r.choices[0].finish_reason == out.outputs[0].finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(out.prompt_token_ids),
                                                                   len(out.outputs[0].token_ids))


def test_chat_stream_matches_offline(client, ref, model_name):
    out = ref["chat16"]
    stream = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": CHAT_CONTENT}],
                                            temperature=0, max_tokens=16, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1
    assert text_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in text_chunks) == out.outputs[0].text
    assert text_chunks[-1].choices[0].finish_reason == out.outputs[0].finish_reason
    last = chunks[-1]
    assert last.object == "chat.completion.chunk" and last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(out.prompt_token_ids),
                                                                         len(out.outputs[0].token_ids))


# ------------------------------------------------------------------------------------------------ 2. concurrency
def test_32_concurrent_streaming_clients_are_batched(server, http, ref, model_name):
    prompts = CONCURRENT_PROMPTS
    assert len(set(prompts)) == 32
    max_tokens = CONCURRENT_MAX_TOKENS
    refs = [ref[f"concurrent{i}"] for i in range(32)]

    async def main():
        stop = asyncio.Event()
        seen_running: list[float] = []

        async def poll_metrics(ac: httpx.AsyncClient):
            while not stop.is_set():
                r = await ac.get("/metrics")
                for fam in text_string_to_metric_families(r.text):
                    if fam.name == "pagellm:num_requests_running":
                        seen_running.append(fam.samples[0].value)
                try:
                    await asyncio.wait_for(stop.wait(), timeout=0.02)
                except asyncio.TimeoutError:
                    pass

        async def one(ac_openai: openai.AsyncOpenAI, prompt: str):
            stream = await ac_openai.completions.create(model=model_name, prompt=prompt, temperature=0,
                                                        max_tokens=max_tokens, stream=True,
                                                        stream_options={"include_usage": True})
            text, usage, n_chunks = "", None, 0
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                    n_chunks += 1
                if chunk.usage is not None:
                    usage = chunk.usage
            return text, usage, n_chunks

        async with openai.AsyncOpenAI(base_url=f"{server.base}/v1", api_key=API_KEY, max_retries=0,
                                      timeout=90.0) as ac_openai, \
                httpx.AsyncClient(base_url=server.base, timeout=10.0) as ac:
            poller = asyncio.create_task(poll_metrics(ac))
            try:
                results = await asyncio.wait_for(asyncio.gather(*(one(ac_openai, p) for p in prompts)), 90.0)
            finally:
                stop.set()
                await asyncio.wait_for(poller, 10.0)
        return results, seen_running

    results, seen_running = asyncio.run(main())
    for prompt, out, (text, usage, n_chunks) in zip(prompts, refs, results):
        assert text == out.outputs[0].text, prompt
        assert usage is not None and usage.prompt_tokens == len(out.prompt_token_ids)
        assert usage.completion_tokens == len(out.outputs[0].token_ids) and n_chunks >= 1
    # The engine really batched them: several requests were in the running batch at once.
    assert seen_running, "no /metrics scrape succeeded"
    assert max(seen_running) > 1, f"num_requests_running never exceeded 1: {sorted(set(seen_running))}"
    log = server.log.read_text(errors="replace")
    assert "running: " in log  # the periodic stats line (--log-interval 1) is there too


# ------------------------------------------------------------------------------------------------ 3. disconnect
def test_client_disconnect_mid_stream_aborts(server, http):
    before = wait_idle(http)
    body = {"prompt": "Tell me a very long story about a dragon.", "max_tokens": 1500, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.base, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=30.0) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    chunk = json.loads(line[len("data: "):])
                    assert chunk["choices"][0]["finish_reason"] is None
                    got += 1
                    if got == 3:
                        break
            mid = scrape(http)
            assert val(mid, "pagellm:num_requests_running") == 1  # it is generating
            assert val(mid, "pagellm:kv_cache_usage_perc") > 0
        # leaving the blocks closes the response and the connection mid-stream
    t0 = time.monotonic()
    after = wait_idle(http, timeout=20.0)  # KV usage back to 0 long before 1500 tokens could be generated
    assert time.monotonic() - t0 < 20.0
    assert val(after, "pagellm:kv_cache_usage_perc") == 0.0
    assert (val(after, "pagellm:request_success_total", finished_reason="abort")
            - val(before, "pagellm:request_success_total", finished_reason="abort")) == 1
    assert (val(after, "pagellm:request_success_total", finished_reason="length")
            == val(before, "pagellm:request_success_total", finished_reason="length"))
    generated = val(after, "pagellm:generation_tokens_total") - val(before, "pagellm:generation_tokens_total")
    assert 3 <= generated < 1500


def test_client_disconnect_non_streaming_aborts(server, http):
    before = wait_idle(http)
    body = {"prompt": "Tell me a long story.", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                   timeout=1.5)
    after = wait_idle(http, timeout=20.0)
    assert (val(after, "pagellm:request_success_total", finished_reason="abort")
            - val(before, "pagellm:request_success_total", finished_reason="abort")) == 1
