"""The load-time forms of a GGUF weight made in C++ (csrc/gguf_unpack_cpu.cpp: gguf_unpack, gguf_dequantize,
vnni_int8_pack) are the torch code's (layers/quantized.py: GGUFWeight.from_blocks, dequantize, pack_vnni_int8), which
the engine runs without the extension: the same values, the same bytes, the same excess up to fp32's rounding of its
sums, for every GGUF type and layout the blocks come in and for fused weights of mixed layouts; the loader takes them
where the engine runs the kernels; and bad operands get clear errors."""
from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from pagellm.model_executor.layers.cpu_kernels import load_extension
from pagellm.model_executor.layers.linear import CPULinear, cpu_kernels
from pagellm.model_executor.layers.quantized import GGUF_BLOCKS, GGUFParts, GGUFWeight, pack_vnni_int8
from test_gguf_linear import SCALES, mixed_gguf, random_blocks

ops = load_extension()
KINDS = sorted(GGUF_BLOCKS) + ["parts"]


def weight(kind: str, n: int = 45, k: int = 512, seed: int = 3) -> GGUFWeight | GGUFParts:
    """n x k random blocks of kind (45 rows: a last tile of 13 columns); "parts": Q4_K_M's mix, q/k in Q4_K and v in
    Q6_K, their boundary inside a tile."""
    if kind == "parts":
        q = GGUFWeight.cat([GGUFWeight.from_blocks("Q4_K", random_blocks("Q4_K", 24, k, seed=seed)),
                            GGUFWeight.from_blocks("Q6_K", random_blocks("Q6_K", n - 24, k, seed=seed + 1))])
        assert isinstance(q, GGUFParts)
        return q
    return GGUFWeight.from_blocks(kind, random_blocks(kind, n, k, seed=seed))


def same_bytes(a: GGUFWeight, b: GGUFWeight) -> bool:
    """The same layout, quants and scales, each scale's fp32 bits alike (a NaN's payload aside: torch's own differs
    between its vector loops and their tails)."""
    nan = a.scales.isnan()
    return (a.kind == b.kind and a.qs.dtype == b.qs.dtype and a.qs.shape == b.qs.shape and torch.equal(a.qs, b.qs)
            and a.scales.shape == b.scales.shape and torch.equal(nan, b.scales.isnan())
            and torch.equal(a.scales.view(torch.int32)[~nan], b.scales.view(torch.int32)[~nan]))


@pytest.mark.parametrize("kind", sorted(GGUF_BLOCKS))
def test_unpacking_is_the_torch_codes(kind):
    # the layout's quants and scales byte for byte, from blocks in the model's range and from any bytes at all, with
    # an fp16 scale NaN in one block and infinite in another (their fp32 bits alike); the K-quants 2 super-blocks a row
    per, size = GGUF_BLOCKS[kind]
    g = torch.Generator().manual_seed(len(kind))
    noise = torch.randint(0, 256, (9, 512 // per * size), dtype=torch.uint8, generator=g)
    at = SCALES[kind][0][0]
    for block, bad in ((0, float("nan")), (3, float("-inf"))):
        noise.view(-1, size)[block, at:at + 2] = torch.tensor([bad]).half().view(torch.uint8)
    for raw in (random_blocks(kind, 45, 512, seed=3), noise):
        want = GGUFWeight.from_blocks(kind, raw)
        got = GGUFWeight.from_blocks(kind.lower(), raw, ops.gguf_unpack)
        assert same_bytes(got, want) and got.shape == (raw.shape[0], 512)
    assert want.scales.isnan().any() and want.scales.isinf().any()
    # one row; one block a row over more blocks than a thread's share (2,048); blocks in a strided view
    wide = random_blocks(kind, 3, 2 * per, seed=5)
    for raw in (random_blocks(kind, 1, per, seed=4), random_blocks(kind, 2049, per, seed=6), wide[:, size:]):
        assert same_bytes(GGUFWeight.from_blocks(kind, raw, ops.gguf_unpack), GGUFWeight.from_blocks(kind, raw))


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_is_the_torch_codes(kind):
    q = weight(kind)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        want = q.dequantize(dtype)
        got = q.dequantize(dtype, ops.gguf_dequantize)
        assert got.dtype == dtype and torch.equal(got, want), dtype
    assert q.dequantize().abs().sum() > 0


@pytest.mark.parametrize("per_block", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_the_int8_form_is_the_torch_codes(kind, per_block):
    q = weight(kind)
    q8, scales, excess = pack_vnni_int8(q, per_block=per_block)
    got = pack_vnni_int8(q, per_block=per_block, kernel=ops.vnni_int8_pack)
    assert torch.equal(got[0], q8)
    assert torch.equal(got[1].view(torch.int32), scales.view(torch.int32))  # (the offsets: int32 bits)
    assert got[2] == pytest.approx(excess, rel=1e-5)
    # the guard turns it down where torch's does (a limit well away from the excess either way)
    for limit in (excess * 0.99, excess * 1.01):
        assert (pack_vnni_int8(q, limit, per_block, ops.vnni_int8_pack) is None) == (limit < excess)


def test_a_column_over_the_limit_stops_it_as_torchs_does():
    # an outlying block in the fourth tile (the kernel takes the first tile alone, then the rest in one call; torch
    # takes a few MB at a time): the same bytes with no limit, the same excess, and None under it
    raw = random_blocks("Q4_1", 80, 96, seed=6)
    raw.view(80, 3, 20)[50, 1, :4] = torch.tensor([0.0, 40.0]).half().view(torch.uint8)
    q = GGUFWeight.from_blocks("Q4_1", raw)
    whole = pack_vnni_int8(q)
    q8, sc, excess = pack_vnni_int8(q, kernel=ops.vnni_int8_pack)
    assert torch.equal(q8, whole[0]) and torch.equal(sc.view(torch.int32), whole[1].view(torch.int32))
    assert excess == pytest.approx(whole[2], rel=1e-5) and excess > 1
    assert pack_vnni_int8(q, 1.0, kernel=ops.vnni_int8_pack) is None and pack_vnni_int8(q, 1.0) is None


def column(q8: torch.Tensor, sc: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Column c's int8 values ([K/32, 8, 4]) and its steps and offsets' bits (int32 [.., 2]) in an int8 form."""
    t, lane = divmod(c, 16)
    return q8.view(q8.shape[0], q8.shape[1], 8, 16, 4)[t, :, :, lane], sc.view(torch.int32)[t, ..., lane]


@pytest.mark.parametrize("per_block", [False, True])
def test_the_op_writes_its_columns_only_and_the_padding_is_zero(per_block, monkeypatch):
    # 24 rows of a weight as columns 11-34 of the operands (a part starting inside a tile, ending inside another):
    # each column as the torch code packs those rows alone; every other byte of sentinel-filled operands stays
    q = weight("Q6_K", 45, 256)
    part = GGUFWeight(q.kind, q.qs[5:29], q.scales[5:29])
    ref = pack_vnni_int8(part, per_block=per_block)
    q8, sc, ex = (torch.full((3, 8, 8, 64), 7, dtype=torch.int8),
                  torch.full((3, 8, 2, 16) if per_block else (3, 2, 16), 7.0), torch.full((48,), 7.0))
    ops.vnni_int8_pack(part.qs, part.scales, part.kind, 11, per_block, q8, sc, ex)
    for c in range(48):
        got = column(q8, sc, c)
        if 11 <= c < 35:
            want = column(ref[0], ref[1], c - 11)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), c
            assert 0 <= ex[c] <= ref[2] * (1 + 1e-5)
        else:
            assert (got[0] == 7).all() and (got[1] == torch.tensor(7.0).view(torch.int32)).all() and ex[c] == 7, c
    assert ex[11:35].max().item() == pytest.approx(ref[2], rel=1e-5)
    # through pack_vnni_int8: the columns past N (45 of 48) are zeros, whatever the fresh tensors held
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(7))
    q8, sc, _ = pack_vnni_int8(q, per_block=per_block, kernel=ops.vnni_int8_pack)
    monkeypatch.undo()
    for c in range(45, 48):
        assert not any(t.any() for t in column(q8, sc, c)), c


@pytest.mark.parametrize("per_block", [False, True])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_column_holding_a_value_that_is_not_finite_is_declined(bad, per_block):
    # both paths: its excess is infinite, so any limit turns the form down (CPULinear keeps the bf16 paths)
    raw = random_blocks("Q8_0", 32, 64, seed=2)
    raw.view(32, 2, 34)[9, 1, :2] = torch.tensor([bad]).half().view(torch.uint8)
    q = GGUFWeight.from_blocks("Q8_0", raw)
    for kernel in (None, ops.vnni_int8_pack):
        assert pack_vnni_int8(q, per_block=per_block, kernel=kernel)[2] == float("inf")
        assert pack_vnni_int8(q, 1e30, per_block, kernel) is None


def test_cpu_linear_makes_its_forms_in_cpp():
    # The engine's kernels carry both ops wherever the GGUF kernels build; CPULinear's forms from them are the torch
    # code's. (Its int8 form where this CPU takes it; its bf16 weight, made from blocks it was handed alone, always.)
    kernels = cpu_kernels(ops, torch.bfloat16)
    if kernels is None or kernels.gguf is None:
        pytest.skip("no GGUF kernels on this CPU")
    assert kernels.gguf_dequantize is not None and kernels.vnni_int8_pack is not None
    torch_only = dataclasses.replace(kernels, gguf_dequantize=None, vnni_int8_pack=None, gguf_int8=None)
    q = weight("Q5_0", 64, 256)
    meta = torch.empty(64, 256, dtype=torch.bfloat16, device="meta")
    a, b = CPULinear(meta, None, kernels, q), CPULinear(meta, None, torch_only, q)
    if a.vnni_int8 is not None:
        assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a.vnni_int8, b.vnni_int8))
    made = dataclasses.replace(kernels, vnni_int8=None, gguf_int8=None)  # the bf16 weight, made from the blocks
    c, d = CPULinear(meta, None, made, q), CPULinear(meta, None, dataclasses.replace(torch_only, vnni_int8=None), q)
    assert c.amx_weight is not None and torch.equal(c.amx_weight.view(torch.int16), d.amx_weight.view(torch.int16))


def test_the_loader_unpacks_with_them(tmp_path):
    # A tiny llama in K-quant blocks mixed as Q4_K_M mixes them (and Q5_0 / Q5_1 / Q4_0): loaded with the kernels
    # (as the engine loads where it runs them), every weight's blocks are byte for byte torch's, q and k rows
    # un-permuted alike, and the weights dequantized from them (the embeddings, the head) equal
    from pagellm.model_executor.layers.attention import preload_cpu_ops
    from pagellm.model_executor.loader import load_checkpoint

    path, cfg, raw = mixed_gguf(tmp_path / "k.gguf", {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K",
                                                       "o_proj": "Q5_K", "gate_proj": "Q5_0", "up_proj": "Q5_1",
                                                       "down_proj": "Q4_0", "lm_head": "Q6_K", "embed_tokens": "Q8_0"})
    cpu = torch.device("cpu")
    assert preload_cpu_ops("auto", cpu) is ops and preload_cpu_ops("torch", cpu) is None
    calls = []

    class Spy:  # the kernels, counted
        def __getattr__(self, name):
            op = getattr(ops, name)
            return types.SimpleNamespace(default=lambda *a: calls.append(name) or op.default(*a))

    got = load_checkpoint(path, torch.bfloat16, cpu_ops=Spy())
    # every tensor in blocks unpacked and, without defer_quantized, dequantized by them
    assert calls.count("gguf_unpack") == calls.count("gguf_dequantize") == len(raw)
    want = load_checkpoint(path, torch.bfloat16)
    assert set(got.quantized) == set(want.quantized)
    assert len(want.quantized) == len(raw) - (not cfg.tie_word_embeddings)  # (an untied embedding: not a linear)
    assert all(same_bytes(got.quantized[k], want.quantized[k]) for k in want.quantized)
    assert set(got.weights) == set(want.weights)
    assert all(torch.equal(got.weights[k], want.weights[k]) for k in want.weights)
    kinds = {q.kind for q in want.quantized.values()}
    assert kinds == {"q4_1", "q8_0", "u8_1", "q8_2"}
    deferred = load_checkpoint(path, torch.bfloat16, defer_quantized=True, cpu_ops=ops)
    assert all(same_bytes(deferred.quantized[k], want.quantized[k]) for k in want.quantized)
    assert not any(k.startswith("model.layers.") and k.endswith("_proj.weight") for k in deferred.weights)


def test_without_the_kernels_the_engine_loads_in_torch(tmp_path, monkeypatch):
    # No compiler (any failure to build): preload_cpu_ops warns and returns None, the loader unpacks in torch, and the
    # engine takes the torch backend without a second build attempt; it decodes as the one with the kernels (fp32:
    # both exact). attention_backend="cpu" and a bad PAGELLM_CPU_MARCH stop it instead.
    from pagellm import LLM, SamplingParams
    from pagellm.model_executor.layers import cpu_attention, cpu_kernels as build
    from pagellm.model_executor.layers.attention import TorchPagedAttention, preload_cpu_ops

    path, _, _ = mixed_gguf(tmp_path / "k.gguf", {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K",
                                                   "o_proj": "Q5_0", "gate_proj": "Q4_0", "up_proj": "Q4_0",
                                                   "down_proj": "Q5_K"})
    prompts = [{"prompt_token_ids": [(7 * i + 3 * n) % 200 + 3 for i in range(n)]} for n in (2, 9)]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    runs, attempts = [], []
    for broken in (False, True):
        if broken:
            def no_compiler():
                attempts.append(1)
                raise RuntimeError("no C++ compiler")
            monkeypatch.setattr(build, "load_extension", no_compiler)
            monkeypatch.setattr(cpu_attention, "load_extension", no_compiler)
        llm = LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB")
        assert (type(llm.llm_engine.model.backend) is TorchPagedAttention) == broken
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1] and all(len(ids) == 5 for ids in runs[0])
    assert len(attempts) == 1  # one build attempt a start
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):  # "cpu" asks for them: it stops, before the load
        LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB", attention_backend="cpu")

    def bad_march():
        raise build.CPUMarchError("PAGELLM_CPU_MARCH names no target")
    monkeypatch.setattr(build, "load_extension", bad_march)
    with pytest.raises(build.CPUMarchError):
        preload_cpu_ops("auto", torch.device("cpu"))
    assert preload_cpu_ops("torch", torch.device("cpu")) is None
    assert preload_cpu_ops("auto", torch.device("meta")) is None


def test_bad_operands_get_clear_errors():
    raw = random_blocks("Q4_K", 4, 512)
    qs, sc = torch.empty(4, 16, 16, dtype=torch.uint8), torch.empty(4, 16, 2)
    ops.gguf_unpack(raw, "Q4_K", qs, sc)
    with pytest.raises(RuntimeError, match="type: one of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, not Q3_K"):
        ops.gguf_unpack(raw, "Q3_K", qs, sc)
    with pytest.raises(RuntimeError, match=r"blocks: contiguous uint8 \[N, a multiple of 144 bytes\]"):
        ops.gguf_unpack(raw[:, :200], "Q4_K", qs, sc)
    with pytest.raises(RuntimeError, match=r"qs, scales: \[N, K/32, ...\] = \[4, 16, ...\]"):
        ops.gguf_unpack(raw, "Q4_K", qs[:, :8].contiguous(), sc[:, :8].contiguous())
    for bad in (raw.view(torch.int8), raw[:, :-144].t(), raw.flatten()):
        with pytest.raises(RuntimeError, match=r"blocks: contiguous uint8 \[N, a multiple of 144 bytes\]"):
            ops.gguf_unpack(bad, "Q4_K", qs, sc)
    with pytest.raises(RuntimeError, match=r"qs: contiguous uint8 \[N, K/32, 16\]"):
        ops.gguf_unpack(raw, "Q4_K", qs.view(torch.int8), sc)
    with pytest.raises(RuntimeError, match=r"scales: contiguous float32 \[N, K/32, 2\]"):
        ops.gguf_unpack(raw, "Q4_K", qs, sc[..., :1].contiguous())
    q = weight("Q4_1", 32, 64)
    out = torch.empty(32, 64)
    with pytest.raises(RuntimeError, match="kind: one of q4_1, q8_0, u8_1, q8_2, not q5_0"):
        ops.gguf_dequantize(q.qs, q.scales, "q5_0", out)
    with pytest.raises(RuntimeError, match=r"qs: contiguous uint8 \[N, K/32, 16\]"):
        ops.gguf_dequantize(q.qs.view(torch.int8), q.scales, "q4_1", out)
    with pytest.raises(RuntimeError, match="scales: contiguous float32"):
        ops.gguf_dequantize(q.qs, q.scales[:16], "q4_1", out)
    with pytest.raises(RuntimeError, match=r"out: contiguous \[N, K\] = \[32, 64\]"):
        ops.gguf_dequantize(q.qs, q.scales, "q4_1", torch.empty(32, 32))
    with pytest.raises(RuntimeError, match="out: float32, bfloat16 or float16"):
        ops.gguf_dequantize(q.qs, q.scales, "q4_1", torch.empty(32, 64, dtype=torch.float64))
    packed, sc, ex = torch.empty(2, 2, 8, 64, dtype=torch.int8), torch.empty(2, 2, 16), torch.empty(32)
    ops.vnni_int8_pack(q.qs, q.scales, "q4_1", 0, False, packed, sc, ex)
    with pytest.raises(RuntimeError, match="col0: the rows' first column"):
        ops.vnni_int8_pack(q.qs, q.scales, "q4_1", 1, False, packed, sc, ex)
    with pytest.raises(RuntimeError, match=r"packed: contiguous int8 \[tiles, K/32, 8, 64\]"):
        ops.vnni_int8_pack(q.qs, q.scales, "q4_1", 0, False, packed[:, :1], sc, ex)
    with pytest.raises(RuntimeError, match=r"out: contiguous float32 \[tiles, K/32, 2, 16\]"):
        ops.vnni_int8_pack(q.qs, q.scales, "q4_1", 0, True, packed, sc, ex)
    with pytest.raises(RuntimeError, match=r"excess: contiguous float32 \[tiles \* 16\]"):
        ops.vnni_int8_pack(q.qs, q.scales, "q4_1", 0, False, packed, sc, ex[:16])
