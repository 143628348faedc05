"""Checkpoints the loader refuses, each with an error naming what is wrong: unsupported architectures, missing
or corrupt files, pickles, missing or unknown weights."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import transformers

import gguf
from checkpoint_files import random_state_dict, tiny_config, tiny_gguf, tiny_hf, write_gguf  # noqa: F401
from pagellm.model_executor.loader import SUPPORTED_ARCHITECTURES, load_checkpoint

def test_unsupported_hf_architecture(tmp_path):
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    cfg.architectures = ["GPT2LMHeadModel"]
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as e:
        load_checkpoint(tmp_path, torch.float32)
    assert all(a in str(e.value) for a in SUPPORTED_ARCHITECTURES)
    # a model type transformers does not even know, with remote code
    (tmp_path / "config.json").write_text(
        '{"model_type": "brand_new", "architectures": ["BrandNewForCausalLM"], "auto_map": {"AutoConfig": "x.Y"}}')
    with pytest.raises(ValueError, match="BrandNewForCausalLM.*LlamaForCausalLM"):
        load_checkpoint(tmp_path, torch.float32)


def test_unsupported_gguf_architecture(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="'gpt2'.*llama"):
        load_checkpoint(tmp_path / "g.gguf", torch.float32)


def test_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_checkpoint(str(tmp_path / "does-not-exist"), torch.float32)
    with pytest.raises(FileNotFoundError, match="nothing.gguf"):
        load_checkpoint(str(tmp_path / "nothing.gguf"), torch.float32)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(tmp_path, torch.float32)  # empty directory


@pytest.mark.parametrize("keep", [0, 3, 20, 0.5, 0.99])
def test_truncated_or_corrupt_gguf(tiny_gguf, tmp_path, keep):
    src = tiny_gguf["llama"][0]
    data = src.read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else keep
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[:n])
    with pytest.raises(ValueError, match="bad.gguf"):
        load_checkpoint(bad, torch.float32)


def test_garbage_gguf(tmp_path):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="garbage.gguf.*magic"):
        load_checkpoint(bad, torch.float32)


def test_pickle_only_dir_is_refused(tmp_path):
    tiny_config("llama").save_pretrained(tmp_path)
    # never unpickled: any content would do; a real pickle that would fail loudly if it were
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04cos\nsystem\n(S'exit 1'\ntR.")
    with pytest.raises(ValueError, match="pickle") as e:
        load_checkpoint(tmp_path, torch.float32)
    assert "safetensors" in str(e.value) and "pytorch_model.bin" in str(e.value)


def test_corrupt_and_truncated_safetensors(tiny_hf, tmp_path):
    src, _, _ = tiny_hf["mistral"]
    d = tmp_path / "trunc"
    shutil.copytree(src, d)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_checkpoint(d, torch.float32)
    f.write_bytes(b"\xff" * 100)
    with pytest.raises(ValueError, match="model.safetensors"):
        load_checkpoint(d, torch.float32)


def test_missing_shard(tiny_hf, tmp_path):
    src, _, _ = tiny_hf["llama"]
    d = tmp_path / "shards"
    shutil.copytree(src, d)
    shard = sorted(d.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_checkpoint(d, torch.float32)


def test_missing_weight_hf(tiny_hf, tmp_path):
    from safetensors.torch import save_file

    src, cfg, sd = tiny_hf["qwen2"]
    d = tmp_path / "missing"
    d.mkdir()
    shutil.copy(src / "config.json", d)
    save_file({k: v for k, v in sd.items() if k != "model.layers.1.self_attn.q_proj.weight"},
              str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.q_proj\.weight"):
        load_checkpoint(d, torch.float32)
    # wrong shape is reported too
    bad = dict(sd)
    bad["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(bad, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"up_proj\.weight.*shape"):
        load_checkpoint(d, torch.float32)


def test_missing_weight_gguf(tmp_path):
    cfg = tiny_config("qwen3")
    _, sd = random_state_dict(cfg)
    path = write_gguf(tmp_path / "m.gguf", "qwen3", cfg, sd, tokenizer=False, skip=("blk.0.attn_k_norm.weight",))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_norm\.weight"):
        load_checkpoint(path, torch.float32)


def test_unknown_gguf_tensor(tmp_path):
    path = tmp_path / "moe.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_feed_forward_length(96)
    w.add_head_count(4)
    w.add_tensor("blk.0.ffn_gate_inp.weight", np.zeros((4, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="ffn_gate_inp"):
        load_checkpoint(path, torch.float32)
