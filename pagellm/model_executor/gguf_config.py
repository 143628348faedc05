"""A GGUF file's transformers config and tokenizer, rebuilt from its metadata (``gguf_loader`` reads the rest).

* The config comes from the metadata directly (the fields of ``AutoConfig.from_pretrained(dir, gguf_file=name)``
  for these architectures, but without transformers' legacy metadata parser, which takes ~6 s on a 49k-token
  vocabulary), plus ``head_dim`` from ``<arch>.attention.key_length`` (transformers ignores it for qwen3) and
  ``architectures``, held by a plain ``PretrainedConfig`` of the model type rather than its own class
  (``LlamaGGUFConfig``...: ~1.4 s less start-up).
* The tokenizer class is picked the way ``AutoTokenizer`` picks it and built with
  ``cls.from_pretrained(dir, gguf_file=name)`` (which reads ``tokenizer.chat_template`` too), then saved under the
  cache dir and loaded from there on later starts (``tokenizer_cache_path``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

import transformers

if TYPE_CHECKING:
    from pagellm.model_executor.gguf_loader import GGUFFile

logger = logging.getLogger(__name__)

# GGUF ``general.architecture`` -> (transformers model_type, HF architecture class name)
GGUF_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),  # Llama and Mistral GGUFs both use "llama"
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}
# model_type -> the tokenizer class AutoTokenizer picks for it (TokenizersBackend where not listed; tests check this
# against AutoTokenizer itself: importing its mapping costs ~0.35 s of start-up)
GGUF_TOKENIZERS = {"qwen2": "Qwen2Tokenizer", "qwen3": "Qwen2Tokenizer"}


def supported_architectures() -> str:
    """The GGUF architectures the loader reads, for error messages."""
    return ", ".join(f"{k} ({v[1]})" for k, v in GGUF_ARCHITECTURES.items())


def gguf_architecture(meta: dict[str, Any], source: str | pathlib.Path) -> tuple[str, str, str]:
    """``(gguf_arch, model_type, hf_architecture)``; ValueError if unsupported."""
    arch = meta.get("general.architecture")
    if arch is None:
        raise ValueError(f"{source}: GGUF metadata has no general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{source}: unsupported GGUF architecture {arch!r}; supported GGUF architectures: {supported_architectures()}"
        )
    if meta.get(f"{arch}.expert_count", 0):
        raise ValueError(
            f"{source}: GGUF architecture {arch!r} with {meta[f'{arch}.expert_count']} experts (mixture of "
            f"experts) is not supported; supported: dense {supported_architectures()}"
        )
    return arch, *GGUF_ARCHITECTURES[arch]


def gguf_config(
    meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]], source: str | pathlib.Path
) -> transformers.PretrainedConfig:
    """A transformers config rebuilt from GGUF metadata (and tensor names for biases / tying): a plain
    ``PretrainedConfig`` of the model type (``GGUF_CONFIGS``, see LlamaGGUFConfig) holding gguf_config_args'
    fields."""
    model_type, kwargs = gguf_config_args(meta, tensor_shapes, source)
    try:
        return GGUF_CONFIGS[model_type](**kwargs)
    except Exception as e:
        raise ValueError(f"{source}: cannot build a {model_type} config from GGUF metadata: {e}") from e


class LlamaGGUFConfig(transformers.PretrainedConfig):
    """A GGUF file's config (gguf_config) in place of the model type's own class (``LlamaConfig``...). Why: importing
    those classes costs ~1.4 s of a ~5 s cold start of the default model (their field validators import
    ``transformers.activations``, which pulls in ``torch.distributed.tensor``, ``torch._dynamo`` and ``sympy``), and
    a GGUF file states every field the engine reads (the rest the engine reads with the same defaults;
    tests/test_loader.py holds the two equal where it matters: the model's shape, RoPE, end tokens and the
    tokenizer's class). ``save_pretrained`` writes the model type, so ``AutoConfig`` loads it as its own class."""

    model_type = "llama"


class Qwen2GGUFConfig(transformers.PretrainedConfig):
    """As LlamaGGUFConfig, for qwen2."""

    model_type = "qwen2"


class Qwen3GGUFConfig(transformers.PretrainedConfig):
    """As LlamaGGUFConfig, for qwen3."""

    model_type = "qwen3"


# model_type -> its config class for GGUF files (one for each model type of GGUF_ARCHITECTURES)
GGUF_CONFIGS = {c.model_type: c for c in (LlamaGGUFConfig, Qwen2GGUFConfig, Qwen3GGUFConfig)}


def gguf_config_args(
    meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]], source: str | pathlib.Path
) -> tuple[str, dict[str, Any]]:
    """``(model_type, fields)`` of gguf_config's config; ``transformers.AutoConfig.for_model(model_type, **fields)``
    builds the model type's own class from them."""
    arch, model_type, hf_arch = gguf_architecture(meta, source)

    def key(name: str, default: Any = ...) -> Any:
        full = f"{arch}.{name}"
        if full in meta:
            return meta[full]
        if default is ...:
            raise ValueError(f"{source}: GGUF metadata lacks required key {full!r}")
        return default

    hidden = int(key("embedding_length"))
    n_head = int(key("attention.head_count"))
    head_dim = key("attention.key_length", None)
    if head_dim is None and arch == "llama":
        head_dim = key("rope.dimension_count", None)
    head_dim = int(head_dim) if head_dim is not None else hidden // n_head

    vocab = key("vocab_size", None)
    if vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = tokens if isinstance(tokens, int) else len(tokens) if tokens else None
    if vocab is None and "token_embd.weight" in tensor_shapes:
        vocab = tensor_shapes["token_embd.weight"][0]

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0))}
    scaling = key("rope.scaling.type", None)
    if scaling in ("linear", "yarn") and key("rope.scaling.factor", None):
        rope.update(rope_type=scaling, factor=float(key("rope.scaling.factor")))
        if scaling == "yarn" and key("rope.scaling.original_context_length", None):
            rope["original_max_position_embeddings"] = int(key("rope.scaling.original_context_length"))
    elif scaling not in (None, "none"):
        raise ValueError(f"{source}: unsupported RoPE scaling type {scaling!r} in GGUF metadata")

    kwargs: dict[str, Any] = dict(
        architectures=[hf_arch],
        hidden_size=hidden,
        num_hidden_layers=int(key("block_count")),
        intermediate_size=int(key("feed_forward_length")),
        num_attention_heads=n_head,
        hidden_act="silu",  # the three architectures' only activation (llama.cpp's graphs hard-code it)
        num_key_value_heads=int(key("attention.head_count_kv", n_head)),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(key("context_length", 2048)),
        rope_parameters=rope,
        # llama.cpp writes output.weight only when it differs from the embedding
        tie_word_embeddings="output.weight" not in tensor_shapes,
    )
    if vocab is not None:
        kwargs["vocab_size"] = int(vocab)
    for gguf_key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                             ("padding_token_id", "pad_token_id"), ("unknown_token_id", "unk_token_id")):
        if (v := meta.get(f"tokenizer.ggml.{gguf_key}")) is not None:
            kwargs[hf_key] = int(v)
    if model_type in ("llama", "qwen3"):
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensor_shapes
    if model_type == "llama":
        kwargs["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_shapes
    return model_type, kwargs


def gguf_tokenizer(
    path: pathlib.Path, config: transformers.PretrainedConfig, meta: dict[str, Any],
    cache: pathlib.Path | None = None,
) -> transformers.PreTrainedTokenizerBase | None:
    """The fast tokenizer described by the GGUF metadata (None if it has none). cache (tokenizer_cache_path): a
    directory it is saved to once built and loaded from after."""
    if "tokenizer.ggml.model" not in meta:
        return None
    # the class AutoTokenizer would choose for this model type, without AutoTokenizer re-parsing the config
    cls = getattr(transformers, GGUF_TOKENIZERS.get(config.model_type, "TokenizersBackend"))
    if cache is not None and (cache / "tokenizer.json").is_file():
        try:
            return cls.from_pretrained(str(cache))
        except Exception as e:  # a damaged cache entry: build it again
            logger.warning("%s: cannot load the cached tokenizer (%s: %s); rebuilding it", cache, type(e).__name__, e)
            shutil.rmtree(cache, ignore_errors=True)
    try:
        tokenizer = cls.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise ValueError(f"{path}: cannot build the tokenizer from GGUF metadata: {type(e).__name__}: {e}") from e
    if cache is not None:
        _save_tokenizer(tokenizer, cache)
    return tokenizer


def tokenizer_cache_path(gguf_file: GGUFFile) -> pathlib.Path:
    """Where a GGUF file's tokenizer is kept as transformers' own files (``save_pretrained``) once built, under the
    cache dir: keyed by the file's header (its metadata holds the whole vocabulary) and the transformers version.
    Why: building it from the GGUF metadata (transformers' GGUF path parses the file's metadata again and imports
    all of ``transformers.models``) takes ~0.75 s of the default model's ~4.4 s cold start, loading the saved
    files ~0.3 s."""
    from pagellm.model_executor.default_model import cache_dir

    digest = hashlib.sha256(transformers.__version__.encode() + b"\0")
    digest.update(memoryview(gguf_file.header))
    return cache_dir() / "tokenizers" / f"{gguf_file.path.stem}-{digest.hexdigest()[:16]}"


def _save_tokenizer(tokenizer: transformers.PreTrainedTokenizerBase, cache: pathlib.Path) -> None:
    """Into a fresh sibling directory, then renamed into place, so a concurrent start finds the whole entry or
    none (if another process's rename came first, this one's copy is dropped); a cache that cannot be written
    costs only the time saved."""
    tmp = None
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{cache.name}.", dir=cache.parent))
        tokenizer.save_pretrained(str(tmp))
        os.replace(tmp, cache)
    except Exception as e:  # OSError (a read-only cache dir, another process's entry in place), anything else
        logger.debug("not caching the tokenizer in %s: %s: %s", cache, type(e).__name__, e)
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
