"""``pagellm bench throughput``: the peers' workload format and JSON line, plus pagellm's KV figures."""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import time

import psutil


class PeakRSS:
    """The high-water mark of this process's RSS plus its children's, in MiB, read from the kernel when stopped.

    No sampling thread (shared/bench's peers sample every 100 ms in one): the kernel's own high-water mark is exact
    where a sample can miss a short peak, and a thread waking to sample takes the GIL and a core from the engine
    (a single request's TPOT, Zen 4, in-process alternating: 5.1-6.0 ms without it, 5.3-6.1 with it)."""

    def __init__(self) -> None:
        self.proc = psutil.Process(os.getpid())

    def stop(self) -> float:
        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # VmHWM: KiB on Linux
        children = 0
        for child in self.proc.children(recursive=True):
            try:
                with open(f"/proc/{child.pid}/status") as f:
                    children += next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")), 0)
            except (OSError, psutil.Error):
                pass
        return (own + children) / 2**20


def _start_profiler():
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU])
    prof.__enter__()
    return prof


def _stop_profiler(prof) -> dict[str, float]:
    """Seconds per engine phase (the ``pagellm.*`` ranges) in the JSON line; the top ops table on stderr.
    Profiling adds overhead, so wall time under --profile runs slower than without."""
    prof.__exit__(None, None, None)
    averages = prof.key_averages()
    phases = {e.key.removeprefix("pagellm."): round(e.cpu_time_total / 1e6, 3) for e in averages
              if e.key.startswith("pagellm.")}
    sys.stderr.write(averages.table(sort_by="self_cpu_time_total", row_limit=25) + "\n")
    return phases


def load_workload(path: str) -> tuple[dict, list[list[int]]]:
    with open(path) as f:
        d = json.load(f)
    return d["meta"], d["prompts"]


def random_lengths(n: int, input_len: int, range_ratio: float, seed: int) -> list[int]:
    """vLLM's random dataset's prompt lengths: n draws of Uniform{floor(L (1 - r)) .. ceil(L (1 + r))}, L =
    input_len, r = range_ratio; fixed by seed."""
    import math

    import numpy as np

    if n < 1 or input_len < 1 or not 0 <= range_ratio < 1:
        raise ValueError(f"random workload: need --num-prompts >= 1, --input-len >= 1 and 0 <= --random-range-ratio "
                         f"< 1, got {n}, {input_len}, {range_ratio}")
    lo, hi = max(1, math.floor(input_len * (1 - range_ratio))), math.ceil(input_len * (1 + range_ratio))
    return [int(k) for k in np.random.default_rng(seed).integers(lo, hi + 1, size=n)]


def random_prompts(lengths: list[int], seed: int, vocab_size: int, tokenizer=None) -> list[list[int]]:
    """Prompts of these lengths, each id uniform over the vocabulary less the tokenizer's special and added tokens
    (the shared workloads leave out the special ones: make_random.py); fixed by seed."""
    import numpy as np

    special: set[int] = set()
    if tokenizer is not None:
        special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", None) or {})
    allowed = np.array([i for i in range(vocab_size) if i not in special], dtype=np.int64)
    rng = np.random.default_rng([seed, 1])
    return [allowed[rng.integers(0, len(allowed), size=k)].tolist() for k in lengths]


def cmd_throughput(a: argparse.Namespace) -> None:
    """One JSON line; with --compare-prefix-caching, two runs (cache on, then off) and a summary line."""
    if not a.compare_prefix_caching:
        _emit(_throughput(a, None))
        return
    on = _throughput(a, True)
    _emit(on)
    gc.collect()
    off = _throughput(a, False)
    _emit(off)
    _emit({"prefix_caching_summary": True, "hit_rate": on["prefix_cache_hit_rate"],
           "prefill_tokens_computed_drop": round(1 - on["prompt_tokens_computed"] / off["prompt_tokens_computed"], 4),
           "total_tok_per_s_speedup": round(on["total_tok_per_s"] / off["total_tok_per_s"], 2)})


def _emit(result: dict) -> None:
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


def _throughput(a: argparse.Namespace, prefix_caching: bool | None) -> dict:
    from pagellm import LLM, SamplingParams
    from pagellm.entrypoints.cli import engine_kwargs

    rss = PeakRSS()
    if (a.num_prompts is not None and a.num_prompts < 1) or (a.output_len is not None and a.output_len < 1):
        raise SystemExit(f"bench throughput: --num-prompts and --output-len must be >= 1, got {a.num_prompts} and "
                         f"{a.output_len}")
    if a.n < 1:
        raise SystemExit(f"bench throughput: --n must be >= 1, got {a.n}")
    if a.workload:
        if a.input_len is not None or a.random_range_ratio:
            raise SystemExit("bench throughput: --input-len and --random-range-ratio make a random workload; "
                             "not with --workload")
        meta, prompts = load_workload(a.workload)
        prompts = prompts[:a.num_prompts]
        out_len = int(meta["output_len"]) if a.output_len is None else a.output_len
    elif a.input_len is None or a.output_len is None:
        raise SystemExit("bench throughput: give --workload, or --input-len and --output-len (a random workload)")
    else:
        out_len = a.output_len
        try:
            lengths = random_lengths(64 if a.num_prompts is None else a.num_prompts, a.input_len,
                                     a.random_range_ratio, a.seed)
        except ValueError as e:
            raise SystemExit(f"bench throughput: {e}") from None
    kwargs = engine_kwargs(a)
    if prefix_caching is not None:
        kwargs["enable_prefix_caching"] = prefix_caching
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t0
    engine = llm.llm_engine
    if not a.workload:
        prompts = random_prompts(lengths, a.seed, engine.vocab_size, llm.get_tokenizer())

    # Warm-up on different token ids than the workload's, so nothing about the timed run is pre-computed.
    warm = [[(t + 7) % engine.vocab_size for t in p[:64]] for p in prompts[:4]]
    llm.generate([{"prompt_token_ids": p} for p in warm], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    engine.reset_stats()

    params = SamplingParams(n=a.n, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, max_tokens=out_len,
                            ignore_eos=True)
    profiler = _start_profiler() if a.profile else None
    t0 = time.perf_counter()
    outs, token_times = _generate_timed(llm, prompts, params)
    wall = time.perf_counter() - t0
    peak = rss.stop()

    out_toks = sum(len(c.token_ids) for o in outs for c in o.outputs)
    prompt_toks = sum(len(p) for p in prompts)
    st = engine.stats
    import torch
    result = {
        "engine": "pagellm", "dtype": str(engine.config.torch_dtype).replace("torch.", ""),
        "kv_cache_dtype": engine.config.kv_cache_dtype, "linears": engine.model.linear_kernels,
        "attention_fp16_sums": bool(getattr(engine.model.backend, "fp16_sums", False)),
        "requests": len(prompts), "prompt_tokens": prompt_toks, "output_tokens": out_toks,
        "wall_s": round(wall, 3), "output_tok_per_s": round(out_toks / wall, 2),
        "total_tok_per_s": round((prompt_toks + out_toks) / wall, 2), "peak_rss_mb": round(peak, 1),
        "kv_slot_efficiency": round(st.kv_slot_efficiency_at_peak, 4),
        "block_size": engine.config.block_size, "num_kv_blocks": st.num_blocks,
        "kv_cache_mb": round(st.kv_cache_bytes / 2**20, 1), "peak_kv_blocks_used": st.peak_used_blocks,
        "preemptions": st.num_preemptions, "prompt_tokens_computed": st.prompt_tokens_computed,
        "steps": st.num_steps, "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "attention_aware_budget": engine.scheduler.attention_keys_per_token is not None,
        "sampling": {"temperature": a.temperature, "top_p": a.top_p, "top_k": a.top_k, "n": a.n},
        "threads": torch.get_num_threads(), "load_s": round(load_s, 2),
        "prefix_caching": engine.config.enable_prefix_caching,
        "prefix_cache_hit_rate": round(engine.kv_manager.prefix_hit_rate, 4),
    }
    if a.n == 1:  # (an n > 1 request's output comes when all of its sequences have ended)
        result.update(_latency_stats(prompts, token_times, t0))
    if profiler is not None:
        result["profile_s"] = _stop_profiler(profiler)
    return result


def _generate_timed(llm, prompts: list[list[int]], params) -> tuple[list, list[list[float]]]:
    """LLM.generate's loop, also noting when each request's tokens arrive (one timestamp per step output)."""
    engine = llm.llm_engine
    ids = [engine.add_request(prompt_token_ids=p, sampling_params=params) for p in prompts]
    index = {rid: i for i, rid in enumerate(ids)}
    times: list[list[float]] = [[] for _ in ids]
    counts = [0] * len(ids)
    done: dict[str, object] = {}
    while len(done) < len(ids) and engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            i = index.get(out.request_id)
            if i is None:
                continue
            n = len(out.outputs[0].token_ids)
            times[i] += [now] * (n - counts[i])
            counts[i] = n
            if out.finished:
                done[out.request_id] = out
    return [done[r] for r in ids], times


def _latency_stats(prompts: list[list[int]], times: list[list[float]], t0: float) -> dict:
    """TTFT and inter-token latency percentiles (ms) over all requests, and over the short-prompt ones
    (at most 1,024 prompt tokens) when the workload mixes lengths: how much long prefills stall decodes."""
    import numpy as np

    def pct(xs):
        return {"p50": round(float(np.percentile(xs, 50)) * 1e3, 1),
                "p99": round(float(np.percentile(xs, 99)) * 1e3, 1)} if xs else None

    itl = lambda rows: [b - a for ts in rows for a, b in zip(ts, ts[1:])]  # noqa: E731
    out = {"ttft_ms": pct([ts[0] - t0 for ts in times if ts]), "itl_ms": pct(itl(times))}
    short = [ts for p, ts in zip(prompts, times) if len(p) <= 1024]
    if len(short) < len(times):
        out["short_request_itl_ms"] = pct(itl(short))
    return out


def cmd_latency(a: argparse.Namespace) -> None:
    """Single request: TTFT (prompt to first token), TPOT (mean gap between later tokens), e2e; median of runs."""
    import random
    import statistics

    from pagellm import LLM, SamplingParams
    from pagellm.entrypoints.cli import engine_kwargs

    rss = PeakRSS()
    llm = LLM(**engine_kwargs(a))
    engine = llm.llm_engine
    rng = random.Random(a.seed)
    params = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)

    def once() -> tuple[float, float, float]:
        # a fresh prompt each run: the prefix cache must not serve a repeated one
        prompt = [rng.randrange(17, engine.vocab_size) for _ in range(a.input_len)]
        t0 = time.perf_counter()
        engine.add_request(prompt_token_ids=prompt, sampling_params=params)
        stamps = []
        while engine.has_unfinished_requests():
            if engine.step():
                stamps.append(time.perf_counter())
        ttft = stamps[0] - t0
        tpot = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)
        return ttft, tpot, stamps[-1] - t0

    for _ in range(a.num_iters_warmup):
        once()
    runs = [once() for _ in range(a.num_iters)]
    ttft, tpot, e2e = (statistics.median(x) for x in zip(*runs))
    import torch
    result = {"engine": "pagellm", "mode": "latency", "dtype": str(engine.config.torch_dtype).replace("torch.", ""),
              "kv_cache_dtype": engine.config.kv_cache_dtype, "linears": engine.model.linear_kernels,
              "attention_fp16_sums": bool(getattr(engine.model.backend, "fp16_sums", False)),
              "prompt_len": a.input_len, "output_len": a.output_len, "ttft_ms": round(ttft * 1e3, 2),
              "tpot_ms": round(tpot * 1e3, 2), "e2e_s": round(e2e, 3),
              "ttft_runs_ms": [round(r[0] * 1e3, 1) for r in runs], "threads": torch.get_num_threads(),
              "peak_rss_mb": round(rss.stop(), 1)}
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
