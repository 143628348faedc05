"""Host allocator settings for CPU inference.

A step allocates the same large temporaries again and again (activations of a 2,048-token chunk, the
[requests, vocab] logits). glibc serves blocks above its mmap threshold with fresh ``mmap`` pages and hands
freed heap tops back to the kernel, so every step pays page faults and zeroing for them: measured here, the
bf16 -> fp32 copy of 64 x 49,152 logits took 20 ms per decode step instead of 1 ms. Raising the mmap and trim
thresholds keeps those pages in the process (vLLM's CPU backend preloads tcmalloc for the same reason).
The price is that peak transient memory is not returned to the OS while the engine lives.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger("pagellm")

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_done = False


def tune_host_allocator() -> bool:
    """Once per process, on glibc; ``PAGELLM_MALLOC_TUNING=0`` leaves the allocator alone."""
    global _done
    if _done or os.environ.get("PAGELLM_MALLOC_TUNING", "1") == "0":
        return _done
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    ok = (mallopt(_M_MMAP_THRESHOLD, 32 << 20)  # glibc's maximum: blocks up to 32 MiB come from the heap
          and mallopt(_M_TRIM_THRESHOLD, 1 << 30)  # keep up to 1 GiB of freed heap
          and mallopt(_M_TOP_PAD, 64 << 20))
    _done = bool(ok)
    if not ok:
        logger.info("mallopt refused the allocator settings; continuing with the defaults")
    return _done
