"""The int8 dot-product linear on a GGUF weight (csrc/vnni_int8_linear_cpu.cpp: vnni_int8_linear;
layers/quantized.py: pack_vnni_int8), for CPUs with AVX512-VNNI but no AMX: the weight's values rounded to int8 per
output column (s = max|w| / 127) or per 32-deep block of it, x to int8 per row (dx = max|x| / 127), both ties to
even, int32 sums. Its output must be that math's within bf16's rounding, x's int8 values exactly those described,
the silu form the two steps bit for bit, and the packing's excess over the file's own rounding the one computed by
hand. Where the engine takes it (CPULinear, the C++ layer loop) is test_vnni_int8_choice.py's. AMX machines run it
too (the engine only picks it without AMX), so these tests run wherever the CPU has AVX512-VNNI."""
from __future__ import annotations

import pytest
import torch

from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from pagellm.model_executor.layers.cpu_kernels import load_extension
from pagellm.model_executor.layers.linear import VNNI_INT8_MAX_EXCESS, VNNI_INT8_MAX_K
from pagellm.model_executor.layers.quantized import GGUFParts, GGUFWeight, pack_vnni_int8
from pagellm.model_executor.layers.weight_forms import INT8_OUTLIER_CHANNELS, vnni_int8_form
from test_gguf_linear import random_blocks

ops = load_extension()
needs_vnni = pytest.mark.skipif(not ops.vnni_int8_linear_supported(), reason="CPU without AVX512-VNNI")


def round_to_int8(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v's int8 values and steps along its last dimension, as the kernel and its packing make them (fp32): step =
    max|v| / 127, values round(v * (1 / step)), ties to even; an all-zero v: step 0, values 0."""
    v = v.float()
    step = v.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    return torch.round(v * inv), step


def int8_weight(q: GGUFWeight | GGUFParts, per_block: bool = False) -> torch.Tensor:
    """The weight as the kernel holds it (fp32 [N, K]): its exact values rounded to int8 steps per output column,
    or per 32-deep block of it."""
    w = q.dequantize()
    if per_block:
        w8, step = round_to_int8(w.view(w.shape[0], -1, 32))
        return (w8 * step).view(w.shape)
    w8, step = round_to_int8(w)
    return w8 * step


def int8_math(x: torch.Tensor, q: GGUFWeight, bias: torch.Tensor | None = None,
              channels: torch.Tensor | None = None, per_block: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, sum of |terms|) in fp64: x rounded to int8 per row against int8_weight; the outlier channels (if any)
    zeroed before x is quantized and then taken as they are."""
    xz = x.clone()
    if channels is not None:
        xz[:, channels.long()] = 0
    xq, d = round_to_int8(xz)
    xd = (xq * d).double()
    if channels is not None:
        xd[:, channels.long()] = x[:, channels.long()].double()
    w = int8_weight(q, per_block).double()
    y, size = xd @ w.t(), xd.abs() @ w.abs().t()
    if bias is not None:
        y, size = y + bias.double(), size + bias.double().abs()
    return y, size


@pytest.mark.parametrize("per_block", [False, True])
@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "parts"])
def test_pack_vnni_int8_puts_each_weight_where_the_kernel_reads_it(kind, per_block):
    # unpacked by hand: byte 4 n + e of row j of tile t, block b, holds column 16 t + n at depth 32 b + 4 j + e;
    # 40 columns: the third tile's last 8 columns are zeros. Every layout the blocks come in, and a fused weight of
    # two (Q4_K_M's q and k in Q4_K, v in Q6_K), rows across the parts' boundary in one tile. A step per column, or
    # per 32-deep block (scales [tile, block, 2, 16])
    if kind == "parts":
        q = GGUFWeight.cat([GGUFWeight.from_blocks("Q4_K", random_blocks("Q4_K", 24, 256, seed=3)),
                            GGUFWeight.from_blocks("Q6_K", random_blocks("Q6_K", 16, 256, seed=4))])
        assert isinstance(q, GGUFParts)
    else:
        q = GGUFWeight.from_blocks(kind, random_blocks(kind, 40, 256, seed=3))
    q8, sc, _ = pack_vnni_int8(q, per_block=per_block)
    assert q8.shape == (3, 8, 8, 64) and q8.dtype == torch.int8
    assert sc.shape == ((3, 8, 2, 16) if per_block else (3, 2, 16)) and sc.dtype == torch.float32
    w8 = q8.view(3, 8, 8, 16, 4).permute(0, 3, 1, 2, 4).reshape(48, 8, 32).float()  # [t n, b, j e]
    if per_block:  # [t, b, n] -> [t n, b, 1]
        step, offset = (sc[:, :, i].permute(0, 2, 1).reshape(48, 8, 1) for i in (0, 1))
        sums = w8.sum(-1)
    else:
        step, offset = (sc[:, i].reshape(48, 1, 1) for i in (0, 1))
        sums = w8.sum((-2, -1))[:, None]
    offset = offset.contiguous().view(torch.int32).reshape(48, -1)
    assert torch.equal((w8 * step).view(48, 256)[:40], int8_weight(q, per_block))
    assert not w8[40:].any() and not step[40:].any()
    assert torch.equal(offset, -128 * sums.int())
    # each value at most half a step from the exact weight, each column's (block's) largest at +-127 steps
    w = q.dequantize().view(40, 8, 32)
    assert ((w8[:40] * step[:40] - w).abs() <= step[:40] * (0.5 + 2**-16)).all()
    assert ((w8[:40].abs().amax(-1) if per_block else w8[:40].abs().amax((-2, -1))) == 127).all()


def test_pack_vnni_int8_in_pieces_is_the_same(monkeypatch):
    # made DEQUANT_FLOATS values at a time, whole 16-column tiles: here 1 or 2 tiles a piece, the last one partial
    # (40 columns); the outlying block makes its column's excess the largest, in the second piece
    from pagellm.model_executor.layers import quantized

    raw = random_blocks("Q4_1", 40, 96, seed=6)
    raw.view(40, 3, 20)[21, 1, :4] = torch.tensor([0.0, 40.0]).half().view(torch.uint8)
    q = GGUFWeight.from_blocks("Q4_1", raw)
    whole = pack_vnni_int8(q)
    assert whole[2] > 1
    for floats in (16 * 96, 32 * 96):
        monkeypatch.setattr(quantized, "DEQUANT_FLOATS", floats)
        q8, sc, excess = pack_vnni_int8(q)
        assert torch.equal(q8, whole[0]) and excess == whole[2]
        assert torch.equal(sc.view(torch.int32), whole[1].view(torch.int32))  # (the offsets: int32 bits)


@needs_vnni
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 5, 17, 64, 300])
def test_the_int8_math_within_bf16_rounding(kind, rows):
    # plain with and without bias, N not a multiple of 32 (a lone 16-column tile, 8 padded columns), K = 1,536
    # (down's); x rows strided; 300 rows: two 256-row chunks
    for n, k in ((40, 256), (96, 1536), (576, 512)):
        q = GGUFWeight.from_blocks(kind, random_blocks(kind, n, k, seed=rows + n))
        x = torch.randn(rows, k + 32).bfloat16()[:, :k]
        for bias in (None, torch.randn(n).bfloat16()):
            for per_block in (False, True):  # a step per column, per 32-deep block
                got = torch.full((rows, n), float("nan"), dtype=torch.bfloat16)
                ops.vnni_int8_linear(x, *vnni_int8_form(q, 0, per_block=per_block), bias, got, False)
                want, size = int8_math(x, q, bias, per_block=per_block)
                # bf16's rounding of the result, and the exact int32 sums' conversion and products in fp32
                assert ((got.double() - want).abs() <= 2**-8 * want.abs() + 2**-18 * size).all(), (n, k, per_block)
                assert got.abs().sum() > 0


@needs_vnni
def test_x_is_rounded_per_row_ties_to_even():
    # A weight of one 127 per column (Q4_1 blocks with d = 127, m = 0: a block's step is 1, its int8 value 127)
    # reads one quantized x value per output: y[r][n] = bf16(127 xq[r, n] * dx[r]) exactly, so every quant and scale
    # of x shows, including ties (x = dx * (j + 0.5)), an all-zero row, and rows holding NaN or an infinity (their
    # outputs NaN).
    k, rows = 128, 6
    x = torch.randn(rows, k) * torch.logspace(-3, 3, rows)[:, None]
    x[1] = torch.randn(k).clamp(-100, 100)
    x[1, :32] = torch.tensor([127.0] + [j + 0.5 for j in range(-15, 16)])  # dx = 1: exact ties
    x[2] = 0
    x[3, 64] = float("nan")
    x[4, 100] = float("inf")
    x = x.bfloat16()
    n = k  # column c reads depth c
    qs = torch.zeros(n, k // 32, 32, dtype=torch.uint8)
    qs[torch.arange(n), torch.arange(n) // 32, torch.arange(n) % 32] = 1
    scales = torch.zeros(n, k // 32, 2)
    scales[..., 0] = 127
    q = GGUFWeight("q4_1", (qs[..., :16] | (qs[..., 16:] << 4)).contiguous(), scales)
    got = torch.empty(rows, n, dtype=torch.bfloat16)
    ops.vnni_int8_linear(x, *vnni_int8_form(q, 0), None, got, False)
    xq, d = round_to_int8(x)
    want = (xq * 127 * d + 0.0).bfloat16()  # + 0: an integer sum has no -0
    ok = torch.ones(rows, dtype=torch.bool)
    ok[3] = ok[4] = False
    assert d[1].item() == 1.0
    assert torch.equal(got[ok].view(torch.int16), want[ok].view(torch.int16))
    assert torch.equal(xq[1, 1:32], torch.tensor([float(round(j + 0.5)) for j in range(-15, 16)]))  # ties to even
    assert not got[2].any()
    assert got[3].isnan().all() and got[4].isnan().all()


@needs_vnni
@pytest.mark.parametrize("per_block", [False, True])
def test_outlier_channels_are_chosen_once_and_taken_exactly(per_block):
    # x with 3 channels ~100x the rest: the first call picks the INT8_OUTLIER_CHANNELS channels of largest |x| over
    # its rows (the 3 among them), writes the weight's values there (its int8 form's), and every later call,
    # whatever its rows, keeps that choice; each output is the int8 math with those channels taken as they are.
    # Without them the outliers leave their rows' other values a few int8 steps: the mean error against the exact
    # product is ~10x (0.66 against 0.066; x rounded per row here, the weight to int8 in both).
    k, n = 512, 96
    q = GGUFWeight.from_blocks("Q4_1", random_blocks("Q4_1", n, k, seed=5))
    form = vnni_int8_form(q, per_block=per_block)
    _, _, channels, wc = form
    assert channels.tolist() == [-1] * INT8_OUTLIER_CHANNELS
    hot = [7, 200, 511]
    x = torch.randn(40, k)
    x[:, hot] *= 100
    x = x.bfloat16()
    got = torch.empty(40, n, dtype=torch.bfloat16)
    ops.vnni_int8_linear(x, *form, None, got, False)
    top = x.float().abs().amax(0)
    want_channels = sorted(torch.sort(top, descending=True, stable=True).indices[:INT8_OUTLIER_CHANNELS].tolist())
    assert channels.tolist() == want_channels and set(hot) <= set(want_channels)
    assert torch.equal(wc[:, :n], int8_weight(q, per_block)[:, channels.long()].t())
    want, size = int8_math(x, q, channels=channels, per_block=per_block)
    err = (got.double() - want).abs()
    assert (err <= 2**-8 * want.abs() + 2**-18 * size).all()
    plain = torch.empty(40, n, dtype=torch.bfloat16)
    ops.vnni_int8_linear(x, *vnni_int8_form(q, 0, per_block=per_block), None, plain, False)
    exact = x.double() @ q.dequantize().double().t()
    assert (plain.double() - exact).abs().mean() > 4 * (got.double() - exact).abs().mean()
    # a later call of other rows keeps the choice; a row's output does not depend on the rows beside it
    y = torch.randn(6, k).bfloat16()
    alone = torch.empty(1, n, dtype=torch.bfloat16)
    both = torch.empty(6, n, dtype=torch.bfloat16)
    ops.vnni_int8_linear(y[:1].contiguous(), *form, None, alone, False)
    ops.vnni_int8_linear(y, *form, None, both, False)
    assert channels.tolist() == want_channels
    assert torch.equal(alone.view(torch.int16), both[:1].view(torch.int16))


@needs_vnni
@pytest.mark.parametrize("per_block", [False, True])
@pytest.mark.parametrize("rows", [5, 64, 300])
def test_silu_mul_is_the_two_steps_bit_for_bit(rows, per_block):
    q = GGUFWeight.from_blocks("Q4_1", random_blocks("Q4_1", 96, 512, seed=rows))  # gate | up, 48 each
    x = torch.randn(rows, 512).bfloat16()
    bias = torch.randn(96).bfloat16()
    for b in (None, bias):
        got = torch.full((rows, 48), float("nan"), dtype=torch.bfloat16)
        form = vnni_int8_form(q, per_block=per_block)
        ops.vnni_int8_linear(x, *form, b, got, True)
        full = torch.empty(rows, 96, dtype=torch.bfloat16)
        ops.vnni_int8_linear(x, *form, b, full, False)
        want = torch.empty(rows, 48, dtype=torch.bfloat16)
        ops.silu_and_mul(full, want)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@needs_vnni
def test_the_same_bits_on_any_thread_count():
    q = GGUFWeight.from_blocks("Q4_K", random_blocks("Q4_K", 200, 512, seed=1))
    x = torch.randn(300, 512).bfloat16()
    outs = []
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            y = torch.empty(300, 200, dtype=torch.bfloat16)
            ops.vnni_int8_linear(x, *vnni_int8_form(q), None, y, False)
            outs.append(y)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(o.view(torch.int16), outs[0].view(torch.int16)) for o in outs[1:])


@needs_vnni
def test_bad_operands_get_clear_errors():
    q8, sc, ch, wc = vnni_int8_form(GGUFWeight.from_blocks("Q4_1", random_blocks("Q4_1", 32, 64)))
    x, out = torch.randn(3, 64).bfloat16(), torch.empty(3, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="q8: int8"):
        ops.vnni_int8_linear(x, q8.view(torch.uint8), sc, ch, wc, None, out, False)
    with pytest.raises(RuntimeError, match="q8: int8"):
        ops.vnni_int8_linear(torch.randn(3, 96).bfloat16(), q8, sc, ch, wc, None, out, False)  # K does not match
    with pytest.raises(RuntimeError, match="scales: float32"):
        ops.vnni_int8_linear(x, q8, sc.double(), ch, wc, None, out, False)
    with pytest.raises(RuntimeError, match="N matching q8"):
        ops.vnni_int8_linear(x, q8, sc, ch, wc, None, torch.empty(3, 48, dtype=torch.bfloat16), False)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.vnni_int8_linear(x, q8, sc, ch, wc, None, torch.empty(3, 8, dtype=torch.bfloat16), True)
    with pytest.raises(RuntimeError, match="x, out: bfloat16"):
        ops.vnni_int8_linear(x.float(), q8, sc, ch, wc, None, out, False)
    with pytest.raises(RuntimeError, match="channels: int32"):
        ops.vnni_int8_linear(x, q8, sc, ch.long(), wc, None, out, False)
    with pytest.raises(RuntimeError, match="wc: float32"):
        ops.vnni_int8_linear(x, q8, sc, ch, wc[:, :16].contiguous(), None, out, False)
    with pytest.raises(RuntimeError, match="channels: ascending"):
        ops.vnni_int8_linear(x, q8, sc, torch.tensor([5, 3] + [-1] * (len(ch) - 2), dtype=torch.int32), wc, None,
                             out, False)
    assert (ch == -1).all()  # no call above got as far as choosing
    with pytest.raises(RuntimeError, match=r"scales: float32 \[N/16, 2, 16\], or \[N/16, K/32, 2, 16\]"):
        ops.vnni_int8_linear(x, q8, vnni_int8_form(GGUFWeight.from_blocks("Q4_1", random_blocks("Q4_1", 32, 96)),
                                                   per_block=True)[1], ch, wc, None, out, False)  # K/32 = 3, not 2
    # past VNNI_INT8_MAX_K the int32 sums of a step per column could overflow: the kernel refuses that form
    # (CPULinear takes a step per 32-deep block there: test_vnni_int8_choice.py)
    deep = GGUFWeight.from_blocks("Q4_1", random_blocks("Q4_1", 16, VNNI_INT8_MAX_K + 32))
    xd = torch.randn(2, VNNI_INT8_MAX_K + 32).bfloat16()
    with pytest.raises(RuntimeError, match="K = 44160 is over 44128"):
        ops.vnni_int8_linear(xd, *vnni_int8_form(deep), None, torch.empty(2, 16, dtype=torch.bfloat16), False)


def excess_by_hand(q: GGUFWeight | GGUFParts, per_block: bool = False) -> float:
    """The worst column's squared error added by int8_weight over the file's own rounding (d^2 / 12 a weight, d the
    step of its block: of its 16 weights for Q6_K)."""
    added = (int8_weight(q, per_block).double() - q.dequantize().double()).square().sum(-1)
    own = []
    for part, _ in q.pieces:
        d = part.scales.double() if part.kind == "q8_2" else part.scales[..., :1].double()
        own.append(d.square().sum((-2, -1)) * (part.shape[1] / d[0].numel()) / 12)
    return (added / torch.cat(own)).max().item()


@pytest.mark.parametrize("kind", ["Q4_0", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "parts"])
def test_the_excess_is_measured_against_each_layouts_own_steps(kind):
    # pack_vnni_int8's excess is the one computed by hand for every layout. Q8_0's steps (127 to its block's
    # largest value) are finer than one step per column can be: its excess is always over 1, and the guard turns
    # it down at the first tile
    if kind == "parts":
        q = GGUFWeight.cat([GGUFWeight.from_blocks("Q4_K", random_blocks("Q4_K", 32, 512, seed=8)),
                            GGUFWeight.from_blocks("Q6_K", random_blocks("Q6_K", 32, 512, seed=9))])
    else:
        q = GGUFWeight.from_blocks(kind, random_blocks(kind, 64, 512, seed=7))
    excess = pack_vnni_int8(q)[2]
    assert excess == pytest.approx(excess_by_hand(q), rel=1e-4)
    assert pack_vnni_int8(q, max_excess=excess) is not None
    assert pack_vnni_int8(q, max_excess=excess * 0.999) is None
    if kind == "Q8_0":
        assert excess > 1 and vnni_int8_form(q, max_excess=VNNI_INT8_MAX_EXCESS) is None
    # with a step per 32-deep block too
    by_block = pack_vnni_int8(q, per_block=True)[2]
    assert by_block == pytest.approx(excess_by_hand(q, per_block=True), rel=1e-4, abs=1e-9)


def test_a_step_per_block_holds_a_q8_0_files_values_exactly():
    # gguf's (llama.cpp's) Q8_0 quantizer sets a block's d to max|w| / 127, so its largest quant is +-127: the int8
    # form with a step per block is then d itself, and its values the file's quants, no rounding added
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(3)) * 0.05
    raw = gguf_quants.quantize(w.numpy(), GGMLQuantizationType.Q8_0)
    q = GGUFWeight.from_blocks("Q8_0", torch.from_numpy(raw.view("uint8").reshape(64, -1)))
    q8, sc, excess = pack_vnni_int8(q, per_block=True)
    assert excess < 1e-9 and pack_vnni_int8(q)[2] > 1  # (fp32 residue of w * (1 / s): the values are exact)
    w8 = q8.view(4, 16, 8, 16, 4).permute(0, 3, 1, 2, 4).reshape(64, 16, 32)  # [t n, b, j e]
    assert torch.equal(w8, q.qs.view(64, 16, 32))
    assert torch.equal(sc[:, :, 0].permute(0, 2, 1).reshape(64, 16), q.scales[..., 0])
