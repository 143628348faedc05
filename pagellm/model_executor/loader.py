"""Loading checkpoints: HF safetensors directories and single GGUF files.

``load_checkpoint(model, dtype)`` returns a :class:`LoadedCheckpoint` holding a transformers
config, the architecture name, CPU weights under transformers parameter names (in
``dtype``), the fast tokenizer and the resolved path. Pickle checkpoints (``*.bin``) are
refused; remote code is never trusted. GGUF specifics live in ``gguf_loader``.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers

from pagellm.model_executor import gguf_loader
from pagellm.model_executor.layers.quantized import GGUFWeight

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}

# used when config.json has no "architectures"
_MODEL_TYPE_TO_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
_SAFETENSORS_INDEX = "model.safetensors.index.json"
_GGUF_MAGIC = b"GGUF"


@dataclass
class LoadedCheckpoint:
    hf_config: transformers.PretrainedConfig
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    weights: dict[str, torch.Tensor]  # HF parameter names, requested dtype, CPU; no lm_head when tied
    tokenizer: transformers.PreTrainedTokenizerBase | None
    source: str  # resolved path
    # a GGUF's linear weights in blocks of quants (layers/quantized.py), by HF name: next to their dequantized copies,
    # or, loaded with defer_quantized, a layer's linear weights in them alone (absent from weights)
    quantized: dict[str, GGUFWeight] = field(default_factory=dict)

    @property
    def is_gguf(self) -> bool:
        return _is_gguf_file(pathlib.Path(self.source))

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the (floating point) weights are held in."""
        embed = self.weights.get("model.embed_tokens.weight")
        if embed is not None:
            return embed.dtype
        return next((w.dtype for w in self.weights.values() if w.is_floating_point()), torch.float32)


def _is_gguf_file(path: pathlib.Path) -> bool:
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == _GGUF_MAGIC
    except OSError:
        return False


def resolve_model(model: str | os.PathLike | None) -> pathlib.Path:
    """Resolve ``model`` to a checkpoint directory or a GGUF file.

    ``None`` -> the default model (fetched if needed). A directory without ``config.json``
    holding exactly one ``.gguf`` file resolves to that file. Missing -> FileNotFoundError.
    """
    if model is None:
        # imported here so that `python -m pagellm.model_executor.default_model` does not find the
        # module already imported through the package
        from pagellm.model_executor.default_model import default_model_path

        return default_model_path()
    path = pathlib.Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model path {str(path)!r} does not exist (only local checkpoint directories and .gguf files "
            f"are supported, not hub model ids)"
        )
    path = path.resolve()
    if path.is_dir():
        if not (path / "config.json").exists():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return ggufs[0]
            if len(ggufs) > 1:
                raise ValueError(
                    f"{path} has no config.json and several GGUF files {[p.name for p in ggufs]}; pass one of them"
                )
        return path
    if _is_gguf_file(path):
        return path
    raise ValueError(f"{path} is neither a checkpoint directory nor a GGUF file")


def _parse_dtype(value) -> torch.dtype | None:
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        dt = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(dt, torch.dtype):
            return dt
    return None


def _config_dtype(config) -> torch.dtype:
    for attr in ("dtype", "torch_dtype"):
        dt = _parse_dtype(getattr(config, attr, None) if not isinstance(config, dict) else config.get(attr))
        if dt is not None and dt.is_floating_point:
            return dt
    return torch.float32  # transformers' default when a checkpoint does not say


def checkpoint_dtype(ckpt_or_config) -> torch.dtype:
    """The checkpoint's natural dtype, for ``dtype="auto"``.

    Accepts a :class:`LoadedCheckpoint`, a config, or a model path / ``None`` (the default
    model; nothing is fetched or loaded, only a directory's config.json is read).
    HF directories: the config's ``dtype`` / ``torch_dtype`` (float32 if absent).
    GGUF: ``torch.bfloat16`` (GGUF weights are quantized; bf16 is the compute dtype). A bare
    config carries no GGUF marker, so pass the checkpoint or path for GGUF models.
    """
    if isinstance(ckpt_or_config, LoadedCheckpoint):
        if ckpt_or_config.is_gguf:
            return torch.bfloat16
        return _config_dtype(ckpt_or_config.hf_config)
    if isinstance(ckpt_or_config, transformers.PretrainedConfig):
        return _config_dtype(ckpt_or_config)
    if ckpt_or_config is None:
        return torch.bfloat16  # the default model is a GGUF file
    if isinstance(ckpt_or_config, (str, os.PathLike)):
        path = resolve_model(ckpt_or_config)
        if path.is_file():
            return torch.bfloat16
        config_file = path / "config.json"
        try:
            return _config_dtype(json.loads(config_file.read_text()))
        except FileNotFoundError:
            raise FileNotFoundError(f"{config_file} not found: {path} is not a HF checkpoint directory") from None
        except (OSError, ValueError) as e:
            raise ValueError(f"{config_file}: cannot read config: {e}") from e
    raise TypeError(f"checkpoint_dtype: unsupported argument of type {type(ckpt_or_config).__name__}")


checkpoint_dtype_of = checkpoint_dtype  # alias used by the engine


def load_checkpoint(model: str | os.PathLike | None, dtype: torch.dtype | str | None = None,
                    defer_quantized: bool = False, cpu_ops: Any = None) -> LoadedCheckpoint:
    """Load config, weights (CPU, ``dtype``) and tokenizer of ``model`` (see :func:`resolve_model`).

    ``dtype``: a floating torch.dtype, a name such as ``"bfloat16"``, or ``None`` / ``"auto"`` for
    the checkpoint's own dtype (see :func:`checkpoint_dtype`). ``defer_quantized``: a GGUF's layer linear weights
    kept in blocks (``quantized``) are not dequantized into ``weights`` too (gguf_loader.load_gguf): the engine's
    way, whose linears on int8 forms never need them in bf16. ``cpu_ops``: ``torch.ops.pagellm``, the C++ kernels
    that unpack and dequantize a GGUF's blocks (gguf_loader.load_gguf); None: torch's code, the same bytes.
    """
    path = resolve_model(model)
    if dtype is None or dtype == "auto":
        dtype = checkpoint_dtype(path)
    elif isinstance(dtype, str):
        dtype = _parse_dtype(dtype)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating point torch.dtype or 'auto', got {dtype!r}")
    quantized: dict[str, GGUFWeight] = {}
    if path.is_file():
        config, architecture, weights, tokenizer, quantized = gguf_loader.load_gguf(path, dtype, defer_quantized,
                                                                                    cpu_ops)
    else:
        config, architecture, weights, tokenizer = _load_hf_dir(path, dtype)
    _finalize_weights(weights, config, architecture, path, quantized)
    return LoadedCheckpoint(config, architecture, weights, tokenizer, str(path), quantized)


# ---------------------------------------------------------------------------------------------
# HF checkpoint directories


def _architecture_of(archs, model_type, source: pathlib.Path) -> str:
    """The supported architecture named by a config's ``architectures`` (or ``model_type``)."""
    archs = list(archs or [])
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    if not archs and model_type in _MODEL_TYPE_TO_ARCHITECTURE:
        return _MODEL_TYPE_TO_ARCHITECTURE[model_type]
    named = ", ".join(map(str, archs)) if archs else f"model_type {model_type!r}"
    raise ValueError(
        f"{source}: unsupported architecture {named}; supported architectures: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
    )


def _safetensors_files(path: pathlib.Path) -> list[pathlib.Path]:
    index = path / _SAFETENSORS_INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: invalid safetensors index: {type(e).__name__}: {e}") from e
        files = [path / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"safetensors shard {f} listed in {index.name} does not exist")
        return files
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for pattern in _PICKLE_PATTERNS for p in path.glob(pattern))
    if pickles:
        raise ValueError(
            f"{path} only holds pickle checkpoint files ({', '.join(pickles)}); pickle checkpoints are refused "
            f"because loading them can execute arbitrary code. Convert the checkpoint to safetensors "
            f"(*.safetensors) first."
        )
    raise FileNotFoundError(f"no *.safetensors weights found in {path}")


def _load_safetensors(files: list[pathlib.Path], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for name in sf.keys():
                    if name in weights:
                        raise ValueError(f"{f}: tensor {name!r} also appears in another shard")
                    tensor = sf.get_tensor(name)
                    weights[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ValueError(f"{f}: corrupt or unreadable safetensors file: {type(e).__name__}: {e}") from e
    return weights


def _load_tokenizer(path: pathlib.Path) -> transformers.PreTrainedTokenizerBase | None:
    if not any((path / name).exists() for name in _TOKENIZER_FILES):
        return None
    try:
        return transformers.AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as e:
        raise ValueError(f"{path}: cannot load the tokenizer: {type(e).__name__}: {e}") from e


def _load_hf_dir(path: pathlib.Path, dtype: torch.dtype):
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: {path} is not a HF checkpoint directory")
    # reject unsupported architectures before transformers sees the config (an unknown
    # model_type or remote code would otherwise fail with a less helpful message)
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{config_file}: cannot parse config: {type(e).__name__}: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{config_file}: cannot parse config: not a JSON object")
    architecture = _architecture_of(raw.get("architectures"), raw.get("model_type"), path)
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    except Exception as e:
        raise ValueError(f"{config_file}: cannot parse config: {type(e).__name__}: {e}") from e
    weights = _load_safetensors(_safetensors_files(path), dtype)
    return config, architecture, weights, _load_tokenizer(path)


# ---------------------------------------------------------------------------------------------
# validation shared by both formats


def expected_weight_shapes(config: transformers.PretrainedConfig, architecture: str) -> dict[str, tuple[int, ...]]:
    """Every parameter the architecture needs, with its shape (lm_head only when untied)."""
    hidden = config.hidden_size
    n_head = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_head
    head_dim = getattr(config, "head_dim", None) or hidden // n_head
    inter = config.intermediate_size
    q, kv = n_head * head_dim, n_kv * head_dim
    attention_bias = architecture == "Qwen2ForCausalLM" or bool(getattr(config, "attention_bias", False))
    o_bias = attention_bias and architecture != "Qwen2ForCausalLM"
    mlp_bias = bool(getattr(config, "mlp_bias", False))

    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        layer = {
            "self_attn.q_proj.weight": (q, hidden),
            "self_attn.k_proj.weight": (kv, hidden),
            "self_attn.v_proj.weight": (kv, hidden),
            "self_attn.o_proj.weight": (hidden, q),
            "mlp.gate_proj.weight": (inter, hidden),
            "mlp.up_proj.weight": (inter, hidden),
            "mlp.down_proj.weight": (hidden, inter),
            "input_layernorm.weight": (hidden,),
            "post_attention_layernorm.weight": (hidden,),
        }
        if attention_bias:
            layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
        if o_bias:
            layer["self_attn.o_proj.bias"] = (hidden,)
        if mlp_bias:
            layer.update({"mlp.gate_proj.bias": (inter,), "mlp.up_proj.bias": (inter,), "mlp.down_proj.bias": (hidden,)})
        if architecture == "Qwen3ForCausalLM":
            layer.update({"self_attn.q_norm.weight": (head_dim,), "self_attn.k_norm.weight": (head_dim,)})
        shapes.update({p + k: v for k, v in layer.items()})
    return shapes


def _finalize_weights(
    weights: dict[str, torch.Tensor], config: transformers.PretrainedConfig, architecture: str, source: pathlib.Path,
    quantized: dict[str, GGUFWeight] | None = None,
) -> None:
    """Drop tied / non-parameter tensors; raise ValueError on missing or mis-shaped weights (a weight held in
    ``quantized`` alone counts, with its blocks' shape)."""
    for name in [n for n in weights if n.endswith("rotary_emb.inv_freq")]:
        del weights[name]
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    shapes = {name: tuple(q.shape) for name, q in (quantized or {}).items()}
    shapes.update((name, tuple(w.shape)) for name, w in weights.items())
    expected = expected_weight_shapes(config, architecture)
    missing = [name for name in expected if name not in shapes]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"{source}: missing weight {missing[0]!r}; all missing: {missing[:5]}{more}")
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise ValueError(
                f"{source}: weight {name!r} has shape {list(shapes[name])}, expected {list(shape)} "
                f"from the config of this {architecture}"
            )
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        logger.warning("%s: %d unexpected tensors kept (e.g. %s)", source, len(unexpected), unexpected[:3])
