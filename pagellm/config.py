"""Engine configuration: what the user asks for, validated once, then read-only.

The engine derives everything it needs here (dtype, max_model_len, block size, KV budget, token budget) so
that the scheduler, cache manager and model runner share one consistent view.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

import psutil
import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# KV-cache element types besides the model's own ("auto"), by vLLM's names: 8-bit floats with scale 1 (vLLM's
# default without calibrated scales), values beyond the format's range saturated. "fp8" is e4m3, as in vLLM.
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "KIB": 2**10, "M": 1e6, "MB": 1e6, "MIB": 2**20,
          "G": 1e9, "GB": 1e9, "GIB": 2**30, "T": 1e12, "TB": 1e12, "TIB": 2**40}

# On CPU, the KV pool takes this share of the memory available at start-up, capped at DEFAULT_CPU_KV_CAP.
DEFAULT_CPU_KV_FRACTION = 0.25
DEFAULT_CPU_KV_CAP = 4 * 2**30
# With chunked prefill, one step computes at most this many tokens unless told otherwise.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


def parse_size(value: int | float | str, name: str = "kv_cache_memory", allow_zero: bool = False) -> int:
    """Bytes from an int or a string like "4GiB", "512MB", "1.5G"; 0 only where allow_zero."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        n = int(value)
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)):
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    else:
        raise ValueError(f"{name} must be a number of bytes or a size like '4GiB', got {value!r}")
    if n < 0 or (n == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0 (0: none)' if allow_zero else '> 0'}, got {value!r}")
    return n


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """"auto" takes the checkpoint's dtype; float16 becomes bfloat16 on CPU (as vLLM does: CPU fp16 is slow)."""
    if isinstance(dtype, torch.dtype):
        chosen = dtype
    elif dtype == "auto":
        chosen = checkpoint_dtype
        if chosen == torch.float16 and device.type == "cpu":
            chosen = torch.bfloat16
    elif dtype in _DTYPES:
        chosen = _DTYPES[dtype]
    else:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    if chosen not in _DTYPES.values():
        raise ValueError(f"dtype {chosen} is not supported; use one of {sorted(_DTYPES)}")
    return chosen


def auto_block_size(max_model_len: int) -> int:
    """Block size for block_size="auto": small blocks waste less of a request's last block, large blocks
    mean shorter block tables. 8 up to 1,024 tokens of context, 16 up to 8,192, else 32."""
    if max_model_len <= 1024:
        return 8
    if max_model_len <= 8192:
        return 16
    return 32


def cuda_kv_budget(total: int, available: int, gpu_memory_utilization: float, in_use: int) -> int:
    """The KV budget on a CUDA device, sized as vLLM sizes it: ``gpu_memory_utilization`` of the device's ``total``
    memory, less what this process has allocated already (``in_use``: the weights, and any other engine or tensor
    the process holds). ``available``: what can still be allocated (free on the device, plus what torch's
    allocator keeps unused); memory other processes hold is not counted on. The rest of the device (10% by
    default) is the headroom for a step's activations."""
    gib = 2**30
    wanted = int(total * gpu_memory_utilization)
    budget = wanted - in_use
    if 0 < budget <= available:
        return budget
    why = (f"gpu_memory_utilization={gpu_memory_utilization} of the device's {total / gib:.1f} GiB is "
           f"{wanted / gib:.1f} GiB; this process has allocated {in_use / gib:.1f} GiB already (the weights, and "
           f"any other engine still alive in the process)")
    if budget <= 0:
        raise ValueError(f"{why}, which leaves nothing for the KV cache: free the other engine (del llm), raise "
                         f"gpu_memory_utilization, or give kv_cache_memory")
    raise ValueError(f"{why}, which leaves {budget / gib:.1f} GiB for the KV cache, but only {available / gib:.1f} GiB "
                     f"can be allocated (other processes hold the rest): lower gpu_memory_utilization to at most "
                     f"{math.floor((available + in_use) / total * 100) / 100}, or give kv_cache_memory")


def default_kv_cache_memory(device: torch.device, gpu_memory_utilization: float, non_kv_bytes: int) -> int:
    """The KV budget when the user gives none.

    CPU: DEFAULT_CPU_KV_FRACTION of the memory available now, at most DEFAULT_CPU_KV_CAP.
    CUDA: ``cuda_kv_budget``, ``non_kv_bytes`` being what the process has allocated on the device.
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return cuda_kv_budget(total, free + unused, gpu_memory_utilization, non_kv_bytes)
    return int(min(psutil.virtual_memory().available * DEFAULT_CPU_KV_FRACTION, DEFAULT_CPU_KV_CAP))


@dataclass
class EngineConfig:
    """User-facing engine arguments (the ``LLM(...)`` keywords). See ``finalize`` for derived values."""

    model: str | None = None
    dtype: str | torch.dtype = "auto"
    max_model_len: int | None = None
    block_size: int | str = 32
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    kv_cache_memory: int | str | None = None
    preemption_mode: str = "recompute"  # or "swap": preempted requests' KV moves to host memory and back
    swap_space: int | str = "1GiB"  # host memory for swapped-out blocks (used when preemption_mode="swap")
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    device: str | None = None
    num_threads: int | None = None
    attention_backend: str = "auto"  # "auto" (C++ kernel on CPU when it builds, else torch), "cpu", "torch"
    # "auto": the model's dtype; "fp8" / "fp8_e4m3" / "fp8_e5m2": one byte per element, so twice the tokens in the
    # same kv_cache_memory and half the bytes decode attention reads, at the cost of precision
    kv_cache_dtype: str = "auto"
    # bf16 linears on CPUs with AVX512-FP16 but no AMX: fp16 FMAs on an fp16 copy of the weights, each lane summing
    # 32 products before they join an fp32 sum (as torch's allow_fp16_reduced_precision_reduction allows partial
    # sums in fp16): ~1.6x the speed of fp32 FMAs. False: fp32 sums throughout
    reduced_precision_reduction: bool = True
    # bf16 from a GGUF file on CPU: linears with at most 4 rows (decode with a few requests) read the file's quants
    # (Q4_0/1, Q5_0/1, Q8_0, Q4_K, Q5_K, Q6_K: 6-10 bits a weight against bf16's 16) as the exact fp32 weights
    # (layers/quantized.py). False: the dequantized bf16 weights only
    gguf_quantized_linears: bool = True
    # ... and on CPUs with AVX512-VNNI but no AMX, layer linears with more rows take int8 dot products (any GGUF
    # type whose int8 form adds under half the file's own rounding error in every output column): the weight's
    # values rounded to int8 per output column, or per 32-deep block for finer types such as Q8_0 and Q6_K (at
    # most max|w| / 254 off), x to int8 per row, as vLLM's int8 linears (per-channel weights, dynamic per-token
    # activations; at most max|x| / 254, 8 outlier channels per weight taken exactly), for twice the products per
    # instruction on Zen 4 and four times fp32's on Intel (csrc/vnni_int8_linear_cpu.cpp); and up to 4 rows
    # (decode with a few requests), on CPUs with AVX512-VNNI or AVX2, the 4-bit weight's own nibbles meet x rounded
    # to int8 per 16 values (8 outlier channels per weight taken exactly), where the blocks turned into fp32 cost
    # more than their bytes (csrc/gguf_int8_linear_cpu.cpp). False: bf16 x throughout
    gguf_int8_activations: bool = True
    # With chunked prefill, max_num_batched_tokens also counts a prefill chunk's attention: a token attending to c
    # earlier ones costs 1 + c / A, A the keys whose attention costs one token's linear FLOPs (3,072 for SmolLM2-
    # 135M), so chunks deep into a long prompt shrink and a step takes about as long whatever the context (the
    # decodes in it wait less; the prompt takes more, shorter steps). False: every token counts one (vLLM's)
    attention_aware_budget: bool = True
    # CPU: how much of the KV cache to map at start-up (the pool's first blocks, which the pool hands out first),
    # so that the first requests' writes into fresh blocks do not take the page faults (model_runner.py). A size
    # like "1GiB", 0 for none; more than the pool maps all of it (vLLM writes its whole pool at start-up)
    kv_cache_prefault: int | str = "1GiB"

    # Derived by finalize():
    torch_dtype: torch.dtype = field(default=torch.float32, init=False)
    torch_device: torch.device = field(default=torch.device("cpu"), init=False)
    torch_kv_dtype: torch.dtype = field(default=torch.float32, init=False)

    def __post_init__(self) -> None:
        if self.block_size != "auto" and self.block_size not in (8, 16, 32):
            raise ValueError(f"block_size must be 8, 16, 32 or 'auto', got {self.block_size!r}")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise ValueError(f"max_model_len must be an integer >= 1, got {self.max_model_len!r}")
        if self.max_num_batched_tokens is not None and (
                not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1):
            raise ValueError(f"max_num_batched_tokens must be an integer >= 1, got {self.max_num_batched_tokens!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.attention_backend not in ("auto", "cpu", "torch"):
            raise ValueError(f"attention_backend must be 'auto', 'cpu' or 'torch', got {self.attention_backend!r}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be 'auto' or one of {sorted(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if not isinstance(self.reduced_precision_reduction, bool):
            raise ValueError(f"reduced_precision_reduction must be True or False, "
                             f"got {self.reduced_precision_reduction!r}")
        if not isinstance(self.gguf_quantized_linears, bool):
            raise ValueError(f"gguf_quantized_linears must be True or False, got {self.gguf_quantized_linears!r}")
        if not isinstance(self.gguf_int8_activations, bool):
            raise ValueError(f"gguf_int8_activations must be True or False, got {self.gguf_int8_activations!r}")
        if not isinstance(self.attention_aware_budget, bool):
            raise ValueError(f"attention_aware_budget must be True or False, got {self.attention_aware_budget!r}")
        self.kv_cache_prefault = parse_size(self.kv_cache_prefault, "kv_cache_prefault", allow_zero=True)
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_size(self.kv_cache_memory)
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        self.swap_space = parse_size(self.swap_space, "swap_space")
        self.torch_device = torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    def finalize(self, checkpoint_dtype: torch.dtype, model_max_len: int) -> None:
        """Fix dtype, max_model_len, block size and token budget once the checkpoint is known."""
        self.torch_dtype = resolve_dtype(self.dtype, checkpoint_dtype, self.torch_device)
        self.torch_kv_dtype = KV_CACHE_DTYPES.get(self.kv_cache_dtype, self.torch_dtype)
        if self.max_model_len is None:
            self.max_model_len = model_max_len
        if self.block_size == "auto":
            self.block_size = auto_block_size(self.max_model_len)
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = (DEFAULT_MAX_NUM_BATCHED_TOKENS if self.enable_chunked_prefill
                                           else self.max_model_len)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when enable_chunked_prefill=False, or no long prompt could ever run")


def default_num_threads() -> int:
    """Threads for intra-op parallelism: the cores this process may run on (not hyper-threads' doubles)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)
