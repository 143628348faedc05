"""CPU PagedAttention backend: decode rows through a small C++ kernel that reads K/V in place from the blocks.

The kernel (``csrc/paged_attention_cpu.cpp``) is compiled once with ``torch.utils.cpp_extension`` into the
pagellm cache dir (``make install`` does it ahead of time; otherwise the first engine start does). If no
compiler is available the engine falls back to the torch reference backend and says so. Prefill chunks use the
reference path (SDPA's flash kernel), which is already efficient for many query rows.
"""
from __future__ import annotations

import hashlib
import logging
import pathlib
from functools import lru_cache

import torch

from pagellm.model_executor.layers.attention import AttentionMetadata, TorchPagedAttention

logger = logging.getLogger("pagellm")
_SOURCE = pathlib.Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"


@lru_cache(maxsize=1)
def load_extension():
    """Build (first time) and import the kernel; the build dir is keyed by the source's hash."""
    from torch.utils import cpp_extension

    from pagellm.model_executor.default_model import cache_dir

    digest = hashlib.sha256(_SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:12]
    name = f"pagellm_paged_attention_cpu_{digest}"
    build_dir = cache_dir() / "torch_extensions" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    if not any(build_dir.glob("*.so")):
        logger.info("compiling the CPU paged-attention kernel into %s (once)", build_dir)
    cpp_extension.load(name=name, sources=[str(_SOURCE)], build_directory=str(build_dir),
                       extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                       is_python_module=False, verbose=False)
    return torch.ops.pagellm


class CPUPagedAttention(TorchPagedAttention):
    def __init__(self) -> None:
        self.ops = load_extension()

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               sliding_window: int | None) -> torch.Tensor:
        out = torch.empty_like(q)
        self.ops.paged_decode_attention(q, kv_cache[0], kv_cache[1], meta.decode_block_tables, meta.decode_seq_lens,
                                        out, scale, sliding_window or 0)
        return out


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    load_extension()
    print("CPU paged-attention kernel ready")
