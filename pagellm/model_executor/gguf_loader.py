"""Reading a single-file GGUF checkpoint (llama.cpp format) into HF-named torch tensors.

* The header is parsed by :class:`GGUFFile` (a lean equivalent of ``gguf.GGUFReader``, which
  spends ~2.5 s materializing the vocabulary arrays); tensors are memory-mapped views that are
  dequantized to float32 (Q4_0/1, Q5_0/1, Q8_0, Q4_K, Q5_K and Q6_K in torch, bit for bit as
  ``gguf.quants.dequantize``; every other type the ``gguf`` package implements through it), then
  converted to the requested torch dtype.
* GGUF names are mapped to transformers parameter names (``blk.N.attn_q.weight`` ->
  ``model.layers.N.self_attn.q_proj.weight`` ...).
* llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` (weights and biases)
  for the ``llama`` GGUF architecture, which is also what Llama- and Mistral-family HF
  checkpoints are converted to. That permutation is undone here exactly as transformers'
  ``LlamaTensorProcessor`` does. ``qwen2`` / ``qwen3`` are converted unpermuted.
* The config and the tokenizer are rebuilt from the GGUF metadata by ``gguf_config``.
"""

from __future__ import annotations

import logging
import os
import pathlib
import re
import struct
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import transformers

import gguf
from gguf import GGMLQuantizationType, GGUFValueType

from pagellm.model_executor.gguf_config import (gguf_architecture, gguf_config, gguf_tokenizer,
                                                supported_architectures, tokenizer_cache_path)
from pagellm.model_executor.layers.quantized import GGUF_BLOCKS, GGUFWeight

logger = logging.getLogger(__name__)

# architectures whose attn_q / attn_k rows llama.cpp's converter permutes (see transformers'
# TENSOR_PROCESSORS: only "llama" among the ones we support)
PERMUTED_QK_ARCHITECTURES = {"llama"}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# tensors that exist in some GGUFs but have no transformers parameter
_IGNORED_TENSORS = {"rope_freqs.weight"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z0-9_]+)\.(weight|bias)$")

# metadata arrays longer than this are summarized by their length (the vocabulary and merges
# are read by the tokenizer builder, not here)
_MAX_METADATA_ARRAY = 1024

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_PLAIN_NUMPY_TYPES = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


def gguf_to_hf_name(name: str) -> str | None:
    """The transformers parameter name for a GGUF tensor name, or None if unknown."""
    if m := _LAYER_RE.match(name):
        layer, part, kind = m.groups()
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
        return None
    if (m := _GLOBAL_RE.match(name)) and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


class _GGUFFormatError(ValueError):
    pass


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its raw data is a read-only view into the memory-mapped file."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order ([out, in]); GGUF stores dimensions reversed
    data: np.ndarray  # F32/F16/F64/I*: typed and shaped like ``shape``; otherwise uint8 blocks


class GGUFFile:
    """A GGUF file's metadata and tensor table, parsed without touching tensor data.

    Same result as ``gguf.GGUFReader`` (the tests check tensor for tensor), but GGUFReader
    materializes every element of the vocabulary / merges arrays as numpy views, which takes
    ~2.5 s on a 49k-token vocabulary; here long arrays are skipped and summarized by length.
    Any malformed or truncated content raises ValueError naming the file.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file {self.path} does not exist")
        try:
            self._buf = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:  # e.g. an empty file cannot be mapped
            raise ValueError(f"{self.path}: not a valid GGUF file: cannot map it: {e}") from e
        try:
            self._parse()
        except _GGUFFormatError:
            raise
        except Exception as e:  # struct.error on a short read, UnicodeDecodeError, ...
            raise ValueError(
                f"{self.path}: not a valid GGUF file (corrupt or truncated?): {type(e).__name__}: {e}"
            ) from e

    def _fail(self, what: str) -> ValueError:
        return _GGUFFormatError(f"{self.path}: not a valid GGUF file: {what}")

    def _unpack(self, fmt: str):
        values = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        if self._pos + n > len(self._buf):
            raise self._fail(f"string at offset {self._pos} runs past the end of the file (truncated?)")
        s = bytes(self._buf[self._pos:self._pos + n]).decode("utf-8")
        self._pos += n
        return s

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALAR_FORMATS:
            return self._unpack(_SCALAR_FORMATS[vtype])[0]
        if vtype == GGUFValueType.STRING:
            return self._string()
        if vtype != GGUFValueType.ARRAY:
            raise self._fail(f"unknown metadata value type {vtype} at offset {self._pos}")
        etype, count = self._unpack("<IQ")
        if etype in _SCALAR_FORMATS:
            width = struct.calcsize(_SCALAR_FORMATS[etype])
            if self._pos + count * width > len(self._buf):
                raise self._fail(f"array at offset {self._pos} runs past the end of the file (truncated?)")
            start, self._pos = self._pos, self._pos + count * width
            if count > _MAX_METADATA_ARRAY:
                return count
            return list(struct.unpack_from(f"<{count}{_SCALAR_FORMATS[etype][1:]}", self._buf, start))
        if etype == GGUFValueType.STRING:
            if count > _MAX_METADATA_ARRAY:
                for _ in range(count):  # variable length: walk it
                    (n,) = self._unpack("<Q")
                    self._pos += n
                if self._pos > len(self._buf):
                    raise self._fail("string array runs past the end of the file (truncated?)")
                return count
            return [self._string() for _ in range(count)]
        raise self._fail(f"unsupported metadata array element type {etype}")

    def _parse(self) -> None:
        buf = self._buf
        if len(buf) < 24 or bytes(buf[:4]) != b"GGUF":
            raise self._fail("missing GGUF magic bytes" if len(buf) >= 4 else f"only {len(buf)} bytes")
        self._pos = 4
        (version,) = self._unpack("<I")
        if version & 0xFFFF == 0:
            raise self._fail("big-endian GGUF files are not supported")
        if version not in (2, 3):
            raise self._fail(f"unsupported GGUF version {version} (supported: 2, 3)")
        n_tensors, n_kv = self._unpack("<QQ")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            (vtype,) = self._unpack("<I")
            self.metadata[key] = self._value(vtype)
        alignment = self.metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise self._fail(f"invalid general.alignment {alignment!r}")
        table = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            raw_type, offset = self._unpack("<IQ")
            table.append((name, dims, raw_type, offset))
        data_start = -(-self._pos // alignment) * alignment
        self.header = buf[:data_start]  # metadata and tensor table (tokenizer_cache_path's key)
        self.tensors: list[GGUFTensor] = []
        seen = set()
        for name, dims, raw_type, offset in table:
            if name in seen:
                raise self._fail(f"duplicate tensor name {name!r}")
            seen.add(name)
            try:
                qtype = GGMLQuantizationType(raw_type)
                block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise self._fail(f"tensor {name!r} has unknown ggml type {raw_type}") from None
            shape = tuple(int(d) for d in reversed(dims))
            n_elems = int(np.prod(shape, dtype=np.int64)) if shape else 1
            if shape and shape[-1] % block:
                raise self._fail(f"tensor {name!r} of type {qtype.name}: row length {shape[-1]} is not a "
                                 f"multiple of the block size {block}")
            n_bytes = n_elems // block * type_size
            start = data_start + offset
            if start + n_bytes > len(buf):
                raise self._fail(
                    f"tensor {name!r} needs bytes [{start}, {start + n_bytes}) but the file has only "
                    f"{len(buf)} bytes (truncated?)"
                )
            raw = buf[start:start + n_bytes]
            if qtype in _PLAIN_NUMPY_TYPES:
                data = raw.view(_PLAIN_NUMPY_TYPES[qtype]).reshape(shape)
            else:
                data = raw.reshape(gguf.quants.quant_shape_to_byte_shape(shape, qtype) if shape else (n_bytes,))
            self.tensors.append(GGUFTensor(name, qtype, shape, data))


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse ``path``'s header; FileNotFoundError if missing, ValueError if malformed/truncated."""
    return GGUFFile(path)


def read_metadata(gguf_file: GGUFFile) -> dict[str, Any]:
    """Metadata key -> python value; long arrays (vocab, merges) are replaced by their length."""
    return dict(gguf_file.metadata)


def _dequantize_torch(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray | None:
    """The types kept in blocks (quantized.GGUF_BLOCKS: Q4_0/1, Q5_0/1, Q8_0, Q4_K, Q5_K, Q6_K) in torch, through
    the same unpacking as the kernel's (``GGUFWeight``): gguf.quants' fp32 values bit for bit (the tests compare),
    on all cores instead of one numpy thread: ~1.9 s of the default model's start-up became ~0.3 s. Other types
    return None and go through ``gguf``."""
    if qtype.name not in GGUF_BLOCKS:
        return None
    size = GGUF_BLOCKS[qtype.name][1]
    raw = torch.from_numpy(np.array(data, dtype=np.uint8).reshape(-1, size))  # one block a row
    return GGUFWeight.from_blocks(qtype.name, raw).dequantize().numpy()


def dequantize_tensor(tensor: GGUFTensor, source: str | os.PathLike = "") -> np.ndarray:
    """One GGUF tensor as a C-contiguous, writable float32 array shaped ``tensor.shape``."""
    qtype = tensor.tensor_type
    try:
        if qtype in _PLAIN_NUMPY_TYPES and qtype not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            arr = np.asarray(tensor.data).astype(np.float32)  # F64 / integer tensors
        elif (fast := _dequantize_torch(tensor.data, qtype)) is not None:
            arr = fast
        else:
            arr = gguf.quants.dequantize(tensor.data, qtype)
        arr = arr.reshape(tensor.shape)
    except Exception as e:
        raise ValueError(
            f"{source}: cannot dequantize tensor {tensor.name!r} of type {qtype.name} "
            f"(shape {list(tensor.shape)}): {type(e).__name__}: {e}"
        ) from e
    if arr.dtype != np.float32 or not arr.flags.writeable or not arr.flags.c_contiguous:
        arr = np.array(arr, dtype=np.float32, order="C")  # (also detaches F32 data from the read-only map)
    return arr


def _to_torch(arr: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(arr).to(dtype)


def read_gguf_tensors(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """All tensors of a GGUF file keyed by their GGUF names, dequantized to ``dtype`` (no renaming
    or un-permuting)."""
    f = open_gguf(path)
    return {t.name: _to_torch(dequantize_tensor(t, f.path), dtype) for t in f.tensors}


def reverse_permute_qk(weights, n_head: int):
    """Undo llama.cpp's ``permute(w, n_head, n_head_kv)`` on the rows of a q/k weight or bias (a numpy array or a
    torch tensor; the result contiguous, of the same kind).

    llama.cpp: ``w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2)``.
    """
    rows = weights.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot un-permute {rows} rows into {n_head} heads of even size")
    w = weights.reshape(n_head, rows // n_head // 2, 2, *weights.shape[1:]).swapaxes(2, 1).reshape(weights.shape)
    return w.contiguous() if isinstance(w, torch.Tensor) else np.ascontiguousarray(w)


def load_gguf(
    path: pathlib.Path, dtype: torch.dtype, defer_quantized: bool = False, cpu_ops: Any = None
) -> tuple[transformers.PretrainedConfig, str, dict[str, torch.Tensor], transformers.PreTrainedTokenizerBase | None,
           dict[str, GGUFWeight]]:
    """``(config, hf_architecture, weights, tokenizer, quantized)`` from a single GGUF file. ``quantized``: the
    linear weights (and embeddings) of a type quantized.GGUF_BLOCKS lists, as quants (HF names; rows un-permuted as
    the dequantized weights), for the linears' few-row kernel (layers/quantized.py). defer_quantized: the layers'
    linear weights among them are not dequantized into ``weights`` (the model makes them from the quants where it
    needs them: LlamaForCausalLM.load_weights). cpu_ops: ``torch.ops.pagellm`` (the C++ kernels), to unpack and
    dequantize the blocks in one pass each (``csrc/gguf_unpack_cpu.cpp``); None: in torch, the same bytes."""
    unpack = cpu_ops.gguf_unpack.default if cpu_ops is not None else None
    dequantize = cpu_ops.gguf_dequantize.default if cpu_ops is not None else None
    gguf_file = open_gguf(path)
    meta = read_metadata(gguf_file)
    arch, _, hf_arch = gguf_architecture(meta, path)
    shapes = {t.name: t.shape for t in gguf_file.tensors}
    config = gguf_config(meta, shapes, path)

    weights: dict[str, torch.Tensor] = {}
    quantized: dict[str, GGUFWeight] = {}
    for tensor in gguf_file.tensors:
        if tensor.name in _IGNORED_TENSORS:
            logger.warning(
                "%s: ignoring GGUF tensor %s (llama3-style RoPE frequency factors are not reconstructed "
                "into the config)", path, tensor.name,
            )
            continue
        hf_name = gguf_to_hf_name(tensor.name)
        if hf_name is None:
            raise ValueError(
                f"{path}: unexpected GGUF tensor {tensor.name!r} for architecture {arch!r} "
                f"(unsupported model variant?); supported: {supported_architectures()}"
            )
        # a weight kept as quants is dequantized from them (the same values as dequantize_tensor's, unpacked once)
        q = _gguf_quants(tensor, hf_name, path, unpack)
        if q is not None and defer_quantized and hf_name.startswith("model.layers."):
            w = None
        else:
            w = q.dequantize(dtype, dequantize) if q is not None else _to_torch(dequantize_tensor(tensor, path), dtype)
        part = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
        heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(part)
        if arch in PERMUTED_QK_ARCHITECTURES and heads:
            w = None if w is None else reverse_permute_qk(w, heads)
            if q is not None:  # the quants' rows alike
                q = GGUFWeight(q.kind, *(reverse_permute_qk(t, heads) for t in (q.qs, q.scales)))
        if w is not None:
            weights[hf_name] = w
        if q is not None:
            quantized[hf_name] = q
    if not getattr(config, "tie_word_embeddings", False):
        quantized.pop("model.embed_tokens.weight", None)  # an embedding only; the LM head has its own weight
    tokenizer = gguf_tokenizer(path, config, meta, tokenizer_cache_path(gguf_file))
    return config, hf_arch, weights, tokenizer, quantized


def _gguf_quants(tensor: GGUFTensor, hf_name: str, source: str | os.PathLike,
                 unpack: Callable | None = None) -> GGUFWeight | None:
    """A 2-D linear weight (or embedding) of a type the few-row kernel reads (quantized.GGUF_BLOCKS: Q4_0/1, Q5_0/1,
    Q8_0, Q4_K, Q5_K, Q6_K) as its quants in the kernel's layout, rows in the file's order; else None."""
    kind = tensor.tensor_type.name
    linear = hf_name.startswith("model.layers.") or hf_name in ("model.embed_tokens.weight", "lm_head.weight")
    if kind not in GGUF_BLOCKS or len(tensor.shape) != 2 or not (linear and hf_name.endswith(".weight")):
        return None
    per, size = GGUF_BLOCKS[kind]
    if tensor.shape[1] % per:
        return None
    rows = tensor.shape[0]
    try:
        if unpack is not None:  # the kernel reads the file's mapping as it is (no copy: it writes only its outputs)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                blocks = torch.from_numpy(np.asarray(tensor.data).reshape(rows, tensor.shape[1] // per * size))
            return GGUFWeight.from_blocks(kind, blocks, unpack)
        raw = np.array(tensor.data, dtype=np.uint8).reshape(rows, tensor.shape[1] // per * size)
        return GGUFWeight.from_blocks(kind, torch.from_numpy(raw))
    except Exception as e:
        raise ValueError(f"{source}: cannot read tensor {tensor.name!r} of type {kind} "
                         f"(shape {list(tensor.shape)}): {type(e).__name__}: {e}") from e