"""Micro-benchmarks of the CPU kernels against the torch paths they replace; one JSON line per measurement.

    .venv/bin/python bench/kernels.py            # ~1 min; figures quoted in layers/linear.py and cpu_attention.py

Linear layers: the 120 layer linears of SmolLM2-135M (random bf16 weights, 270 MB: more than the caches hold) at
several row counts, by every path this CPU has (plain F.linear, AMX, FMA, streaming, oneDNN packed), and on GGUF
blocks at 1 and 4 rows (x as it is, and in int8 for 4-bit weights) against the streaming kernel, and at 8-2,048
rows by the int8 dot-product kernel on 4-bit weights (AVX512-VNNI) against the bf16 tile kernels on the same
weights dequantized; the fused
element-wise ops against torch; the gate/up layer with silu(gate) * up in its epilogue against the two steps.
Attention: 64 decode rows over 362-token contexts
in shuffled blocks, and 4 chunks after a 500-token context (where the C++ kernel hands over to SDPA); the paged
kernel over bf16 and fp8 caches, and with fp32 against fp16 partial sums. Argmax: greedy sampling over [64, 49152] logits,
and a greedy LM head by its logits or by the int8 screen (AVX512-VNNI CPUs without AMX), at 64 rows and at 1-4 rows
against a Q8_0 head's few-row kernel.
Each figure is the median of a few repetitions; the machine is noisy, compare the columns of one line.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_attention import make_case  # noqa: E402  (the attention tests' case builder)
from test_gguf_linear import random_blocks  # noqa: E402  (the GGUF tests' block builder)

from pagellm.model_executor.layers.attention import TorchPagedAttention  # noqa: E402
from pagellm.model_executor.layers.cpu_attention import CPUPagedAttention  # noqa: E402
from pagellm.model_executor.layers.cpu_kernels import load_extension  # noqa: E402
from pagellm.model_executor.layers.linear import CPUKernels, CPULinear, cpu_kernels  # noqa: E402
from pagellm.model_executor.layers.weight_forms import gguf_int8_form, pack_amx, pack_fp16, vnni_int8_form  # noqa: E402
from pagellm.model_executor.layers.quantized import GGUFWeight  # noqa: E402


def best_ms(fs: dict, rounds: int = 5, digits: int = 2) -> dict:
    """Median time of each function, measured round-robin (one call of each per round) so that a slow spell of
    the machine hits every column alike."""
    times = {name: [] for name in fs}
    for f in fs.values():
        f()
    for _ in range(rounds):
        for name, f in fs.items():
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    return {name: round(statistics.median(ts) * 1e3, digits) for name, ts in times.items()}


def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def linears(ops) -> None:
    have = cpu_kernels(ops, torch.bfloat16)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down: [N, K]
    weights = [[torch.randn(n, k, dtype=torch.bfloat16) for n, k in shapes] for _ in range(30)]
    paths = {"plain": None}
    if have is not None and have.amx is not None:
        paths["amx"] = CPUKernels(amx=have.amx)
    if have is not None and have.gemv is not None:
        paths["streaming"] = CPUKernels(gemv=have.gemv)
    if ops.fma_linear_supported():  # the FMA tile kernel (AVX-512 CPUs without AMX; runs on AMX CPUs too)
        paths["fma"] = CPUKernels(fma=ops.fma_linear.default, fma_silu_mul=ops.fma_linear_silu_mul.default)
        if ops.fma_linear_dot_supported():  # AVX512-BF16's dot products (AMD's default)
            paths["fma_dot"] = CPUKernels(fma=ops.fma_linear.default, fma_silu_mul=ops.fma_linear_silu_mul.default,
                                          fma_dot=True)
        if ops.fma_linear_fp16_supported():  # on an fp16 weight, fp16 partial sums (reduced_precision_reduction)
            paths["fma_fp16"] = CPUKernels(fma=ops.fma_linear.default, fma_silu_mul=ops.fma_linear_silu_mul.default,
                                           fma_fp16=True)
    paths["onednn_packed"] = CPUKernels(onednn_packing=True)
    layers = {name: [[CPULinear(w, None, k) for w in ws] for ws in weights] for name, k in paths.items() if k}
    for rows in (1, 4, 64, 256, 512, 1024, 2048):
        x = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in (576, 1536)}
        fs = {"plain": lambda: [F.linear(x[w.shape[1]], w) for ws in weights for w in ws]}
        for name, ls in layers.items():
            fs[name] = lambda ls=ls: [lin(x[lin.weight.shape[1]]) for row in ls for lin in row]
        emit(bench="120 linears, ms", rows=rows, **best_ms(fs))


def attention() -> None:
    for name, q_lens, ctx in [("64 decodes x 362", [1] * 64, [362] * 64),
                              ("4 chunks of 16 after 500", [16] * 4, [516] * 4),
                              ("4 chunks of 32 after 500", [32] * 4, [532] * 4),
                              ("4 chunks of 64 after 500", [64] * 4, [564] * 4)]:
        fs = {}
        for cls in (TorchPagedAttention, CPUPagedAttention):
            be = cls(3, 64, 16)
            args = make_case(be, q_lens, ctx, 16, torch.bfloat16, 9, 3, 64)[:5]
            fs[cls.__name__] = lambda be=be, args=args: be.forward(*args, 0.125, None)
        emit(bench="attention layer, ms", case=name, **best_ms(fs, rounds=5))
    # prefill chunks: the CPU backend's AMX kernel against its SDPA fallback (the same backend, one flag)
    for name, q_lens, ctx in [("4 prompts of 300", [300] * 4, [300] * 4),
                              ("2 prompts of 512", [512] * 2, [512] * 2),
                              ("a 512-row chunk after 6488", [512], [7000]),
                              ("a 2048-row chunk after 4952", [2048], [7000])]:
        be = CPUPagedAttention(3, 64, 16)
        if not be.amx_prefill:
            return
        args = make_case(be, q_lens, ctx, 16, torch.bfloat16, 9, 3, 64)[:5]

        def run(amx, be=be, args=args):
            be.amx_prefill = amx
            be.forward(*args, 0.125, None)
        emit(bench="prefill attention layer, ms", case=name,
             **best_ms({"amx": lambda: run(True), "sdpa": lambda: run(False)}, rounds=5))


def kv_cache_dtypes() -> None:
    """The paged kernel over a bf16 cache against fp8 ones (kv_cache_dtype): a decode step's 30 layers of 64 rows
    over 362-token contexts (~530 MB of bf16 K/V, more than the caches hold), and prefill chunks."""
    dtypes = {"bf16": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
    for name, q_lens, ctx, layers in [("64 decodes x 362, 30 layers", [1] * 64, [362] * 64, 30),
                                      ("4 prompts of 300", [300] * 4, [300] * 4, 1),
                                      ("16 chunks of 64 after 500", [64] * 16, [564] * 16, 1),
                                      ("a 2048-row chunk after 4952", [2048], [7000], 1)]:
        fs = {}
        for label, kv in dtypes.items():
            be = CPUPagedAttention(3, 64, 32, kv)
            cases = [make_case(be, q_lens, ctx, 32, torch.bfloat16, 9, 3, 64, seed=i)[:5] for i in range(layers)]
            fs[label] = lambda be=be, cases=cases: [be.forward(*args, 0.125, None) for args in cases]
        emit(bench="paged attention by cache dtype, ms", case=name, **best_ms(fs, rounds=5))


def attention_sums(ops) -> None:
    """The paged kernel's prefill chunks with fp32 partial sums against fp16 ones (CPUs with AVX512-FP16,
    csrc/attention_fp16.h): the chunks of a 7,000-token prompt at the default budget, one layer of SmolLM2."""
    if not ops.paged_attention_fp16_supported():
        return
    for q_len, ctx in [(2048, 2048), (2048, 4096), (2048, 6144), (856, 7000)]:
        be = CPUPagedAttention(3, 64, 32)
        args = make_case(be, [q_len], [ctx], 32, torch.bfloat16, 9, 3, 64)[:5]

        def run(fp16, be=be, args=args):
            be.fp16_sums = fp16
            be.forward(*args, 0.125, None)
        emit(bench="prefill attention sums, ms", case=f"{q_len} rows after {ctx - q_len}",
             **best_ms({"fp32_sums": lambda: run(False), "fp16_sums": lambda: run(True)}, rounds=5))


def small_ops(ops) -> None:
    """The fused element-wise kernels against the torch ops they replace, on SmolLM2's shapes."""
    for rows in (64, 2048):
        gu = torch.randn(rows, 3072, dtype=torch.bfloat16)
        act = torch.empty(rows, 1536, dtype=torch.bfloat16)
        h, r, w = (torch.randn(rows, 576, dtype=torch.bfloat16), torch.randn(rows, 576, dtype=torch.bfloat16),
                   torch.randn(576, dtype=torch.bfloat16))
        qkv = torch.randn(rows, 960, dtype=torch.bfloat16)
        q, k = qkv[:, :576].view(rows, 9, 64), qkv[:, 576:768].view(rows, 3, 64)
        cos, sin = torch.randn(rows, 64, dtype=torch.bfloat16), torch.randn(rows, 64, dtype=torch.bfloat16)
        emit(bench="small ops, us", rows=rows, **{name: round(ms * 1e3, 1) for name, ms in best_ms({
            "silu_and_mul": lambda: ops.silu_and_mul(gu, act),
            "torch_silu_mul": lambda: F.silu(gu[:, :1536]) * gu[:, 1536:],
            "add_rms_norm": lambda: ops.add_rms_norm(h, r, w, 1e-5),
            "torch_add_rms_norm": lambda: torch_add_rms_norm(h, r, w),
            "rotary": lambda: ops.rotary_embedding(q, k, cos, sin),
        }, rounds=20, digits=4).items()})


def gate_up_silu(ops) -> None:
    """SmolLM2's gate/up layer with silu(gate) * up: in the AMX GEMM's epilogue against the GEMM into gate_up and
    then silu_and_mul (30 layers' weights, so they stream from memory as in a step)."""
    if not ops.amx_linear_supported():
        return
    ws = [pack_amx(torch.randn(3072, 576, dtype=torch.bfloat16) * 0.05) for _ in range(30)]
    for rows in (64, 2048):
        x = torch.randn(rows, 576, dtype=torch.bfloat16)
        gu, act = torch.empty(rows, 3072, dtype=torch.bfloat16), torch.empty(rows, 1536, dtype=torch.bfloat16)
        emit(bench="30 gate/up layers with silu * up, ms", rows=rows, **best_ms({
            "fused_epilogue": lambda: [ops.amx_linear_silu_mul(x, w, None, act) for w in ws],
            "gemm_then_silu_and_mul": lambda: [(ops.amx_linear(x, w, None, gu), ops.silu_and_mul(gu, act)) for w in ws],
        }))


def gguf_blocks(ops) -> None:
    """A decode step's linears at 1 and 4 rows on GGUF blocks, x as it is and (4-bit weights, where the kernel
    builds) in int8, against the bf16 streaming kernel on the same weights dequantized (random blocks): SmolLM2's 120 layer linears (Q4_1) and LM head (Q8_0), as the default model's file;
    and four layers of TinyLlama-1.1B's shapes (hidden 2,048, intermediate 5,632) mixed as llama.cpp's Q4_K_M mixes
    them: Q4_K, with v and down in Q6_K (re-packed at load, layers/quantized.py)."""
    if not (ops.gguf_linear_supported() and ops.small_m_linear_supported()):
        return
    def blocks(kind, n, k):  # the GGUF tests' random blocks (quants, scales in a model's range)
        return GGUFWeight.from_blocks(kind, random_blocks(kind, n, k, seed=n + k))

    smol = [("Q4_1", 960, 576), ("Q4_1", 576, 576), ("Q4_1", 3072, 576), ("Q4_1", 576, 1536)] * 30
    smol.append(("Q8_0", 49152, 576))
    tiny_llama = [("Q4_K", 2048, 2048), ("Q4_K", 256, 2048), ("Q6_K", 256, 2048), ("Q4_K", 2048, 2048),
                  ("Q4_K", 11264, 2048), ("Q6_K", 2048, 5632)] * 4
    for name, shapes in (("SmolLM2 Q4_1 / Q8_0, 120 linears + LM head", smol),
                         ("TinyLlama shapes Q4_K / Q6_K, 4 layers", tiny_llama)):
        ws = [blocks(kind, n, k) for kind, n, k in shapes]
        dense = [w.dequantize().bfloat16() for w in ws]
        # the 4-bit weights' int8-x forms (gguf_int8_linear), where this CPU has the kernel; the others exact
        int8 = [gguf_int8_form(w) if w.kind == "q4_1" and ops.gguf_int8_linear_supported() else None for w in ws]
        for rows in (1, 4):
            xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in {w.shape[1] for w in ws}}
            outs = [torch.empty(rows, w.shape[0], dtype=torch.bfloat16) for w in ws]
            fs = {
                "gguf_blocks": lambda: [ops.gguf_linear(xs[w.shape[1]], w.qs, w.scales, None, o)
                                        for w, o in zip(ws, outs)],
                "gguf_int8_x": lambda: [ops.gguf_int8_linear(xs[w.shape[1]], *f, None, o) if f
                                        else ops.gguf_linear(xs[w.shape[1]], w.qs, w.scales, None, o)
                                        for w, f, o in zip(ws, int8, outs)],
                "bf16_streaming": lambda: [ops.small_m_linear(xs[d.shape[1]], d, None, o) for d, o in zip(dense, outs)],
            }
            if not any(int8):
                del fs["gguf_int8_x"]
            emit(bench="decode linears on GGUF blocks, ms", weights=name, rows=rows, **best_ms(fs, rounds=10))
        del ws, dense


def int8_linears(ops) -> None:
    """SmolLM2's 120 layer linears on random Q4_1 blocks: vnni_int8_linear (the weight rounded to int8 per output
    column, x per row but for 8 outlier channels, EngineConfig.gguf_int8_activations; what CPUs without AMX run past
    4 rows; int8_vnni_block: a step per 32-deep block, as weights of finer steps take it) against the tile kernels
    this CPU has on the dequantized bf16 weights (gate/up in their silu(gate) * up forms)."""
    if not ops.vnni_int8_linear_supported():
        return
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30
    ws = [GGUFWeight.from_blocks("Q4_1", random_blocks("Q4_1", n, k, seed=n + k + i)) for i, (n, k) in
          enumerate(shapes)]
    int8 = [vnni_int8_form(w) for w in ws]
    int8_block = [vnni_int8_form(w, per_block=True) for w in ws]
    packed = [pack_amx(w.dequantize().bfloat16()) for w in ws]
    tiles = {}
    if ops.amx_linear_supported():
        tiles["amx"] = (ops.amx_linear, ops.amx_linear_silu_mul, ())
    if ops.fma_linear_supported():
        tiles["fma"] = (ops.fma_linear, ops.fma_linear_silu_mul, (1.0, 0))
        if ops.fma_linear_dot_supported():
            tiles["fma_dot"] = (ops.fma_linear, ops.fma_linear_silu_mul, (1.0, 1))
    fp16 = [pack_fp16(w.dequantize().bfloat16()) for w in ws] if ops.fma_linear_fp16_supported() else None
    for rows in (8, 64, 256, 2048):
        xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in (576, 1536)}
        outs = [torch.empty(rows, n // 2 if n == 3072 else n, dtype=torch.bfloat16) for n, _ in shapes]
        fs = {name: lambda forms=forms: [ops.vnni_int8_linear(xs[w.shape[1]], *q, None, o, w.shape[0] == 3072)
                                         for w, q, o in zip(ws, forms, outs)]
              for name, forms in (("int8_vnni", int8), ("int8_vnni_block", int8_block))}
        for name, (lin, silu, args) in tiles.items():
            fs[name] = lambda lin=lin, silu=silu, args=args: [
                (silu if w.shape[0] == 3072 else lin)(xs[w.shape[1]], p, None, o, *args)
                for w, p, o in zip(ws, packed, outs)]
        if fp16:  # the AMX-less kind's default without the int8 path: fp16 FMAs (reduced_precision_reduction)
            fs["fma_fp16"] = lambda: [(ops.fma_linear_silu_mul if w.shape[0] == 3072 else ops.fma_linear)(
                xs[w.shape[1]], p, None, o, inv, 0) for w, (p, inv), o in zip(ws, fp16, outs)]
        emit(bench="120 linears on Q4_1 weights, int8 x against bf16 tiles, ms", rows=rows, **best_ms(fs))
    int8_thread_scaling(ops, ws, int8)
    del ws, int8, int8_block, packed, fp16


def int8_thread_scaling(ops, ws, forms, rows: int = 64) -> None:
    """The 120 int8 linears of a decode step on one thread and on all: their weights streamed from memory (120
    distinct) or reused from cache (the 4 shapes' first weights, 30 times each)."""
    threads = torch.get_num_threads()
    xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in (576, 1536)}
    outs = [torch.empty(rows, w.shape[0] // 2 if w.shape[0] == 3072 else w.shape[0], dtype=torch.bfloat16)
            for w in ws]

    def run(order):
        for i in order:
            ops.vnni_int8_linear(xs[ws[i].shape[1]], *forms[i], None, outs[i], ws[i].shape[0] == 3072)

    streamed, resident = list(range(len(ws))), [i % 4 for i in range(len(ws))]
    def at(order, t):
        torch.set_num_threads(t)
        run(order)

    fs = {}
    for t in sorted({1, threads}):
        fs[f"streamed_{t}t"], fs[f"resident_{t}t"] = (lambda t=t: at(streamed, t)), (lambda t=t: at(resident, t))
    ms = best_ms(fs, rounds=7)
    torch.set_num_threads(threads)
    emit(bench=f"120 int8 linears at {rows} rows on 1 and {threads} threads, ms", **ms,
         speedup_streamed=round(ms["streamed_1t"] / ms[f"streamed_{threads}t"], 2),
         speedup_resident=round(ms["resident_1t"] / ms[f"resident_{threads}t"], 2))


def torch_add_rms_norm(h, r, w):  # HF's skip connection and LlamaRMSNorm
    res = h + r
    x = res.float()
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)).to(res.dtype), res


def argmax(ops) -> None:
    logits = torch.randn(64, 49152, dtype=torch.bfloat16)
    out = torch.empty(64, dtype=torch.int64)
    emit(bench="greedy argmax [64, 49152], ms", **best_ms({"cpp_bf16": lambda: ops.argmax_rows(logits, out),
                                                           "torch_fp32_copy_and_argmax": lambda: logits.float().argmax(-1)},
                                                          rounds=10))


def lm_head_screen(ops) -> None:
    """A greedy LM head at 64 rows, SmolLM2's shape: the FMA kernel's logits and argmax_rows, against the int8 screen
    (CPULinear.argmax). The rows are made to look like a final norm's output where it matters to the screen: four
    channels 10-40x the rest, and one column's logit standing ~8 spreads above the others (SmolLM2 on workload_64's
    decode rows: ~34 against a spread of ~4), so the screen keeps about as few columns as it does there."""
    kernels = cpu_kernels(ops, torch.bfloat16)
    if kernels is None or kernels.screen_argmax is None:
        return
    w = (torch.randn(49152, 576) * 0.04).bfloat16()
    head = CPULinear(w, None, kernels)
    head.enable_argmax_screen()
    target = torch.randint(0, 49152, (64,))
    x = torch.randn(64, 576) + 5 * w[target].float() / w[target].float().pow(2).mean(dim=1, keepdim=True).sqrt()
    x[:, [17, 199, 371, 481]] *= torch.tensor([40.0, -25.0, 15.0, 10.0])
    x = x.bfloat16()
    logits = torch.empty(64, 49152, dtype=torch.bfloat16)
    out = torch.empty(64, dtype=torch.int64)
    assert torch.equal(head.argmax(x), head(x).float().argmax(-1))
    emit(bench="greedy LM head [64 x 576] @ [49152 x 576]^T, ms", **best_ms({
        "logits_then_argmax": lambda: (head.tiled(x, head.amx_weight, None, logits, *head.tiled_args),
                                       ops.argmax_rows(logits, out)),
        "int8_screen": lambda: head.argmax(x)}, rounds=10))


def few_row_lm_head(ops) -> None:
    """A greedy LM head at 1-4 rows on a Q8_0 GGUF head (SmolLM2's: its tied embeddings), what decode with a few
    requests runs: the few-row kernel on the blocks then argmax_rows, against the int8 screen (CPULinear.argmax,
    from SCREEN_MIN_ROWS rows off AMX). Each call first streams 64 MB through the caches, as a decode step's layer
    weights do (so the head's 28-30 MB are not in the L3); "flush" is that alone."""
    kernels = cpu_kernels(ops, torch.bfloat16)
    if kernels is None or kernels.screen_argmax is None or not ops.gguf_linear_supported():
        return
    q = GGUFWeight.from_blocks("Q8_0", random_blocks("Q8_0", 49152, 576, seed=1))
    w = q.dequantize().bfloat16()
    head = CPULinear(w, None, kernels)
    head.enable_argmax_screen()
    big = torch.ones(64 << 20, dtype=torch.uint8)
    for rows in (1, 2, 3, 4):
        target = torch.randint(0, 49152, (rows,))
        x = torch.randn(rows, 576) + 5 * w[target].float() / w[target].float().pow(2).mean(dim=1, keepdim=True).sqrt()
        x[:, [17, 199, 371, 481]] *= torch.tensor([40.0, -25.0, 15.0, 10.0])
        x = x.bfloat16()
        logits, out = torch.empty(rows, 49152, dtype=torch.bfloat16), torch.empty(rows, dtype=torch.int64)
        assert torch.equal(head.argmax(x), head(x).float().argmax(-1))
        emit(bench="greedy Q8_0 LM head at few rows, 64 MB streamed first, ms", rows=rows, **best_ms({
            "flush": lambda: big.add_(1),
            "gguf_blocks_then_argmax": lambda: (big.add_(1), ops.gguf_linear(x, q.qs, q.scales, None, logits),
                                                ops.argmax_rows(logits, out)),
            "int8_screen": lambda: (big.add_(1), head.argmax(x))}, rounds=10))


if __name__ == "__main__":
    ops = load_extension()
    torch.manual_seed(0)
    linears(ops)
    gguf_blocks(ops)
    int8_linears(ops)
    small_ops(ops)
    gate_up_silu(ops)
    attention()
    attention_sums(ops)
    kv_cache_dtypes()
    argmax(ops)
    lm_head_screen(ops)
    few_row_lm_head(ops)
