"""``pagellm bench agreement``: teacher-forced top-1 agreement of a low-precision run with the fp32 reference.

Free-running bf16 and fp32 generations part ways at the first near-tie and never meet again, in every engine, so
they say little about numerical quality. Teacher forcing does: the fp32 engine first generates a greedy
continuation of each prompt; the engine in the tested dtype then reads prompt + continuation in one forward pass
and predicts every continuation token; the figure is the share of positions where its top-1 equals the fp32
token. One JSON line. With ``--kv-cache-dtype fp8*`` the tested engine also stores K/V in 8 bits (the reference
keeps its fp32 cache).
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def teacher_forced_top1(engine, tokens: list[int], first: int) -> list[int]:
    """The model's top-1 prediction for positions first..len(tokens)-1, given tokens[:position] (one prefill
    of the whole sequence in blocks borrowed from the engine's pool, returned afterwards)."""
    return engine.forward_prompt(tokens, first).argmax(-1).tolist()


def cmd_agreement(a: argparse.Namespace) -> None:
    from pagellm import LLM, SamplingParams
    from pagellm.entrypoints.bench import load_workload
    from pagellm.entrypoints.cli import engine_kwargs

    meta, prompts = load_workload(a.workload)
    prompts = prompts[:a.num_prompts] if a.num_prompts else prompts
    out_len = a.output_len or int(meta["output_len"])
    kwargs = engine_kwargs(a)
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)

    ref = LLM(**{**kwargs, "dtype": "float32", "kv_cache_dtype": "auto"})
    conts = [o.outputs[0].token_ids for o in ref.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)]
    del ref

    test = LLM(**kwargs)
    engine = test.llm_engine
    per_prompt = []
    for p, c in zip(prompts, conts):
        pred = teacher_forced_top1(engine, list(p) + list(c), len(p))
        per_prompt.append(float(np.mean([x == y for x, y in zip(pred, c)])))
    total = sum(len(c) for c in conts)
    agree = sum(m * len(c) for m, c in zip(per_prompt, conts)) / total
    sys.stdout.write(json.dumps({
        "engine": "pagellm", "mode": "teacher_forced_agreement", "reference_dtype": "float32",
        "dtype": str(engine.config.torch_dtype).replace("torch.", ""), "kv_cache_dtype": engine.config.kv_cache_dtype,
        "linears": engine.model.linear_kernels,
        "attention_fp16_sums": bool(getattr(engine.model.backend, "fp16_sums", False)), "prompts": len(prompts),
        "positions": total, "top1_agreement": round(agree, 4),
        "min_prompt_agreement": round(min(per_prompt), 4)}) + "\n")


def add_parser(bsub, engine_args) -> None:
    ag = bsub.add_parser("agreement", help="teacher-forced top-1 agreement with the fp32 reference (one JSON line)")
    ag.add_argument("--workload", required=True, help="workload JSON: {meta: {output_len}, prompts: [[ids]]}")
    ag.add_argument("--num-prompts", type=int, default=None, help="use only the first N prompts")
    ag.add_argument("--output-len", type=int, default=None, help="continuation length (default: the workload's)")
    engine_args(ag)
    ag.set_defaults(func=cmd_agreement)
