"""``pagellm bench serve``: a client-side online-serving benchmark against an OpenAI-compatible server.

Sends a token-id workload to ``/v1/completions`` (streaming) on a Poisson arrival schedule and reports
TTFT / TPOT / ITL / E2E latency percentiles and throughput as ONE JSON line on stdout (like
``vllm bench serve``), with a short human-readable table on stderr.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # httpx is imported lazily so that building the CLI parser never needs it
    import httpx

DONE = "[DONE]"
METRICS = ("ttft", "tpot", "itl", "e2e")


# ----------------------------------------------------------------------------------------------- pure helpers

def summarize(values_s: list[float]) -> dict[str, float | None]:
    """mean/p50/p90/p99 in milliseconds of durations given in seconds (all None when there are none)."""
    if not values_s:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"mean": float(ms.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def arrival_offsets(n: int, request_rate: float, seed: int = 0) -> np.ndarray:
    """Send times (seconds after the start) of ``n`` requests arriving as a Poisson process.

    The first request goes at 0; the gaps between successive requests are exponential with mean
    ``1/request_rate`` from a seeded RNG, so a schedule is reproducible. ``inf`` sends all at once.
    Offsets are absolute (not sleep-after-send gaps) so time spent dispatching does not drift the schedule.
    """
    if request_rate <= 0:
        raise ValueError("request_rate must be > 0")
    if n <= 0:
        return np.zeros(0)
    if math.isinf(request_rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def parse_sse_line(line: str) -> dict | str | None:
    """One SSE line -> its JSON payload (dict), ``DONE`` for ``data: [DONE]``, or None (blank/comment/other field).

    Raises ValueError on a ``data:`` line whose payload is not a JSON object.
    """
    line = line.strip()
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == DONE:
        return DONE
    obj = json.loads(data)
    if not isinstance(obj, dict):
        raise ValueError(f"SSE payload is not an object: {data[:100]}")
    return obj


@dataclass
class RequestResult:
    """What one streamed request produced; fed SSE lines with their arrival times by ``feed``."""

    prompt_len: int
    send_time: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk carrying new text/tokens
    text: list[str] = field(default_factory=list)
    usage: dict | None = None
    done: bool = False
    error: str | None = None

    def feed(self, line: str, now: float) -> bool:
        """Consume one SSE line that arrived at ``now``; True when the stream is over ([DONE] or an error)."""
        try:
            obj = parse_sse_line(line)
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            self.error = f"bad SSE payload: {e}"
            return True
        if obj is None:
            return False
        if obj == DONE:
            self.done = True
            return True
        assert isinstance(obj, dict)
        if obj.get("error"):
            err = obj["error"]
            self.error = str(err.get("message", err) if isinstance(err, dict) else err)
            return True
        if obj.get("usage"):  # null on every chunk but the usage one (stream_options.include_usage)
            self.usage = obj["usage"]
        new = False
        for ch in obj.get("choices") or []:
            if ch.get("text") or ch.get("token_ids"):
                new = True
                self.text.append(ch.get("text") or "")
        if new:
            self.chunk_times.append(now)
        return False

    @property
    def success(self) -> bool:
        return self.error is None

    @property
    def output_tokens(self) -> int:
        """The server's usage.completion_tokens; the content-chunk count if it sent no usage."""
        if self.usage and self.usage.get("completion_tokens") is not None:
            return int(self.usage["completion_tokens"])
        return len(self.chunk_times)

    @property
    def prompt_tokens(self) -> int:
        if self.usage and self.usage.get("prompt_tokens") is not None:
            return int(self.usage["prompt_tokens"])
        return self.prompt_len

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.send_time

    @property
    def e2e(self) -> float:
        return self.chunk_times[-1] - self.send_time

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None


def compute_metrics(results: list[RequestResult], duration_s: float, request_rate: float) -> dict[str, Any]:
    """The benchmark's JSON record from per-request results and the wall time of the whole run."""
    ok = [r for r in results if r.success]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [g for r in ok for g in r.itl],
        "e2e": [r.e2e for r in ok],
    }
    dur = max(duration_s, 1e-9)
    out: dict[str, Any] = {
        "engine": "pagellm-serve",
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",  # JSON has no Infinity
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "request_throughput": len(ok) / dur,
        "output_throughput": output_tokens / dur,
        "total_token_throughput": (prompt_tokens + output_tokens) / dur,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
    }
    for m in METRICS:
        for k, v in summarize(per[m]).items():
            out[f"{m}_ms_{k}"] = v
    out["errors"] = sorted({r.error for r in results if r.error})[:5]
    return out


# ----------------------------------------------------------------------------------------------- HTTP client

async def fetch_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id the server lists at /v1/models."""
    r = await client.get(f"{base_url}/v1/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def send_request(client: httpx.AsyncClient, base_url: str, model: str, prompt: list[int],
                       output_len: int, temperature: float = 0.0) -> RequestResult:
    """One streamed completion; never raises, never retries: failures land in ``result.error``."""
    res = RequestResult(prompt_len=len(prompt))
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    res.send_time = time.perf_counter()
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                msg = (await resp.aread()).decode(errors="replace").strip()
                res.error = f"HTTP {resp.status_code}: {msg[:300]}"
                return res
            async for line in resp.aiter_lines():
                if res.feed(line, time.perf_counter()):
                    break
    except Exception as e:  # transport errors, timeouts, protocol errors: count them, keep benchmarking
        res.error = f"{type(e).__name__}: {e}"
        return res
    if res.error is None and not res.done:
        res.error = "stream ended without [DONE]"
    elif res.error is None and not res.chunk_times:
        res.error = "stream carried no tokens"
    return res


async def run_benchmark(base_url: str, prompts: list[list[int]], output_len: int, request_rate: float,
                        model: str | None = None, seed: int = 0, max_concurrency: int | None = None,
                        api_key: str | None = None, temperature: float = 0.0) -> dict:
    """Send every prompt on a Poisson schedule (at most ``max_concurrency`` in flight) and return the metrics."""
    import httpx

    base_url = base_url.rstrip("/")
    if base_url.endswith("/v1"):
        base_url = base_url[:-3]
    # One connection per request that can be in flight, so the pool itself never queues or limits anything.
    n_conn = max(1, min(len(prompts), max_concurrency or len(prompts)))
    limits = httpx.Limits(max_connections=n_conn, max_keepalive_connections=n_conn)
    # Requests may sit in the server's queue for minutes before their first token: generous read timeout.
    timeout = httpx.Timeout(connect=60.0, read=3600.0, write=600.0, pool=None)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # trust_env=False: a proxy from the environment must not sit between us and the server being measured.
    async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(retries=0, limits=limits), timeout=timeout,
                                 headers=headers, trust_env=False) as client:
        if model is None:
            model = await fetch_model(client, base_url)
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def one(prompt: list[int]) -> RequestResult:
            if sem is None:
                return await send_request(client, base_url, model, prompt, output_len, temperature)
            async with sem:
                return await send_request(client, base_url, model, prompt, output_len, temperature)

        offsets = arrival_offsets(len(prompts), request_rate, seed)
        tasks: list[asyncio.Task[RequestResult]] = []
        t0 = time.perf_counter()
        for prompt, off in zip(prompts, offsets):
            delay = t0 + float(off) - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(prompt)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
    out = compute_metrics(results, duration, request_rate)
    out["model"] = model
    out["max_concurrency"] = max_concurrency
    return out


# ----------------------------------------------------------------------------------------------- CLI

def format_table(r: dict) -> str:
    """The short human-readable summary printed to stderr."""
    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)

    lines = [f"{' Serving Benchmark Result ':=^60}",
             f"{'Engine / model:':<32}{r['engine']} / {r.get('model')}",
             f"{'Request rate (req/s):':<32}{r['request_rate']}   max concurrency: {r.get('max_concurrency')}",
             f"{'Successful / failed requests:':<32}{r['completed']} / {r['failed']}",
             f"{'Duration (s):':<32}{f(r['duration_s'])}",
             f"{'Prompt / output tokens:':<32}{r['prompt_tokens']} / {r['output_tokens']}",
             f"{'Request throughput (req/s):':<32}{f(r['request_throughput'])}",
             f"{'Output throughput (tok/s):':<32}{f(r['output_throughput'])}",
             f"{'Total throughput (tok/s):':<32}{f(r['total_token_throughput'])}",
             f"{'(ms)':<10}{'mean':>12}{'p50':>12}{'p90':>12}{'p99':>12}"]
    for m in METRICS:
        lines.append(f"{m.upper():<10}" + "".join(f"{f(r[f'{m}_ms_{k}']):>12}" for k in ("mean", "p50", "p90", "p99")))
    lines.extend(f"error: {e}" for e in r.get("errors", []))
    lines.append("=" * 60)
    return "\n".join(lines)


def add_parser(subparsers: Any) -> None:
    """Add ``serve`` to the ``pagellm bench`` subparsers (func=cmd_serve)."""
    p = subparsers.add_parser("serve", help="online serving benchmark against an OpenAI-compatible server "
                                            "(one JSON line)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--workload", required=True, help="workload JSON: {meta: {output_len}, prompts: [[ids]]}")
    p.add_argument("--num-prompts", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s with Poisson arrivals; inf (default) sends all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (default: none)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival schedule")
    p.add_argument("--model", default=None, help="model name to send (default: first id from /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--output-len", type=int, default=None, help="max_tokens per request (default: meta.output_len)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sent with every request (default 0: greedy; the OpenAI API's own default is 1)")
    p.add_argument("--label", default="pagellm-serve", help="the 'engine' field of the JSON line")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> None:
    """Run the benchmark from parsed flags; ONE JSON line on stdout, a table on stderr."""
    with open(args.workload) as fh:
        wl = json.load(fh)
    prompts = wl["prompts"][:args.num_prompts] if args.num_prompts else wl["prompts"]
    output_len = args.output_len if args.output_len is not None else wl.get("meta", {}).get("output_len")
    if output_len is None:
        raise SystemExit("bench serve: no --output-len and the workload's meta has no output_len")
    if not args.request_rate > 0:
        raise SystemExit("bench serve: --request-rate must be > 0 (or inf)")
    result = asyncio.run(run_benchmark(args.base_url, prompts, int(output_len), args.request_rate,
                                       model=args.model, seed=args.seed, max_concurrency=args.max_concurrency,
                                       api_key=args.api_key, temperature=args.temperature))
    result["engine"] = args.label
    print(format_table(result), file=sys.stderr, flush=True)
    print(json.dumps(result), flush=True)
