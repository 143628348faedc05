"""Tiny checkpoints for the loader tests: random-weight models written as GGUF files (the way llama.cpp
converts) and as HF safetensors directories, and the helpers that write and compare them."""
from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch
import transformers

import gguf
from gguf import GGMLQuantizationType as Q
from pagellm.model_executor import gguf_loader
from pagellm.model_executor.layers.rotary import RotaryEmbedding
from pagellm.model_executor.models.llama import ModelShape

TINY_VOCAB_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable unicode alphabet, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


TINY_MERGES = ["Ġ t", "h e", "Ġt he", "l l", "e ll"]
TINY_TOKENS = _byte_chars() + [m.replace(" ", "") for m in TINY_MERGES] + TINY_VOCAB_SPECIALS
TINY_VOCAB = len(TINY_TOKENS)  # 264


def tiny_config(arch: str, **overrides) -> transformers.PretrainedConfig:
    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, bos_token_id=TINY_VOCAB - 3, eos_token_id=TINY_VOCAB - 1,
                  tie_word_embeddings=False)
    common.update(overrides)
    if arch == "llama":
        return transformers.LlamaConfig(**common, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if arch == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "qwen3":
        return transformers.Qwen3Config(**{**common, "tie_word_embeddings": True, **overrides}, head_dim=24)
    raise ValueError(arch)


def random_state_dict(cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)  # also randomizes norms and biases
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return model, sd


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_HF_TO_GGUF_LAYER = {v: k for k, v in gguf_loader._LAYER_NAMES.items()}
_HF_TO_GGUF_GLOBAL = {v: k for k, v in gguf_loader._GLOBAL_NAMES.items()}


def hf_to_gguf_name(name: str) -> str:
    base, kind = name.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, i, rest = base.split(".", 3)
        return f"blk.{i}.{_HF_TO_GGUF_LAYER[rest]}.{kind}"
    return f"{_HF_TO_GGUF_GLOBAL[base]}.{kind}"


def write_gguf(path: pathlib.Path, gguf_arch: str, cfg, sd: dict[str, torch.Tensor], *, tokenizer: bool = True,
               skip: tuple[str, ...] = (), qtype: Q = Q.F32,
               raw: dict[str, tuple[str, np.ndarray]] | None = None) -> pathlib.Path:
    """Write ``sd`` (HF names) as llama.cpp would convert it (q/k permuted for llama). ``raw``: GGUF name ->
    (type name, uint8 [rows, row bytes]) written as given instead of the tensor (blocks gguf cannot quantize)."""
    w = gguf.GGUFWriter(str(path), gguf_arch)
    w.add_name("tiny test model")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if gguf_arch == "llama":
        w.add_rope_dimension_count(head_dim)
        w.add_vocab_size(cfg.vocab_size)
    if gguf_arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2" if gguf_arch.startswith("qwen") else "smollm")
        w.add_token_list(TINY_TOKENS)
        w.add_token_types([1] * (TINY_VOCAB - 3) + [3, 3, 3])
        w.add_token_merges(TINY_MERGES)
        w.add_bos_token_id(cfg.bos_token_id)
        w.add_eos_token_id(cfg.eos_token_id)
        w.add_pad_token_id(TINY_VOCAB - 3)
        w.add_add_bos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)
    for name, t in sd.items():
        gname = hf_to_gguf_name(name)
        if gname in skip:
            continue
        if raw and gname in raw:
            w.add_tensor(gname, raw[gname][1], raw_dtype=Q[raw[gname][0]])
            continue
        a = t.float().numpy()
        if gguf_arch == "llama" and ".attn_q." in gname:
            a = llamacpp_permute(a, cfg.num_attention_heads)
        elif gguf_arch == "llama" and ".attn_k." in gname:
            a = llamacpp_permute(a, cfg.num_key_value_heads)
        if a.ndim == 2 and qtype != Q.F32:
            w.add_tensor(gname, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float = 0.0):
    assert set(got) == set(want), (sorted(set(got) ^ set(want)))[:10]
    for k in want:
        assert got[k].shape == want[k].shape, k
        diff = (got[k].float() - want[k].float()).abs().max().item() if want[k].numel() else 0.0
        assert diff <= atol, f"{k}: max abs diff {diff}"


GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """gguf arch -> (path, cfg, hf state dict), written the way llama.cpp converts."""
    out = {}
    d = tmp_path_factory.mktemp("tiny_gguf")
    for arch in GGUF_ARCHS:
        cfg = tiny_config(arch)
        _, sd = random_state_dict(cfg, seed=len(out))
        sub = d / arch
        sub.mkdir()
        out[arch] = (write_gguf(sub / f"tiny-{arch}.gguf", arch, cfg, sd), cfg, sd)
    return out


HF_ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    out = {}
    for i, arch in enumerate(HF_ARCHS):
        cfg = tiny_config(arch)
        model, sd = random_state_dict(cfg, seed=10 + i)
        d = tmp_path_factory.mktemp(f"hf_{arch}")
        if arch == "llama":
            model.save_pretrained(d, max_shard_size="100KB")  # sharded, with an index
        else:
            model.save_pretrained(d)
        out[arch] = (d, cfg, sd)
    return out


def assert_same_model_config(ours: transformers.PretrainedConfig, theirs: transformers.PretrainedConfig,
                             architecture: str) -> None:
    """ours (a GGUF file's plain config, gguf_config.GGUF_CONFIGS) against the model type's own transformers class:
    every field ours holds has transformers' value, and what the engine derives from either is the same (the
    model's shape, its RoPE tables, its end tokens). Fields only theirs holds are defaults the engine reads as such."""
    a, b = ours.to_dict(), theirs.to_dict()
    ignore = {"architectures", "_name_or_path", "_model_name_or_path", "dtype", "torch_dtype", "transformers_version"}
    for k in a:
        if k not in ignore:
            assert a[k] == b.get(k), k
    assert ours.model_type == theirs.model_type and type(ours).__name__.endswith("GGUFConfig")
    shape = ModelShape(ours, architecture)
    assert vars(shape) == vars(ModelShape(theirs, architecture))
    tables = []
    for cfg in (ours, theirs):
        rope = RotaryEmbedding(cfg, shape.head_dim, 64)
        rope.build_tables(torch.device("cpu"))
        tables.append((rope.cos, rope.sin))
    assert torch.equal(tables[0][0], tables[1][0]) and torch.equal(tables[0][1], tables[1][1])
    ids = ("bos_token_id", "eos_token_id", "pad_token_id")  # as the GGUF states them (llama.cpp's converter does)
    assert [getattr(ours, k, None) for k in ids] == [getattr(theirs, k, None) for k in ids]
