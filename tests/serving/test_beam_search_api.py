"""vLLM's use_beam_search through the server: the n choices are the offline LLM.beam_search's n best sequences,
beside other requests, streamed or not; what beam search does not take is refused; nothing stays in the KV cache,
a client that leaves included."""
from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from pagellm import BeamSearchParams
from pagellm.entrypoints.chat_utils import render_chat

from .harness import API_KEY, CAPITAL_PROMPT, CHAT_CONTENT, STORY_PROMPT, assert_error_shape, val, wait_idle

BEAMS = 3
MAX_TOKENS = 10


def _offline(llm, prompt_ids: list[int], beams: int = BEAMS) -> list[tuple[str, int, str]]:
    """(text, generated tokens, finish reason) of each of the offline beam search's sequences, best first."""
    out = llm.beam_search([{"prompt_token_ids": prompt_ids}], BeamSearchParams(beam_width=beams, max_tokens=MAX_TOKENS))
    eos = llm.llm_engine.eos_token_ids
    seqs = []
    for s in out[0].sequences:
        gen = s.tokens[len(prompt_ids):]
        seqs.append((s.text, len(gen), "stop" if gen[-1] in eos else "length"))
    return seqs


def test_completion_beams_match_offline_beside_other_requests(client, llm, ref, http, model_name):
    tok = llm.get_tokenizer()
    prompts = [CAPITAL_PROMPT, STORY_PROMPT]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        beams = pool.submit(client.completions.create, model=model_name, prompt=prompts, n=2, max_tokens=MAX_TOKENS,
                            temperature=0, extra_body={"use_beam_search": True})
        plain = pool.submit(client.completions.create, model=model_name, prompt=STORY_PROMPT, max_tokens=16,
                            temperature=0)
        beams, plain = beams.result(), plain.result()
    assert plain.choices[0].text == ref["story16"].outputs[0].text  # the other request, batched beside the beams
    expected = [seq for p in prompts for seq in _offline(llm, tok.encode(p), beams=2)]
    assert [c.index for c in beams.choices] == [0, 1, 2, 3]
    assert [(c.text, c.finish_reason) for c in beams.choices] == [(t, f) for t, _, f in expected]
    assert beams.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    assert beams.usage.completion_tokens == sum(n for _, n, _ in expected)
    wait_idle(http)  # every kept block released: the KV cache is empty


def test_chat_beams_streamed_match_offline(client, llm, http, model_name):
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": CHAT_CONTENT}]
    ids = tok.encode(render_chat(tok, messages, True), add_special_tokens=False)
    stream = client.chat.completions.create(model=model_name, messages=messages, n=BEAMS, max_tokens=MAX_TOKENS,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"use_beam_search": True})
    texts, reasons, usage = [""] * BEAMS, [None] * BEAMS, None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    expected = _offline(llm, ids)
    assert list(zip(texts, reasons)) == [(t, f) for t, _, f in expected]
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), sum(n for _, n, _ in expected))
    wait_idle(http)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_beam_search_refuses_what_it_does_not_take(http, model_name, route):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    base = {"model": model_name, "max_tokens": 4, "use_beam_search": True, "n": 2}
    base.update({"prompt": CAPITAL_PROMPT} if route == "/v1/completions" else
                {"messages": [{"role": "user", "content": CHAT_CONTENT}]})
    cases = [({"temperature": 0.7}, "temperature"), ({"stop": ["."]}, "stop"), ({"n": 11}, "n"),
             ({"presence_penalty": 0.5, "top_p": 0.9}, "top_p")]
    cases += ([({"logprobs": 2}, "logprobs"), ({"echo": True}, "echo")] if route == "/v1/completions" else
              [({"logprobs": True}, "logprobs")])
    for extra, param in cases:
        err = assert_error_shape(http.post(route, json={**base, **extra}, headers=headers), 400, param)
        assert "use_beam_search" in err["message"], err
    wait_idle(http)


@pytest.mark.parametrize("stream", [False, True])
def test_client_leaving_mid_beam_search_frees_its_blocks(server, http, model_name, stream):
    before = wait_idle(http)
    body = {"model": model_name, "prompt": "Tell me a long story.", "max_tokens": 1500, "n": BEAMS,
            "ignore_eos": True, "use_beam_search": True, "stream": stream}
    with pytest.raises(httpx.ReadTimeout):  # (streamed too: a beam search's first chunk comes when it ends)
        httpx.post(f"{server.base}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                   timeout=1.5)
    after = wait_idle(http, timeout=20.0)  # the beams' running requests aborted, their kept blocks released
    generated = val(after, "pagellm:generation_tokens_total") - val(before, "pagellm:generation_tokens_total")
    assert 0 < generated < BEAMS * 1500  # (a beam's step is a one-token request) stopped when the client left
