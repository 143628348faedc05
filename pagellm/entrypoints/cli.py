"""Command line: ``pagellm generate``, ``pagellm serve``, ``pagellm bench throughput|serve``."""
from __future__ import annotations

import argparse
import logging
import sys


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint dir or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", default="32", help="8, 16, 32 or auto")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--kv-cache-memory", default=None, help="KV cache budget, e.g. 2GiB")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="KV cache element type: auto (the model's) or 8-bit float (half the bytes per token)")
    p.add_argument("--no-reduced-precision-reduction", dest="reduced_precision_reduction", action="store_false",
                   help="bf16 linears sum in fp32 only (by default, on AVX512-FP16 CPUs without AMX, partial sums of "
                        "32 products run in fp16)")
    p.add_argument("--no-gguf-quantized-linears", dest="gguf_quantized_linears", action="store_false",
                   help="bf16 from a GGUF file: linears use only the dequantized weights (by default, at up to 4 "
                        "rows they read the file's quants: Q4_x, Q5_x, Q8_0, Q4_K, Q5_K, Q6_K)")
    p.add_argument("--no-gguf-int8-activations", dest="gguf_int8_activations", action="store_false",
                   help="bf16 from a GGUF file on CPUs with AVX512-VNNI but no AMX: linears keep bf16 inputs (by "
                        "default, past 4 rows, they take int8 dot products: the weight rounded to int8 per output "
                        "column or 32-deep block, x per row, as vLLM's dynamic per-token int8 linears; and up to 4 "
                        "rows a 4-bit weight's nibbles meet x in int8, on AVX2 too)")
    p.add_argument("--no-attention-aware-budget", dest="attention_aware_budget", action="store_false",
                   help="every token counts one against --max-num-batched-tokens (by default a prefill chunk's "
                        "attention counts too, so chunks deep into long prompts shrink)")
    p.add_argument("--kv-cache-prefault", default="1GiB",
                   help="CPU: KV cache to map at start-up, so the first requests' blocks take no page faults "
                        "(e.g. 1GiB; 0: none)")
    p.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    p.add_argument("--swap-space", default="1GiB", help="host memory for swapped-out KV blocks")
    p.add_argument("--seed", type=int, default=0)


def engine_kwargs(a: argparse.Namespace) -> dict:
    bs = a.block_size if a.block_size == "auto" else int(a.block_size)
    return dict(model=a.model, dtype=a.dtype, max_model_len=a.max_model_len, block_size=bs,
                max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                enable_chunked_prefill=a.enable_chunked_prefill, enable_prefix_caching=a.enable_prefix_caching,
                kv_cache_memory=a.kv_cache_memory, kv_cache_dtype=a.kv_cache_dtype,
                reduced_precision_reduction=a.reduced_precision_reduction,
                gguf_quantized_linears=a.gguf_quantized_linears,
                gguf_int8_activations=a.gguf_int8_activations, attention_aware_budget=a.attention_aware_budget,
                kv_cache_prefault=a.kv_cache_prefault, preemption_mode=a.preemption_mode,
                swap_space=a.swap_space, seed=a.seed)


def cmd_generate(a: argparse.Namespace) -> None:
    from pagellm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(a))
    params = SamplingParams(temperature=a.temperature, top_p=a.top_p, max_tokens=a.max_tokens, seed=a.sampling_seed)
    prompts = a.prompts
    if a.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        if len(prompts) > 1:
            print(f"### {p}")
        print(o.outputs[0].text)
        if len(prompts) > 1:
            print()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s",
                        stream=sys.stderr)
    ap = argparse.ArgumentParser(prog="pagellm", description="PagedAttention LLM inference engine")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one or more prompts and print the completions")
    g.add_argument("prompts", nargs="+")
    _engine_args(g)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    g.set_defaults(func=cmd_generate)

    from pagellm.entrypoints.serve import add_parser as add_serve

    add_serve(sub, _engine_args)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    t = bsub.add_parser("throughput", help="offline throughput on a token-id workload (one JSON line)")
    t.add_argument("--workload", help="workload JSON: {meta: {output_len}, prompts: [[ids]]}; without it, a random "
                                      "workload from --input-len, --output-len and --num-prompts (as vLLM's)")
    t.add_argument("--num-prompts", type=int, default=None,
                   help="use only the first N prompts (a random workload: N prompts, 64 by default)")
    t.add_argument("--input-len", type=int, default=None, help="a random workload's prompt length")
    t.add_argument("--output-len", type=int, default=None,
                   help="tokens generated per request (default: the workload's output_len)")
    t.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="a random workload's prompt lengths spread uniformly over input-len x [1 - r, 1 + r]")
    t.add_argument("--compare-prefix-caching", action="store_true",
                   help="run with prefix caching, then without, and print both lines plus the drop/speed-up")
    t.add_argument("--profile", action="store_true",
                   help="torch profiler: seconds per phase (schedule, inputs, forward, attention, mlp, sample, "
                        "detokenize) in the JSON line, top ops on stderr")
    t.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy, as the workloads specify")
    t.add_argument("--top-p", type=float, default=1.0)
    t.add_argument("--top-k", type=int, default=0)
    t.add_argument("--n", type=int, default=1, help="sequences per prompt (parallel sampling; its requests report "
                                                     "when all of their sequences end, so no TTFT or ITL)")
    _engine_args(t)
    from pagellm.entrypoints.bench import cmd_throughput
    t.set_defaults(func=cmd_throughput)
    lat = bsub.add_parser("latency", help="single-request TTFT / TPOT (one JSON line)")
    lat.add_argument("--input-len", type=int, default=128)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--num-iters", type=int, default=3)
    lat.add_argument("--num-iters-warmup", type=int, default=1)
    _engine_args(lat)
    from pagellm.entrypoints.bench import cmd_latency
    lat.set_defaults(func=cmd_latency)
    from pagellm.entrypoints.bench_serve import add_parser as add_bench_serve
    add_bench_serve(bsub)
    from pagellm.entrypoints.bench_agreement import add_parser as add_bench_agreement
    add_bench_agreement(bsub, _engine_args)

    a = ap.parse_args(argv)
    a.func(a)


if __name__ == "__main__":
    main()
