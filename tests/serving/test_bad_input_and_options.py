"""Bad requests (status, error shape, the engine unharmed), auth and body limits, /metrics, logprobs, n choices
and stop strings."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from .harness import (API_KEY, CAPITAL_PROMPT, CHAT_CONTENT, COUNT_PROMPT, SEED, SEED_PROMPT, assert_error_shape,
                      greedy, val, wait_idle)


# ------------------------------------------------------------------------------------------------ 4. errors
LONG_IDS = [100] * 3000  # > max_model_len 2048

BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "Hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": "x"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"temperature": 0}, 400, "prompt"),  # missing required field
    ("/v1/completions", {"prompt": LONG_IDS, "max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2, 3], LONG_IDS], "max_tokens": 4}, 400, "prompt"),  # one bad of a batch
    ("/v1/completions", {"prompt": LONG_IDS, "max_tokens": 4, "stream": True}, 400, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "temperature": -1, "stream": True}, 400, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "top_p": 2}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "model": "nope"}, 404, "model"),
    # each of these stopped the engine loop (every later request a 503) or answered 500
    ("/v1/completions", {"prompt": "Hi", "min_tokens": 1, "stop_token_ids": [100000]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "Hi", "n": 2, "seed": 2**64}, 400, "seed"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    # what would change the output and is not implemented is refused, not ignored
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "Hi", "suffix": "!"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"fifty": 100}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logit_bias": {"99999": 1}}, 400,
     "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "response_format": {"type": "json_object"}}, 400, "response_format"),
]


@pytest.mark.parametrize("route,body,status,param", BAD_REQUESTS,
                         ids=[f"{i}-{s}-{p}" for i, (_, _, s, p) in enumerate(BAD_REQUESTS)])
def test_bad_request_status_and_error_shape(http, route, body, status, param):
    err = assert_error_shape(http.post(route, json=body), status, param)
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_errors_through_openai_client(server, client, model_name):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt="Hi", temperature=-1)
    assert e.value.status_code == 400 and e.value.param == "temperature" and e.value.body["code"] == 400
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt="Hi", top_p=2)
    assert e.value.status_code == 400 and e.value.param == "top_p"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt="Hi", n=0)
    assert e.value.status_code == 400 and e.value.param == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt=LONG_IDS, max_tokens=4)
    assert e.value.status_code == 400 and "max_model_len" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # a bad streamed request fails before the stream starts
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                       temperature=-1, stream=True)
    assert e.value.status_code == 400
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}])
    assert e.value.status_code == 404 and e.value.type == "not_found_error" and e.value.param == "model"
    bad_key = openai.OpenAI(base_url=f"{server.base}/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad_key.completions.create(model=model_name, prompt="Hi", max_tokens=2)
    assert e.value.status_code == 401 and e.value.type == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    bad_key.close()
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=model_name, prompt="a " * (2 * 2**20 + 10), max_tokens=2)
    assert e.value.status_code == 413


def test_auth_and_body_size(server, http):
    body = {"prompt": "Hi", "max_tokens": 2}
    err = assert_error_shape(httpx.post(f"{server.base}/v1/completions", json=body), 401, None)
    assert err["type"] == "authentication_error"
    for header in ({"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}, {"Authorization": "Basic x"}):
        assert_error_shape(httpx.post(f"{server.base}/v1/completions", json=body, headers=header), 401)
    assert_error_shape(httpx.get(f"{server.base}/v1/models"), 401)
    # over 4 MiB: 413, by Content-Length, before the body is parsed
    huge = {"prompt": "a " * (2 * 2**20 + 10), "max_tokens": 2}
    err = assert_error_shape(http.post("/v1/completions", json=huge), 413, None)
    assert "larger than" in err["message"]

    # and without Content-Length (chunked upload), while streaming the body in
    def chunks():
        for _ in range(5):
            yield b" " * 2**20
        yield json.dumps(body).encode()

    assert_error_shape(http.post("/v1/completions", content=chunks(),
                                 headers={"Content-Type": "application/json"}), 413)
    # a body under the limit is served
    ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "user": "x" * (3 * 2**20)})
    assert ok.status_code == 200, ok.text


def test_good_requests_still_succeed_after_a_burst_of_bad_ones(server, client, http, ref, model_name):
    async def burst():
        async with httpx.AsyncClient(base_url=server.base, headers={"Authorization": f"Bearer {API_KEY}"},
                                     timeout=30.0) as ac:
            rs = await asyncio.gather(*(ac.post(route, json=body) for route, body, _, _ in BAD_REQUESTS * 3))
        return [r.status_code for r in rs]

    assert asyncio.run(burst()) == [s for _, _, s, _ in BAD_REQUESTS] * 3
    r = client.completions.create(model=model_name, prompt=CAPITAL_PROMPT, temperature=0, max_tokens=8)
    assert r.choices[0].text == ref["capital8"].outputs[0].text
    wait_idle(http)  # nothing of the bad requests is left holding blocks


# ------------------------------------------------------------------------------------------------ 5. metrics
def test_metrics_count_what_was_sent(http, client, model_name):
    before = wait_idle(http)
    for fam in ("pagellm:num_requests_running", "pagellm:num_requests_waiting", "pagellm:kv_cache_usage_perc",
                "pagellm:num_preemptions_total", "pagellm:time_to_first_token_seconds_count",
                "pagellm:inter_token_latency_seconds_count"):
        assert (fam, ()) in before, fam
    ids = http.post("/tokenize", json={"prompt": "The quick brown fox jumps over the lazy dog. " * 6}).json()["tokens"]
    lens = [5, 17, 40]
    assert len(ids) >= max(lens)
    max_tokens = 6
    for n in lens:
        r = client.completions.create(model=model_name, prompt=ids[:n], temperature=0, max_tokens=max_tokens,
                                      extra_body={"ignore_eos": True})
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n, max_tokens)
        assert r.choices[0].finish_reason == "length"
    after = wait_idle(http)
    k = len(lens)

    def delta(name, **labels):
        return val(after, name, **labels) - val(before, name, **labels)

    assert delta("pagellm:prompt_tokens_total") == sum(lens)
    assert delta("pagellm:generation_tokens_total") == k * max_tokens
    assert delta("pagellm:request_success_total", finished_reason="length") == k
    assert delta("pagellm:request_success_total", finished_reason="abort") == 0
    assert delta("pagellm:request_success_total", finished_reason="stop") == 0
    assert delta("pagellm:e2e_request_latency_seconds_count") == k
    assert delta("pagellm:e2e_request_latency_seconds_bucket", le="+Inf") == k
    assert delta("pagellm:e2e_request_latency_seconds_sum") > 0
    assert delta("pagellm:time_to_first_token_seconds_count") == k
    assert delta("pagellm:inter_token_latency_seconds_count") == k * (max_tokens - 1)
    # histogram buckets are cumulative
    buckets = sorted(((float(dict(lbl)["le"]), v) for (name, lbl), v in after.items()
                      if name == "pagellm:e2e_request_latency_seconds_bucket"))
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)
    assert buckets[-1][1] == val(after, "pagellm:e2e_request_latency_seconds_count")


# ------------------------------------------------------------------------------------------------ 6. logprobs, n, stop
def test_completion_logprobs(client, ref, model_name):
    out = ref["capital8"].outputs[0]
    r = client.completions.create(model=model_name, prompt=CAPITAL_PROMPT, temperature=0, max_tokens=8, logprobs=2)
    c = r.choices[0]
    assert c.text == out.text
    lp = c.logprobs
    n = r.usage.completion_tokens
    assert n == len(out.token_ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == c.text
    for tok, tok_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tok_lp <= 0
        assert len(top) == 2 and tok in top  # greedy: the chosen token is the top-1
        assert tok_lp == pytest.approx(max(top.values()), abs=1e-4)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # streamed, the per-chunk logprobs add up to the same thing
    chunks = [ch for ch in client.completions.create(model=model_name, prompt=CAPITAL_PROMPT, temperature=0,
                                                      max_tokens=8, logprobs=2, stream=True) if ch.choices]
    assert sum((ch.choices[0].logprobs.tokens for ch in chunks), []) == lp.tokens


def test_echo_and_prompt_logprobs(client, http, llm, ref, model_name):
    """echo puts the prompt before the completion (with logprobs, its tokens' too, the first with None), as vLLM;
    prompt_logprobs returns them per choice (completions) or per response (chat); all as the offline engine's."""
    out = ref["capital8"].outputs[0]
    kw = dict(model=model_name, prompt=CAPITAL_PROMPT, temperature=0, max_tokens=8)
    assert client.completions.create(**kw, echo=True).choices[0].text == CAPITAL_PROMPT + out.text
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(**kw, echo=True, stream=True)
                       if ch.choices)
    assert streamed == CAPITAL_PROMPT + out.text
    offline = llm.generate(CAPITAL_PROMPT, greedy(8, prompt_logprobs=2), use_tqdm=False)[0]
    ids, plp = offline.prompt_token_ids, offline.prompt_logprobs
    plain = client.completions.create(**kw, logprobs=2).choices[0].logprobs
    for stream in (False, True):
        r = client.completions.create(**kw, echo=True, logprobs=2, stream=stream)
        chunks = [ch.choices[0] for ch in r if ch.choices] if stream else r.choices
        lp = [c.logprobs for c in chunks]
        tokens, lps = sum((x.tokens for x in lp), []), sum((x.token_logprobs for x in lp), [])
        tops, offsets = sum((x.top_logprobs for x in lp), []), sum((x.text_offset for x in lp), [])
        assert "".join(c.text for c in chunks) == "".join(tokens) == CAPITAL_PROMPT + out.text
        assert len(tokens) == len(ids) + len(out.token_ids)
        assert lps[0] is None and tops[0] is None and offsets[0] == 0
        assert lps[1:len(ids)] == pytest.approx([plp[j][ids[j]].logprob for j in range(1, len(ids))], abs=1e-4)
        assert all(len(t) >= 2 for t in tops[1:len(ids)])  # the top 2, and the prompt's token if not among them
        assert tokens[len(ids):] == plain.tokens and lps[len(ids):] == pytest.approx(plain.token_logprobs, abs=1e-4)
        assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    r = http.post("/v1/completions", json={**kw, "prompt_logprobs": 2}).json()
    got = r["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for j in range(1, len(ids)):
        assert {int(t) for t in got[j]} == set(plp[j])
        assert got[j][str(ids[j])]["logprob"] == pytest.approx(plp[j][ids[j]].logprob, abs=1e-4)
        assert got[j][str(ids[j])]["rank"] == plp[j][ids[j]].rank
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": CHAT_CONTENT}],
                                                   "max_tokens": 2, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert http.post("/v1/completions", json=kw).json()["choices"][0]["prompt_logprobs"] is None
    # max_tokens 0 with echo (scoring a prompt): the prompt alone, its logprobs, no completion tokens
    alone = client.completions.create(**{**kw, "max_tokens": 0}, echo=True, logprobs=2)
    c = alone.choices[0]
    assert c.text == CAPITAL_PROMPT and c.finish_reason == "length" and alone.usage.completion_tokens == 0
    assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.tokens) == len(ids)
    assert c.logprobs.token_logprobs[1:] == pytest.approx([plp[j][ids[j]].logprob for j in range(1, len(ids))],
                                                          abs=1e-4)
    streamed = [ch.choices[0] for ch in client.completions.create(**{**kw, "max_tokens": 0}, echo=True, logprobs=2,
                                                                   stream=True) if ch.choices]
    assert "".join(ch.text for ch in streamed) == CAPITAL_PROMPT and streamed[-1].finish_reason == "length"
    assert sum((ch.logprobs.token_logprobs for ch in streamed), []) == c.logprobs.token_logprobs
    # several prompts, n = 2 each: every choice echoes its own prompt (choices are prompt-major)
    many = client.completions.create(model=model_name, prompt=[CAPITAL_PROMPT, "Hello"], n=2, echo=True,
                                     logprobs=0, temperature=0, max_tokens=3)
    for c in many.choices:
        p = [CAPITAL_PROMPT, "Hello"][c.index // 2]
        assert c.text.startswith(p) and "".join(c.logprobs.tokens) == c.text and c.logprobs.token_logprobs[0] is None


def test_n_choices_compute_the_prompt_logprobs_once(client, http, llm, model_name):
    """With n > 1, only the first choice's request computes the prompt's logprobs; the others take its prompt K/V
    (they never look the prompt up) and its logprobs, streamed (echo) or not."""
    prompt = " ".join(f"Item {i} is on shelf {i % 7}." for i in range(8))  # ~70 tokens
    offline = llm.generate(prompt, greedy(3, prompt_logprobs=1), use_tqdm=False)[0]
    ids, plp = offline.prompt_token_ids, offline.prompt_logprobs
    before = wait_idle(http)
    r = http.post("/v1/completions", json={"model": model_name, "prompt": prompt, "n": 3, "max_tokens": 3,
                                           "temperature": 0, "prompt_logprobs": 1}).json()
    after = wait_idle(http)
    queries = "pagellm:prefix_cache_queries_total"
    assert val(after, queries) - val(before, queries) == len(ids)  # the first choice's lookup alone
    got = [c["prompt_logprobs"] for c in r["choices"]]
    assert got[0] == got[1] == got[2] and len(got[0]) == len(ids)
    for j in range(1, len(ids)):
        assert got[0][j][str(ids[j])]["logprob"] == pytest.approx(plp[j][ids[j]].logprob, abs=1e-4)
    chunks = [ch.choices[0] for ch in client.completions.create(model=model_name, prompt=prompt, n=3, echo=True,
                                                                logprobs=0, temperature=0, max_tokens=3, stream=True)
              if ch.choices]
    for i in range(3):
        mine = [ch for ch in chunks if ch.index == i]
        lps = sum((ch.logprobs.token_logprobs for ch in mine), [])
        assert "".join(ch.text for ch in mine) == prompt + offline.outputs[0].text
        assert lps[0] is None and lps[1:len(ids)] == pytest.approx([plp[j][ids[j]].logprob
                                                                    for j in range(1, len(ids))], abs=1e-4)


def test_chat_logprobs(client, ref, model_name):
    out = ref["chat16"]
    r = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": CHAT_CONTENT}],
                                       temperature=0, max_tokens=16, logprobs=True, top_logprobs=2)
    c = r.choices[0]
    assert c.message.content == out.outputs[0].text
    content = c.logprobs.content
    assert len(content) == r.usage.completion_tokens == len(out.outputs[0].token_ids)
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.bytes == list(entry.token.encode())
    assert "".join(e.token for e in content) == c.message.content


def test_logprobs_without_alternatives(server, client, http, model_name):
    """chat logprobs=true without top_logprobs, completions logprobs=0: per-token logprobs, no alternatives
    (the engine once died on a batch where every request asked for 0 alternatives)."""
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": CHAT_CONTENT}],
                                                "temperature": 0, "max_tokens": 4, "logprobs": True})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == r.json()["usage"]["completion_tokens"]
    assert all(e["top_logprobs"] == [] and e["logprob"] <= 0 for e in content)
    r = client.completions.create(model=model_name, prompt=CAPITAL_PROMPT, temperature=0, max_tokens=4, logprobs=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens
    assert httpx.get(f"{server.base}/health").status_code == 200


def test_n_choices_with_seed(client, ref, model_name):
    kw = dict(model=model_name, prompt=SEED_PROMPT, n=2, temperature=0.8, seed=SEED, max_tokens=10)
    r = client.completions.create(**kw)
    assert sorted(c.index for c in r.choices) == [0, 1]
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    # seeded: the same request gives the same choices; choice i uses seed + i, like offline
    again = client.completions.create(**kw)
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts
    offline = [ref["seed+0"], ref["seed+1"]]
    assert [o.outputs[0].text for o in offline] == texts
    assert texts[0] != texts[1]  # different seeds, different samples (for this prompt and seed)
    assert r.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in offline)
    assert r.usage.prompt_tokens == len(offline[0].prompt_token_ids)  # once per prompt, as vLLM counts
    two = client.completions.create(**{**kw, "prompt": [SEED_PROMPT, SEED_PROMPT + " Mine"]})
    assert len(two.choices) == 4 and two.usage.prompt_tokens == 2 * r.usage.prompt_tokens + 1  # (" Mine": 1 token)
    # chat too
    msgs = [{"role": "user", "content": "Say hi"}]
    rc = client.chat.completions.create(model=model_name, messages=msgs, n=2, temperature=0.8, seed=7, max_tokens=6)
    assert sorted(c.index for c in rc.choices) == [0, 1]
    r1 = client.chat.completions.create(model=model_name, messages=msgs, temperature=0.8, seed=7, max_tokens=6)
    assert rc.usage.prompt_tokens == r1.usage.prompt_tokens
    stream = client.chat.completions.create(model=model_name, messages=msgs, n=2, temperature=0.8, seed=7,
                                            max_tokens=6, stream=True, stream_options={"include_usage": True})
    assert [c.usage.prompt_tokens for c in stream if c.usage] == [r1.usage.prompt_tokens]
    # the largest seed: choice 1's seed wraps to 0 (its seed + 1 once failed inside torch)
    top = client.completions.create(**{**kw, "seed": 2**64 - 1})
    assert [c.text for c in sorted(top.choices, key=lambda c: c.index)] == [
        client.completions.create(**{**kw, "n": 1, "seed": s}).choices[0].text for s in (-1, 0)]


def test_n_choices_compute_their_prompt_once(http, client, model_name):
    """Choices 1.. follow choice 0 (share_prompt_with): they take the prompt K/V it computes, so the prompt is
    looked up in the prefix cache once, not once per choice; streamed too."""
    before = wait_idle(http)
    kw = dict(model=model_name, prompt=SEED_PROMPT + " Twice over.", n=3, temperature=0.8, seed=SEED, max_tokens=6)
    r = client.completions.create(**kw)
    mid = wait_idle(http)
    assert len(r.choices) == 3
    queries = "pagellm:prefix_cache_queries_total"
    assert val(mid, queries) - val(before, queries) == r.usage.prompt_tokens
    texts = {}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    after = wait_idle(http)
    assert val(after, queries) - val(mid, queries) == r.usage.prompt_tokens
    assert [texts[i] for i in range(3)] == [c.text for c in sorted(r.choices, key=lambda c: c.index)]


def test_logit_bias(client, llm, ref, model_name):
    base = ref["capital8"].outputs[0]
    first = base.token_ids[0]
    kw = dict(model=model_name, prompt=CAPITAL_PROMPT, temperature=0, max_tokens=8)
    banned = client.completions.create(**kw, logit_bias={str(first): -100})
    assert banned.choices[0].text != base.text
    offline = llm.generate(CAPITAL_PROMPT, greedy(8, logit_bias={first: -100}), use_tqdm=False)[0].outputs[0]
    assert banned.choices[0].text == offline.text
    assert client.completions.create(**kw, logit_bias={str(first): 0}).choices[0].text == base.text
    forced = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                            temperature=0, max_tokens=3, logit_bias={str(first): 100})
    assert forced.choices[0].message.content == llm.get_tokenizer().decode([first] * 3)


def test_top_k_past_the_vocabulary_is_no_top_k(client, model_name):
    kw = dict(model=model_name, prompt=SEED_PROMPT, temperature=0.8, seed=SEED, max_tokens=8)
    texts = [client.completions.create(**kw, extra_body={"top_k": k}).choices[0].text for k in (-1, 2**63 - 1)]
    assert texts[0] == texts[1]


def test_stop_strings_match_offline(client, llm, ref, model_name):
    prompt = COUNT_PROMPT
    base = ref["count24"].outputs[0].text
    assert len(base) > 12
    stop = base[5:10]  # may span several tokens
    out = llm.generate(prompt, greedy(24, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == base[:base.index(stop)]
    r = client.completions.create(model=model_name, prompt=prompt, temperature=0, max_tokens=24, stop=[stop])
    c = r.choices[0]
    assert c.text == out.text and c.finish_reason == "stop"
    assert c.model_extra.get("stop_reason") == stop
    # streamed: text that might still become the stop string is held back, never sent and then cut
    chunks = [ch for ch in client.completions.create(model=model_name, prompt=prompt, temperature=0, max_tokens=24,
                                                      stop=[stop], stream=True) if ch.choices]
    assert "".join(ch.choices[0].text for ch in chunks) == out.text
    assert chunks[-1].choices[0].finish_reason == "stop"
    # include_stop_str_in_output (vLLM extra, through extra_body)
    r = client.completions.create(model=model_name, prompt=prompt, temperature=0, max_tokens=24, stop=[stop],
                                  extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == base[:base.index(stop) + len(stop)]



def test_unknown_fields_are_ignored_and_logged(server, http):
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "frobnicate": 1, "zeta": "z"})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 10
    while "ignored: ['frobnicate', 'zeta']" not in server.log.read_text(errors="replace"):
        assert time.monotonic() < deadline, "the ignored fields were not logged"
        time.sleep(0.1)
