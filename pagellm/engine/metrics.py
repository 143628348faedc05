"""Prometheus metrics with vLLM's names under the ``pagellm:`` prefix, fed by the async engine's loop thread."""
from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0)


@dataclass
class _Timing:
    arrival: float
    tokens: int = 0
    last_token: float | None = None
    prompt_counted: bool = False


class EngineMetrics:
    def __init__(self, engine, registry: CollectorRegistry | None = None) -> None:
        self.engine = engine
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.running = Gauge("pagellm:num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("pagellm:num_requests_waiting", "Requests waiting to be scheduled", registry=r)
        self.kv_usage = Gauge("pagellm:kv_cache_usage_perc", "Share of KV blocks in use (0-1)", registry=r)
        self.preemptions = Counter("pagellm:num_preemptions", "Preemptions (recompute)", registry=r)
        self.prefix_queries = Counter("pagellm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("pagellm:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                   registry=r)
        self.prompt_tokens = Counter("pagellm:prompt_tokens", "Prompt tokens of requests that started "
                                     "generating", registry=r)
        self.generation_tokens = Counter("pagellm:generation_tokens", "Generated tokens", registry=r)
        self.request_success = Counter("pagellm:request_success", "Finished requests by finish reason",
                                       ["finished_reason"], registry=r)
        self.ttft = Histogram("pagellm:time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pagellm:inter_token_latency_seconds", "Time between successive tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pagellm:e2e_request_latency_seconds", "Arrival to finish",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self._timings: dict[str, _Timing] = {}
        self._seen_preemptions = 0
        self._seen_queries = self._seen_hits = 0
        self._max_running = 0
        # throughput window for the periodic log line
        self._win_prompt = 0
        self._win_gen = 0

    @property
    def max_running(self) -> int:
        """Largest running batch seen so far (tests use it to check that requests were batched)."""
        return self._max_running

    def on_arrival(self, request_id: str) -> None:
        self._timings[request_id] = _Timing(time.monotonic())

    def on_output(self, out, now: float) -> None:
        t = self._timings.get(out.request_id)
        if t is None:
            return
        n = len(out.outputs[0].token_ids)
        new = n - t.tokens
        if new > 0:
            if not t.prompt_counted:
                t.prompt_counted = True
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                self._win_prompt += len(out.prompt_token_ids)
                self.ttft.observe(now - t.arrival)
            else:
                self.itl.observe(now - t.last_token)
            self.generation_tokens.inc(new)
            self._win_gen += new
            t.tokens, t.last_token = n, now
        if out.finished:
            self.on_finished(out.request_id, out.outputs[0].finish_reason or "stop", now)

    def on_finished(self, request_id: str, reason: str, now: float | None = None) -> None:
        t = self._timings.pop(request_id, None)
        if t is None:
            return
        self.request_success.labels(finished_reason=reason).inc()
        self.e2e.observe((now or time.monotonic()) - t.arrival)

    def update_gauges(self) -> None:
        sched = self.engine.scheduler
        self.running.set(len(sched.running))
        self.waiting.set(sched.num_waiting)
        self._max_running = max(self._max_running, len(sched.running))
        self.kv_usage.set(self.engine.kv_manager.usage())
        total = sched.num_preemptions
        if total > self._seen_preemptions:
            self.preemptions.inc(total - self._seen_preemptions)
            self._seen_preemptions = total
        kv = self.engine.kv_manager
        if kv.prefix_queries > self._seen_queries:
            self.prefix_queries.inc(kv.prefix_queries - self._seen_queries)
            self.prefix_hits.inc(kv.prefix_hits - self._seen_hits)
            self._seen_queries, self._seen_hits = kv.prefix_queries, kv.prefix_hits

    def log_line(self, window_s: float) -> str:
        sched = self.engine.scheduler
        line = (f"prompt throughput: {self._win_prompt / window_s:.1f} tok/s, generation throughput: "
                f"{self._win_gen / window_s:.1f} tok/s, running: {len(sched.running)}, waiting: "
                f"{sched.num_waiting}, KV cache usage: {100 * self.engine.kv_manager.usage():.1f}%, "
                f"preemptions: {sched.num_preemptions}, prefix cache hit rate: "
                f"{100 * self.engine.kv_manager.prefix_hit_rate:.1f}%")
        self._win_prompt = self._win_gen = 0
        return line
