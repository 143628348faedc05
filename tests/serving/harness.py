"""What the serving tests share: the server's settings, the prompts whose offline outputs are the reference (the
``ref`` fixture, conftest.py), and helpers to read /metrics and check an error's shape."""
from __future__ import annotations

import pathlib
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagellm import SamplingParams

API_KEY = "sk-pagellm-test-key"
MAX_MODEL_LEN = 2048
REPO = pathlib.Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 120.0


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
