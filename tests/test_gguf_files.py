"""Synthetic GGUF files: every architecture and tokenizer llama.cpp writes, every tensor type dequantized as
gguf does, rope scaling read as transformers reads it."""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
import transformers

import gguf
from checkpoint_files import (CHAT_TEMPLATE, GGUF_ARCHS, TINY_VOCAB, assert_same_model_config,  # noqa: F401
                              assert_same_weights, llamacpp_permute, random_state_dict, tiny_config, tiny_gguf,
                              write_gguf)
from gguf import GGMLQuantizationType as Q
from pagellm.model_executor import gguf_config, gguf_loader
from pagellm.model_executor.loader import load_checkpoint
from pagellm.model_executor.models.llama import ModelShape

@pytest.mark.parametrize("arch", list(GGUF_ARCHS))
def test_tiny_gguf_roundtrip(tiny_gguf, arch):
    path, cfg, sd = tiny_gguf[arch]
    ck = load_checkpoint(str(path), torch.float32)
    assert ck.architecture == GGUF_ARCHS[arch] and ck.source == str(path.resolve())
    assert_same_weights(ck.weights, sd)  # exact: q/k un-permuted for llama, left alone for qwen
    c = ck.hf_config
    assert c.model_type == cfg.model_type and c.architectures == [GGUF_ARCHS[arch]]
    for attr in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "vocab_size", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(c, attr) == getattr(cfg, attr), attr
    assert c.head_dim == (getattr(cfg, "head_dim", None) or 16)
    assert c.rope_parameters["rope_theta"] == cfg.rope_parameters["rope_theta"]
    assert abs(c.rms_norm_eps - cfg.rms_norm_eps) < 1e-12
    # the same fields in the model type's own class
    f = gguf_loader.open_gguf(path)
    model_type, fields = gguf_config.gguf_config_args(gguf_loader.read_metadata(f), {t.name: t.shape for t in f.tensors},
                                                      path)
    assert_same_model_config(c, transformers.AutoConfig.for_model(model_type, **fields), GGUF_ARCHS[arch])
    # bf16 load converts the same values
    ck16 = load_checkpoint(str(path), torch.bfloat16)
    assert_same_weights(ck16.weights, {k: v.to(torch.bfloat16) for k, v in sd.items()})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_start_imports_no_symbolic_shapes(tiny_gguf, dtype):
    """Starting an engine and generating must not import sympy (torch's symbolic shapes pull it in, 0.2-0.4 s of
    a ~3 s cold start here, more on slower machines): Module.to_empty on meta tensors did (models/__init__.py)."""
    import subprocess

    code = (
        "import sys\n"
        "from pagellm import LLM, SamplingParams\n"
        f"llm = LLM(model={str(tiny_gguf['llama'][0])!r}, dtype={dtype!r}, kv_cache_memory='16MiB')\n"
        "params = SamplingParams(max_tokens=2, ignore_eos=True)\n"
        "llm.generate([{'prompt_token_ids': [1, 2, 3]}], params, use_tqdm=False)\n"
        "print(sorted(m for m in ('sympy', 'torch.fx.experimental.symbolic_shapes') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("arch", list(GGUF_ARCHS))
def test_tiny_gguf_tokenizer_matches_autotokenizer(tiny_gguf, arch):
    path, _, _ = tiny_gguf[arch]
    ck = load_checkpoint(str(path), torch.float32)
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert type(ck.tokenizer) is type(ref)
    for text in ["the hello hell", "<|im_start|>user\nhi<|im_end|>", "ünï 1 2"]:
        assert ck.tokenizer.encode(text) == ref.encode(text)
    assert ck.tokenizer.chat_template == CHAT_TEMPLATE


def assert_same_tokenizer(tok, ref) -> None:
    assert type(tok) is type(ref) and len(tok) == len(ref) and tok.get_vocab() == ref.get_vocab()
    for text in ["the hello hell", "<|im_start|>user\nhi  there\t123 ünïcödé 🙂<|im_end|>", " leading space", "",
                 "Hello, world!"]:
        ids = tok.encode(text)
        assert ids == ref.encode(text) and tok.decode(ids) == ref.decode(ids)
        assert tok(text).input_ids == ref(text).input_ids
    assert tok.chat_template == ref.chat_template
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == \
        (ref.bos_token, ref.eos_token, ref.pad_token, ref.unk_token)
    assert tok.all_special_ids == ref.all_special_ids
    if ref.chat_template:
        msgs = [{"role": "user", "content": "What is 2+2?"}]
        assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
            ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("arch", list(GGUF_ARCHS))
def test_gguf_tokenizer_cache(tiny_gguf, arch, tmp_path, monkeypatch):
    """The first load builds the tokenizer from the GGUF file and saves it under the cache dir; the next loads
    read the saved files and get the same tokenizer; a damaged entry is rebuilt."""
    monkeypatch.setenv("PAGELLM_CACHE", str(tmp_path))
    path = tiny_gguf[arch][0]
    cache = gguf_config.tokenizer_cache_path(gguf_loader.open_gguf(path))
    assert cache.parent == tmp_path / "tokenizers" and not cache.exists()
    built = load_checkpoint(str(path), torch.float32).tokenizer
    assert (cache / "tokenizer.json").is_file()
    assert [p.name for p in cache.parent.iterdir()] == [cache.name]  # no temporary directory left
    cached = load_checkpoint(str(path), torch.float32).tokenizer
    assert_same_tokenizer(cached, built)
    assert_same_tokenizer(cached, transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name))
    (cache / "tokenizer.json").write_text("{not json")
    rebuilt = load_checkpoint(str(path), torch.float32).tokenizer
    assert_same_tokenizer(rebuilt, built)
    assert_same_tokenizer(load_checkpoint(str(path), torch.float32).tokenizer, built)  # the entry written again


def test_gguf_tokenizer_cache_keyed_by_header_and_transformers_version(tiny_gguf, monkeypatch):
    keys = {gguf_config.tokenizer_cache_path(gguf_loader.open_gguf(tiny_gguf[a][0])) for a in GGUF_ARCHS}
    assert len(keys) == len(GGUF_ARCHS)
    path = tiny_gguf["llama"][0]
    before = gguf_config.tokenizer_cache_path(gguf_loader.open_gguf(path))
    monkeypatch.setattr(transformers, "__version__", transformers.__version__ + ".post1")
    assert gguf_config.tokenizer_cache_path(gguf_loader.open_gguf(path)) != before


def test_smollm2_gguf_tokenizer_cache(gguf_path, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGELLM_CACHE", str(tmp_path))
    built = load_checkpoint(str(gguf_path), torch.bfloat16).tokenizer
    cached = load_checkpoint(str(gguf_path), torch.bfloat16).tokenizer
    assert (gguf_config.tokenizer_cache_path(gguf_loader.open_gguf(gguf_path)) / "tokenizer.json").is_file()
    assert_same_tokenizer(cached, built)


def test_tiny_llama_gguf_matches_transformers_gguf_loader(tiny_gguf):
    path, _, sd = tiny_gguf["llama"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32,
        quantization_config=transformers.GgufConfig(dequantize=True))
    assert_same_weights(load_checkpoint(str(path), torch.float32).weights, hf.state_dict())
    assert_same_weights(hf.state_dict(), sd)


def test_gguf_without_tokenizer(tmp_path):
    cfg = tiny_config("qwen2")
    _, sd = random_state_dict(cfg)
    path = write_gguf(tmp_path / "notok.gguf", "qwen2", cfg, sd, tokenizer=False)
    ck = load_checkpoint(path, torch.float32)
    assert ck.tokenizer is None and ck.hf_config.vocab_size == TINY_VOCAB


def test_quantized_gguf_end_to_end(tmp_path):
    """Q8_0 2-D weights: the loader returns dequantize(quantize(permuted w)) un-permuted."""
    cfg = tiny_config("llama")
    _, sd = random_state_dict(cfg)
    path = write_gguf(tmp_path / "q8.gguf", "llama", cfg, sd, tokenizer=False, qtype=Q.Q8_0)
    ck = load_checkpoint(path, torch.float32)
    assert_same_weights(ck.weights, sd, atol=0.05)
    q = sd["model.layers.1.self_attn.k_proj.weight"].numpy()
    expect = gguf.quants.dequantize(gguf.quants.quantize(llamacpp_permute(q, 2), Q.Q8_0), Q.Q8_0)
    expect = gguf_loader.reverse_permute_qk(expect, 2)
    assert np.array_equal(ck.weights["model.layers.1.self_attn.k_proj.weight"].numpy(), expect)
    # the engine's way: a layer's linear weights in their blocks alone (un-permuted alike), the rest as before
    lazy = load_checkpoint(path, torch.float32, defer_quantized=True)
    deferred = {n for n in ck.weights if n.startswith("model.layers.") and n.endswith("proj.weight")}
    assert deferred and set(lazy.weights) == set(ck.weights) - deferred and deferred <= set(lazy.quantized)
    for name in deferred:
        assert torch.equal(lazy.quantized[name].dequantize(), ck.weights[name]), name
    for name in lazy.weights:
        assert torch.equal(lazy.weights[name], ck.weights[name]), name


def test_a_model_makes_deferred_weights_from_their_blocks(tmp_path):
    # without CPU linears to take the blocks (fp32 here), load_weights makes each weight from them: the parameters
    # those of the checkpoint loaded whole; with them (defer), a linear's weight is left on the meta device
    from pagellm.model_executor.layers.attention import select_backend
    from pagellm.model_executor.models import build_model

    cfg = tiny_config("llama")
    _, sd = random_state_dict(cfg)
    path = write_gguf(tmp_path / "q8.gguf", "llama", cfg, sd, tokenizer=False, qtype=Q.Q8_0)
    whole, lazy = load_checkpoint(path, torch.float32), load_checkpoint(path, torch.float32, defer_quantized=True)
    shape = ModelShape(whole.hf_config, whole.architecture)
    backend = select_backend("torch", torch.device("cpu"), shape.num_kv_heads, shape.head_dim, 16, torch.float32)
    args = (whole.hf_config, whole.architecture)
    ref = build_model(*args, whole.weights, torch.float32, torch.device("cpu"), backend, 256)
    made = build_model(*args, lazy.weights, torch.float32, torch.device("cpu"), backend, 256, quantized=lazy.quantized)
    ps = dict(made.named_parameters())
    assert all(torch.equal(p, ps[n]) for n, p in ref.named_parameters())
    with pytest.raises(ValueError, match="missing weight 'model.layers.0.self_attn.q_proj.weight'"):
        build_model(*args, load_checkpoint(path, torch.float32, defer_quantized=True).weights, torch.float32,
                    torch.device("cpu"), backend, 256)
    again = load_checkpoint(path, torch.float32, defer_quantized=True)
    made.load_weights(again.weights, again.quantized, defer=True)
    lins = [m for m in made.layers.modules() if isinstance(m, torch.nn.Linear)]
    assert len(lins) == 4 * cfg.num_hidden_layers and all(m.weight.is_meta for m in lins)
    assert torch.equal(made.embed_tokens.weight, ref.embed_tokens.weight)
    assert torch.equal(made.layers[0].input_layernorm.weight, ref.layers[0].input_layernorm.weight)


# every type gguf can quantize is written quantized; the rest (K-quants, ...) as random blocks
QUANTIZABLE = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
BLOCKS_ONLY = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.TQ1_0, Q.TQ2_0, Q.IQ4_NL, Q.IQ4_XS]


@pytest.fixture(scope="module")
def quant_file(tmp_path_factory):
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("quant") / "types.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    expected, originals = {}, {}
    for qt in QUANTIZABLE:
        x = rng.standard_normal((8, 512)).astype(np.float32)
        data = gguf.quants.quantize(x, qt)
        w.add_tensor(f"{qt.name}.weight", data, raw_dtype=qt if qt not in (Q.F32, Q.F16) else None)
        expected[qt.name] = gguf.quants.dequantize(data, qt).reshape(x.shape)
        originals[qt.name] = x
    for qt in BLOCKS_ONLY:
        block, type_size = gguf.GGML_QUANT_SIZES[qt]
        raw = rng.integers(0, 256, size=(4, 512 // block * type_size), dtype=np.uint8)
        raw &= 0x3F  # no byte has sign or top exponent bit set, so every f16 scale is finite
        w.add_tensor(f"{qt.name}.weight", raw, raw_dtype=qt)  # shape given in bytes
        expected[qt.name] = gguf.quants.dequantize(raw, qt).reshape(4, 512)
    w.add_tensor("vec.weight", rng.standard_normal(64).astype(np.float32))
    expected["vec"] = None
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, expected, originals


@pytest.mark.parametrize("qt", QUANTIZABLE + BLOCKS_ONLY, ids=lambda q: q.name)
def test_gguf_dequantization_of_every_type(quant_file, qt):
    path, expected, originals = quant_file
    tensors = gguf_loader.read_gguf_tensors(path, torch.float32)
    got = tensors[f"{qt.name}.weight"]
    assert got.dtype == torch.float32 and tuple(got.shape) == expected[qt.name].shape
    np.testing.assert_array_equal(got.numpy(), expected[qt.name])
    if qt.name in originals:  # and the values are close to what was quantized
        tol = {Q.F32: 0, Q.F16: 2e-3, Q.BF16: 2e-2, Q.Q8_0: 0.05}.get(qt, 0.6)
        assert np.abs(got.numpy() - originals[qt.name]).max() <= tol
    assert tuple(tensors["vec.weight"].shape) == (64,)
    # and through the tensor reader in bf16
    assert gguf_loader.read_gguf_tensors(path, torch.bfloat16)[f"{qt.name}.weight"].dtype == torch.bfloat16


def test_gguf_reader_agrees_on_synthetic_types(quant_file):
    path, _, _ = quant_file
    ours, ref = gguf_loader.open_gguf(path), gguf.GGUFReader(path)
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert (a.name, a.tensor_type, a.data.shape) == (b.name, b.tensor_type, b.data.shape)
        assert np.array_equal(a.data, b.data)


@pytest.mark.parametrize("scaling", [None, ("linear", 4.0, None), ("yarn", 4.0, 512)])
@pytest.mark.parametrize("arch", list(GGUF_ARCHS))
def test_gguf_config_rope_scaling_matches_transformers(arch, scaling):
    meta = {"general.architecture": arch, f"{arch}.embedding_length": 64, f"{arch}.attention.head_count": 4,
            f"{arch}.attention.head_count_kv": 2, f"{arch}.block_count": 2, f"{arch}.feed_forward_length": 96,
            f"{arch}.context_length": 2048, f"{arch}.rope.freq_base": 50000.0,
            f"{arch}.attention.layer_norm_rms_epsilon": 1e-6, "tokenizer.ggml.bos_token_id": 4,
            "tokenizer.ggml.eos_token_id": 5, "tokenizer.ggml.padding_token_id": 6}
    if scaling:
        kind, factor, original = scaling
        meta.update({f"{arch}.rope.scaling.type": kind, f"{arch}.rope.scaling.factor": factor})
        if original:
            meta[f"{arch}.rope.scaling.original_context_length"] = original
    shapes = {"token_embd.weight": (100, 64)}
    ours = gguf_config.gguf_config(meta, shapes, "x.gguf")
    model_type, fields = gguf_config.gguf_config_args(meta, shapes, "x.gguf")
    assert_same_model_config(ours, transformers.AutoConfig.for_model(model_type, **fields), GGUF_ARCHS[arch])
    assert ours.rope_parameters["rope_type"] == (scaling[0] if scaling else "default")


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_torch_dequantization_is_bit_exact_with_gguf(qtype):
    # the torch path for the types kept in blocks must give exactly gguf.quants' fp32 values
    rng = np.random.default_rng(0)
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, (2000, block_bytes), dtype=np.uint8)
    at, n_scales = (208, 1) if qtype == Q.Q6_K else (0, 2 if qtype in (Q.Q4_1, Q.Q5_1, Q.Q4_K, Q.Q5_K) else 1)
    scales = rng.standard_normal((2000, n_scales)).astype(np.float16)  # fp16 d (and m / dmin); kept finite
    raw[:, at:at + 2 * n_scales] = scales.view(np.uint8)
    data = raw.reshape(20, -1)  # 20 rows of 100 blocks
    want = gguf.quants.dequantize(data, qtype)
    got = gguf_loader._dequantize_torch(data, qtype).reshape(want.shape)
    assert got.dtype == np.float32 and np.array_equal(got, want)
