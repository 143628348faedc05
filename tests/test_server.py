"""End to end: ``pagellm serve`` in a subprocess on loopback, driven by the official ``openai`` client and httpx.

One server (API key on, ``--log-interval 1``) serves the whole module; an offline ``LLM`` in the test process is
the reference for greedy outputs. When a test fails, the tail of the server's log is attached to its report.
"""
from __future__ import annotations

import asyncio
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import pagellm
from pagellm import LLM, SamplingParams
from pagellm.model_executor.default_model import DEFAULT_MODEL_NAME

API_KEY = "sk-pagellm-test-key"
MAX_MODEL_LEN = 2048
REPO = pathlib.Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 120.0


# ------------------------------------------------------------------------------------------------ fixtures
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(log: pathlib.Path, chars: int = 6000) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError as e:
        return f"<cannot read {log}: {e}>"
    return text[-chars:]


class _AttachServerLog:
    """pytest plugin: a failing test of this module gets the server log's tail as a report section."""

    def __init__(self, log: pathlib.Path) -> None:
        self.log = log

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        rep = yield
        if rep.failed and getattr(item, "module", None) is not None and item.module.__name__ == __name__:
            rep.sections.append(("pagellm serve log (tail)", _log_tail(self.log)))
        return rep


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log: pathlib.Path) -> None:
        self.proc, self.port, self.log = proc, port, log
        self.base = f"http://127.0.0.1:{port}"

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"pagellm serve exited with {self.proc.returncode} during startup; log:\n"
                            f"{_log_tail(self.log)}")
            try:
                if httpx.get(f"{self.base}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        pytest.fail(f"pagellm serve not healthy after {timeout:.0f} s; log:\n{_log_tail(self.log)}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)


@pytest.fixture(scope="module")
def _server_proc(gguf_path, tmp_path_factory, request):
    """Starts ``pagellm serve`` (without waiting for it, so the offline LLM can load meanwhile)."""
    port = _free_port()
    log = tmp_path_factory.mktemp("pagellm_serve") / "server.log"
    cmd = [sys.executable, "-m", "pagellm", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--kv-cache-memory", "512MiB", "--max-model-len", str(MAX_MODEL_LEN),
           "--api-key", API_KEY, "--log-interval", "1"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("PAGELLM_API_KEY", None)
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    server = Server(proc, port, log)
    plugin = _AttachServerLog(log)
    request.config.pluginmanager.register(plugin, f"pagellm-serve-log-{port}")
    try:
        yield server
    finally:
        server.stop()
        request.config.pluginmanager.unregister(plugin)


@pytest.fixture(scope="module")
def server(_server_proc) -> Server:
    _server_proc.wait_healthy()
    return _server_proc


@pytest.fixture(scope="module")
def llm(_server_proc):
    """The offline reference. Depends on _server_proc only so that the server boots while this loads.

    One intra-op thread: the server process runs next to this one, and two processes each spinning two OpenMP
    threads on a busy machine slow the offline side down many times over (greedy outputs do not depend on
    the thread count). The engine sets torch's thread count process-wide, so it is put back afterwards.
    """
    threads = torch.get_num_threads()
    try:
        yield LLM(dtype="float32", kv_cache_memory="256MiB", max_model_len=MAX_MODEL_LEN, num_threads=1)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=f"{server.base}/v1", api_key=API_KEY, max_retries=0, timeout=60.0)
    yield c
    c.close()


@pytest.fixture(scope="module")
def http(server):
    c = httpx.Client(base_url=server.base, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60.0)
    yield c
    c.close()


@pytest.fixture(scope="module")
def model_name(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


# ------------------------------------------------------------------------------------------------ references
def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


CAPITAL_PROMPT = "The capital of France is"
STORY_PROMPT = "Once upon a time, in a small village by the sea, there lived"
COUNT_PROMPT = "Count: 1, 2, 3, 4, 5, 6,"
SEED_PROMPT = "My favourite animal is"
SEED = 1234
CHAT_CONTENT = "Write a short sentence about the ocean."
_SUBJECTS = ["the moon", "rivers", "a red fox", "old castles", "coffee", "winter", "trains", "the desert",
             "honeybees", "volcanoes", "a lighthouse", "jazz", "mountains", "the library", "rain", "chess"]
CONCURRENT_PROMPTS = ([f"{i + 1}. A fact about {s} is that" for i, s in enumerate(_SUBJECTS)]
                      + [f"Q: Why do people like {s}?\nA:" for s in _SUBJECTS])
CONCURRENT_MAX_TOKENS = 12

# name -> (prompt, params): the offline side of every comparison, generated in one batch (see ``ref``)
OFFLINE = {
    "capital8": (CAPITAL_PROMPT, greedy(8)),
    "story16": (STORY_PROMPT, greedy(16)),
    "hello6": ("Hello", greedy(6, ignore_eos=True)),
    "count24": (COUNT_PROMPT, greedy(24)),
    "seed+0": (SEED_PROMPT, SamplingParams(temperature=0.8, seed=SEED, max_tokens=10)),
    "seed+1": (SEED_PROMPT, SamplingParams(temperature=0.8, seed=SEED + 1, max_tokens=10)),
    **{f"concurrent{i}": (p, greedy(CONCURRENT_MAX_TOKENS)) for i, p in enumerate(CONCURRENT_PROMPTS)},
}


@pytest.fixture(scope="module")
def ref(llm) -> dict:
    """name -> offline RequestOutput (``OFFLINE`` through ``LLM.generate``; "chat16" through ``LLM.chat``)."""
    names = list(OFFLINE)
    outs = llm.generate([OFFLINE[n][0] for n in names], [OFFLINE[n][1] for n in names], use_tqdm=False)
    res = dict(zip(names, outs))
    res["chat16"] = llm.chat([{"role": "user", "content": CHAT_CONTENT}], greedy(16), use_tqdm=False)[0]
    return res


# ------------------------------------------------------------------------------------------------ helpers
def scrape(http) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted labels): value}, through prometheus_client's parser."""
    r = http.get("/metrics")
    assert r.status_code == 200
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def val(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_idle(http, timeout: float = 20.0) -> dict:
    """Poll /metrics until nothing runs or waits and the KV cache is empty; returns that scrape."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(http)
        if (val(m, "pagellm:num_requests_running") == 0 and val(m, "pagellm:num_requests_waiting") == 0
                and val(m, "pagellm:kv_cache_usage_perc") == 0):
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"server not idle after {timeout} s: running={val(m, 'pagellm:num_requests_running')} "
                        f"waiting={val(m, 'pagellm:num_requests_waiting')} "
                        f"kv={val(m, 'pagellm:kv_cache_usage_perc')}")
        time.sleep(0.1)


def assert_error_shape(resp: httpx.Response, status: int, param: str | None = "?") -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert err["code"] == status
    if param != "?":
        assert err["param"] == param, err
    return err


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
    assert r.usage.prompt_tokens == 2 * len(offline[0].prompt_token_ids)  # counted per choice, as vLLM does
    # chat too
    rc = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Say hi"}], n=2,
                                        temperature=0.8, seed=7, max_tokens=6)
    assert sorted(c.index for c in rc.choices) == [0, 1]


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

