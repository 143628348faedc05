"""The greedy LM head's int8 screens (csrc/argmax_screen_cpu.cpp and argmax_screen_amx.cpp, CPULinear.argmax): each
row's index of the largest bf16 output of the tile kernel they stand in for (FMA, with or without dot products, or
AMX), the first on ties, exactly as its logits then torch.argmax give it. The screen rules
a column out only where a bound that holds for any weights, rows and choice of exact pairs says it cannot be that
index; these tests hold it to the full path on planted outliers, ties, magnitudes far from 1 and random cases."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.model_executor.layers.cpu_kernels import load_extension
from pagellm.model_executor.layers.linear import SCREEN_PAIRS, CPULinear, cpu_kernels
from pagellm.model_executor.layers.weight_forms import pack_amx

ops = load_extension()
needs_screen = pytest.mark.skipif(ops is None or not ops.argmax_screen_supported(),
                                  reason="CPU without AVX512-VNNI and AVX512-BF16")
DOTS = [0, 1] if ops is not None and ops.fma_linear_dot_supported() else [0]
# the screens: the FMA kernel's without (0) and with (1) dot products, and AMX's where the CPU has AMX-INT8
AMX = ops is not None and ops.argmax_screen_amx_supported()
MODES = DOTS + (["amx"] if AMX else [])


def full_path(x: torch.Tensor, w: torch.Tensor, dot: int | str) -> torch.Tensor:
    """The tile kernel's bf16 logits (FMA with dot products or not, or "amx"), then torch.argmax (the first of
    equal largest values)."""
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)
    if dot == "amx":
        ops.amx_linear(x, pack_amx(w), None, out)
    else:
        ops.fma_linear(x, pack_amx(w), None, out, 1.0, dot)
    return out.float().argmax(dim=1)


def screen(x: torch.Tensor, w: torch.Tensor, pairs: list[int], dot: int | str, max_kept: int | None = None):
    """(indices, how many (row, column) pairs the exact stage took; -1: left to the full path). No cap on the
    columns kept unless asked for: these tests hold the screen's answers, however many columns it keeps."""
    q, sum128, info = ops.argmax_screen_pack(w)
    n = w.shape[0]
    p = torch.tensor(pairs, dtype=torch.int32)
    ws = w.view(torch.int32)[:, p.long()].reshape(n // 16, 16, len(pairs)).permute(0, 2, 1).contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    cap = x.shape[0] * n if max_kept is None else max_kept
    if dot == "amx":
        return out, ops.argmax_screen_amx(x, pack_amx(w), q, sum128, info, p, ws, cap, out)
    return out, ops.argmax_screen(x, w, q, sum128, info, p, ws, dot, cap, out)


def screened(x: torch.Tensor, w: torch.Tensor, pairs: list[int], dot: int | str) -> torch.Tensor | None:
    out, kept = screen(x, w, pairs, dot)
    return out if kept >= 0 else None


def outlier_rows(rows: int, k: int, seed: int) -> torch.Tensor:
    """Rows like a final norm's output: a few channels 10-40x the rest."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    x[:, [3, k // 3, k - 2]] *= torch.tensor([40.0, -25.0, 12.0])
    return x.bfloat16()


@needs_screen
@pytest.mark.parametrize("dot", MODES)
@pytest.mark.parametrize("rows,n,k", [(1, 528, 64), (13, 1024, 576), (64, 4096, 576), (100, 2048, 128)])
@pytest.mark.parametrize("choice", ["outliers", "none", "others"])
def test_the_same_index_as_the_full_path(rows, n, k, choice, dot):
    # whatever pairs are summed exactly (the outlier channels, none, unrelated ones), the index is the full path's
    x = outlier_rows(rows, k, seed=rows + n)
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(k)) * 0.05).bfloat16()
    pairs = {"outliers": [1, k // 6, k // 2 - 1], "none": [], "others": list(range(5, min(k // 2, 5 + SCREEN_PAIRS)))}
    got = screened(x, w, pairs[choice], dot)
    assert got is not None and torch.equal(got, full_path(x, w, dot))


@needs_screen
@pytest.mark.parametrize("dot", MODES)
def test_ties_go_to_the_first_index(dot):
    # 16 distinct columns repeated over 1,024: every row's largest value is reached by 64 columns, and the first of
    # them is the answer; then the answer's later copies each one bf16 step apart in one weight (near-ties)
    g = torch.Generator().manual_seed(3)
    base = (torch.randn(16, 256, generator=g) * 0.1).bfloat16()
    w = base.repeat(64, 1).contiguous()
    x = outlier_rows(40, 256, seed=4)
    full = full_path(x, w, dot)
    assert (full < 16).all()
    assert torch.equal(screened(x, w, [1, 42], dot), full)
    w2 = w.clone()
    for c in range(16, 1024, 16):  # the later copies: weight 0 one bf16 step larger or smaller in magnitude
        bits = w2[c:c + 16, 0].view(torch.int16)
        w2[c:c + 16, 0] = (bits + (1 if c // 16 % 2 else -1)).view(torch.bfloat16)
    assert torch.equal(screened(x, w2, [1, 42], dot), full_path(x, w2, dot))


@needs_screen
@pytest.mark.parametrize("dot", MODES)
def test_negative_logits_and_far_magnitudes(dot):
    x = outlier_rows(6, 576, seed=5).float()
    x[1] *= 1e-30
    x[2] *= 1e20
    x[3] = -x[4].abs()  # logits mostly of one sign
    x = x.bfloat16()
    g = torch.Generator().manual_seed(6)
    for scale in (1e-3, 1.0, 1e3):
        w = (torch.randn(512, 576, generator=g) * scale).abs().bfloat16()  # all positive: row 3's logits negative
        got = screened(x, w, [1, 96], dot)
        assert got is not None and torch.equal(got, full_path(x, w, dot))


@needs_screen
@pytest.mark.parametrize("dot", MODES)
@pytest.mark.parametrize("k", [64, 32768])
def test_products_below_the_smallest_normal(dot, k):
    # every product 2^-128 (column 1) against zeros (column 0): VDPBF16PS and AMX flush such sums to zero, so on
    # the dot and AMX paths both logits are 0 and the answer is 0, while the int8 screen sees column 1 at ~K 2^-128 above column 0;
    # the FMA path keeps the denormal sums (column 1). Either way the screen answers as the full path does.
    w = torch.zeros(16, k, dtype=torch.bfloat16)
    w[1] = 2.0 ** -25
    x = torch.full((3, k), 2.0 ** -103).bfloat16()
    x[2, :8] = 1.0  # one row of ordinary size beside them
    got = screened(x, w, [0], dot)
    assert got is not None and torch.equal(got, full_path(x, w, dot))


@needs_screen
@pytest.mark.parametrize("mode", [DOTS[-1]] + (["amx"] if AMX else []))
def test_rows_it_leaves_to_the_full_path(mode):
    # a row of zeros keeps every column (all logits equal, index 0); past the caller's cap: -1, out unset
    w = (torch.randn(512, 576) * 0.05).bfloat16()
    x = outlier_rows(4, 576, seed=9)
    x[0] = 0.0
    out, kept = screen(x, w, [1], mode)
    assert kept >= 512 and out[0] == 0 and torch.equal(out, full_path(x, w, mode))
    assert screen(x, w, [1], mode, max_kept=kept - 1)[1] == -1
    assert screen(x, w, [1], mode, max_kept=kept)[1] == kept


@needs_screen
def test_what_it_cannot_screen_is_left_to_the_full_path():
    w = torch.randn(64, 64).bfloat16()
    x = torch.randn(3, 64).bfloat16()
    for mode in MODES:
        x[1, 5] = float("nan")
        assert screened(x, w, [0], mode) is None
        x[1, 5] = float("inf")
        assert screened(x, w, [0], mode) is None
        x[1, 5] = 1e-39  # a bf16 denormal: VDPBF16PS and the tiles would read it as zero
        assert screened(x, w, [0], mode) is None
    bad = w.clone()
    bad[3, 3] = float("inf")
    assert ops.argmax_screen_pack(bad)[0].numel() == 0
    bad[3, 3] = 1e-39
    assert ops.argmax_screen_pack(bad)[0].numel() == 0
    q, sum128, info = ops.argmax_screen_pack(w)
    out = torch.empty(2, dtype=torch.int64)
    for pairs in ([4, 4], [32], [-1]):  # repeated, past K / 2, negative
        p = torch.tensor(pairs, dtype=torch.int32)
        ws = torch.zeros(4, len(pairs), 16, dtype=torch.int32)
        with pytest.raises(RuntimeError, match="pairs: distinct pair indices below K / 2"):
            ops.argmax_screen(torch.randn(2, 64).bfloat16(), w, q, sum128, info, p, ws, 1, 128, out)
    if AMX:  # AMX takes the pairs as one 32-deep tile step: at most 16
        p = torch.arange(17, dtype=torch.int32)
        with pytest.raises(RuntimeError, match="at most 16 exact pairs"):
            ops.argmax_screen_amx(torch.randn(2, 64).bfloat16(), pack_amx(w), q, sum128, info, p,
                                  torch.zeros(4, 17, 16, dtype=torch.int32), 128, out)


@needs_screen
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 20), n16=st.integers(1, 12), k32=st.integers(1, 4), levels=st.sampled_from([3, 9, 255]),
       x_exp=st.integers(-20, 20), w_exp=st.integers(-10, 10), n_pairs=st.integers(0, 8), seed=st.integers(0, 2**31),
       dot=st.sampled_from(MODES))
def test_random_cases(rows, n16, k32, levels, x_exp, w_exp, n_pairs, seed, dot):
    # weights on a few levels make exact and near ties common; magnitudes from 2^-20 to 2^20
    g = torch.Generator().manual_seed(seed)
    n, k = 16 * n16, 32 * k32
    w = (torch.randint(-(levels // 2), levels // 2 + 1, (n, k), generator=g).float() * 2.0 ** w_exp / levels).bfloat16()
    x = (torch.randn(rows, k, generator=g) * 2.0 ** x_exp)
    x[:, torch.randint(0, k, (2,), generator=g)] *= 30
    x = x.bfloat16()
    pairs = torch.randperm(k // 2, generator=g)[:n_pairs].tolist()
    got = screened(x, w, pairs, dot)
    assert got is not None and torch.equal(got, full_path(x, w, dot))


@needs_screen
def test_the_head_takes_it_where_its_tile_kernel_runs():
    kernels = cpu_kernels(ops, torch.bfloat16)
    if kernels is None or kernels.screen_pack is None or (kernels.fma is not None and kernels.fma_fp16):
        pytest.skip("the LM head runs another kernel here (fp16 sums, or no screen for this CPU)")
    w = (torch.randn(1024, 576) * 0.05).bfloat16()
    head = CPULinear(w, None, kernels)
    assert head.enable_argmax_screen() and head.screen_pairs is None
    x = outlier_rows(24, 576, seed=7)
    got = head.argmax(x)
    assert torch.equal(got, head(x).float().argmax(dim=1))
    pairs, ws = head.screen_pairs  # chosen from the first call: the planted outlier channels among them
    assert len(pairs) == SCREEN_PAIRS and {1, 96, 287} <= set(pairs.tolist())
    x2 = outlier_rows(7, 576, seed=8)
    assert torch.equal(head.argmax(x2), head(x2).float().argmax(dim=1))
    assert CPULinear(w[:1000].contiguous(), None, kernels).enable_argmax_screen() is False  # N % 16 != 0
    assert CPULinear(w, torch.zeros(1024).bfloat16(), kernels).enable_argmax_screen() is False  # a bias
    wide = torch.zeros(16, 32800, dtype=torch.bfloat16)  # K past SCREEN_MAX_K: the int32 sums could overflow
    assert CPULinear(wide, None, kernels).enable_argmax_screen() is False


@needs_screen
@pytest.mark.parametrize("mode", [DOTS[-1]] + (["amx"] if AMX else []))
@pytest.mark.parametrize("threads", [1, 2])
def test_it_keeps_few_columns(threads, mode):
    # rows with one clear winner each (as a trained model's are, mostly): the exact stage sees a few columns a row,
    # whatever the thread count and with rows strided in a wider buffer
    g = torch.Generator().manual_seed(10)
    w = (torch.randn(4096, 576, generator=g) * 0.04).bfloat16()
    target = torch.randint(0, 4096, (40,), generator=g)
    x = torch.randn(40, 576, generator=g) + 5 * w[target].float() / w[target].float().pow(2).mean(1, keepdim=True).sqrt()
    x[:, [17, 199, 371]] *= 20
    wide = torch.zeros(40, 640, dtype=torch.bfloat16)
    wide[:, :576] = x.bfloat16()
    x = wide[:, :576]  # row stride 640
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, kept = screen(x, w, [8, 99, 185], mode)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, full_path(x.contiguous(), w, mode)) and torch.equal(got, target)
    assert 40 <= kept <= 40 * 20


@needs_screen
@pytest.mark.parametrize("amx", [False] + ([True] if ops is not None and ops.amx_linear_supported() else []))
def test_a_gguf_head_takes_it_from_screen_min_rows(amx):
    # A head holding a GGUF file's Q8_0 blocks: forward takes the few-row kernel on them up to GEMV_MAX_ROWS rows,
    # and argmax leaves those rows to it (None), but off AMX only below SCREEN_MIN_ROWS: from there the screen
    # answers, with the tile kernel's index on the loaded weight. AMX keeps the few-row kernel up to GEMV_MAX_ROWS.
    from test_gguf_linear import random_blocks

    from pagellm.model_executor.layers.linear import GEMV_MAX_ROWS, SCREEN_MIN_ROWS
    from pagellm.model_executor.layers.quantized import GGUFWeight

    class NoAmx:  # torch.ops.pagellm as a CPU without AMX sees it
        def __getattr__(self, name):
            return (lambda: False) if name == "amx_linear_supported" else getattr(ops, name)

    assert 1 < SCREEN_MIN_ROWS <= GEMV_MAX_ROWS
    kernels = cpu_kernels(ops if amx else NoAmx(), torch.bfloat16)
    q = GGUFWeight.from_blocks("Q8_0", random_blocks("Q8_0", 512, 576, seed=3))
    w = q.dequantize().bfloat16()
    head = CPULinear(w, None, kernels)
    assert head.enable_argmax_screen() and head.set_gguf(q)
    for rows in range(1, GEMV_MAX_ROWS + 2):
        x = outlier_rows(rows, 576, seed=rows)
        got = head.argmax(x)
        if rows <= GEMV_MAX_ROWS and (amx or rows < SCREEN_MIN_ROWS):
            assert got is None, rows
        else:
            assert got is not None and torch.equal(got, full_path(x, w, "amx" if amx else DOTS[-1])), rows
