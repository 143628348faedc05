"""The C++ CPU kernels (``csrc/``): paged attention, the KV-cache writer, the fused element-wise ops and sampling.

They are compiled once with ``torch.utils.cpp_extension`` into the pagellm cache dir, keyed by a hash of the
sources and the torch version (``make model`` or ``python -m pagellm.model_executor.layers.cpu_kernels`` does
it ahead of time; otherwise the first engine start does, ~40 s). The ops register as ``torch.ops.pagellm.*``.
They are compiled for this CPU (``-march=native``); ``PAGELLM_CPU_MARCH`` names another target (GCC's
``-march`` names, e.g. ``haswell`` for AVX2 and FMA without AVX-512): the kernels then take that target's paths
and the engine chooses as on such a CPU, which is how the AVX2 paths are tested on an AVX-512 machine.
If no compiler is available the engine falls back to the torch reference path and says so.
"""
from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import platform
import re
from functools import lru_cache

import torch

logger = logging.getLogger("pagellm")
_CSRC = pathlib.Path(__file__).parent / "csrc"
_SOURCES = ("paged_attention_cpu.cpp", "prefill_attention_amx.cpp", "fused_ops_cpu.cpp", "gemv_cpu.cpp",
            "amx_linear_cpu.cpp", "fma_linear_cpu.cpp", "gguf_linear_cpu.cpp", "decoder_cpu.cpp", "sampling_cpu.cpp",
            "argmax_screen_cpu.cpp", "argmax_screen_amx.cpp", "vnni_int8_linear_cpu.cpp",
            "gguf_int8_linear_cpu.cpp", "gguf_unpack_cpu.cpp")


@lru_cache(maxsize=1)
def load_extension():
    """Build (first time) and load the kernels; returns the ``torch.ops.pagellm`` namespace."""
    from torch.utils import cpp_extension

    from pagellm.model_executor.default_model import cache_dir

    march = cpu_march()
    # -march=native: one build per CPU kind (its flags)
    h = hashlib.sha256(torch.__version__.encode() + _cpu_flags().encode() + march.encode())
    # ninja recompiles every object when a compile command changes, and the commands hold the sources' and this
    # torch's include paths: two checkouts or venvs sharing one cache dir rebuilt on alternate starts (~60 s)
    h.update(str(_CSRC).encode() + "\0".join(cpp_extension.include_paths()).encode())
    for f in sorted(_CSRC.iterdir()):
        h.update(f.name.encode() + f.read_bytes())
    name = f"pagellm_cpu_kernels_{h.hexdigest()[:12]}"
    build_dir = cache_dir() / "torch_extensions" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    if not any(build_dir.glob("*.so")):
        logger.info("compiling the CPU kernels into %s (once)", build_dir)
    # -ffp-contract=off: a*b + c stays two rounded ops where the kernels mirror torch's rounding.
    cpp_extension.load(name=name, sources=[str(_CSRC / s) for s in _SOURCES], build_directory=str(build_dir),
                       extra_cflags=["-O3", f"-march={march}", "-fopenmp", "-ffp-contract=off"],
                       extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    _prune_old_builds(build_dir, march)
    return torch.ops.pagellm


class CPUMarchError(ValueError):
    """PAGELLM_CPU_MARCH names no target, or one this CPU cannot run (the engine stops rather than fall back)."""


# GCC's macros for the vector and matrix extensions the kernels take paths on -> the /proc/cpuinfo flag of each
_TARGET_FEATURES = {
    "__AVX2__": "avx2", "__FMA__": "fma", "__F16C__": "f16c", "__AVX512F__": "avx512f", "__AVX512BW__": "avx512bw",
    "__AVX512DQ__": "avx512dq", "__AVX512VL__": "avx512vl", "__AVX512BF16__": "avx512_bf16",
    "__AVX512FP16__": "avx512_fp16", "__AVX512VNNI__": "avx512_vnni", "__AVXVNNI__": "avx_vnni",
    "__AMX_TILE__": "amx_tile", "__AMX_BF16__": "amx_bf16", "__AMX_INT8__": "amx_int8",
}


def cpu_march() -> str:
    """The -march the kernels are compiled for: PAGELLM_CPU_MARCH, else native. Another target is checked against
    this CPU first: a build using an extension the CPU lacks would stop the process with an illegal instruction."""
    march = os.environ.get("PAGELLM_CPU_MARCH", "native")
    if not re.fullmatch(r"[a-z0-9][a-z0-9_.+-]*", march):
        raise CPUMarchError(f"PAGELLM_CPU_MARCH={march!r}: expected a GCC -march name such as native, haswell, "
                            "x86-64-v3 or sapphirerapids")
    if march == "native":
        return march
    import shutil
    import subprocess

    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        return march  # the build itself reports the missing compiler
    probe = subprocess.run([cxx, f"-march={march}", "-dM", "-E", "-x", "c++", "-"], input="", capture_output=True,
                           text=True)
    if probe.returncode != 0:
        raise CPUMarchError(f"PAGELLM_CPU_MARCH={march!r}: the compiler does not know this target: "
                            f"{(probe.stderr.strip().splitlines() or [''])[0][:300]}")
    cpuinfo = _cpu_flags()
    if cpuinfo.startswith("flags"):  # /proc/cpuinfo read (not platform's fallback): name what the CPU lacks
        flags = set(cpuinfo.split())
        defined = {line.split()[1] for line in probe.stdout.splitlines() if line.startswith("#define ")}
        missing = sorted(flag for macro, flag in _TARGET_FEATURES.items() if macro in defined and flag not in flags)
        if missing:
            raise CPUMarchError(f"PAGELLM_CPU_MARCH={march!r}: the target uses {', '.join(missing)}, which this CPU "
                                "does not have")
    return march


def _prune_old_builds(build_dir: pathlib.Path, march: str = "native") -> None:
    """Mark build_dir as this source tree's build and delete the tree's earlier builds (each source change leaves
    one, ~30 MB: an upgrade would otherwise keep them all). Builds of other source trees (another checkout or
    install sharing the cache dir) and builds for another -march (PAGELLM_CPU_MARCH) are left alone."""
    import shutil

    marker, mine = "source_dir", str(_CSRC) + ("" if march == "native" else f" -march={march}")
    try:
        (build_dir / marker).write_text(mine)
        for other in build_dir.parent.glob("pagellm_cpu_kernels_*"):
            if other != build_dir and (other / marker).is_file() and (other / marker).read_text() == mine:
                logger.info("removing an earlier build of the CPU kernels: %s", other)
                shutil.rmtree(other, ignore_errors=True)
    except OSError as e:  # a read-only or shared cache: keep what is there
        logger.info("could not prune earlier CPU kernel builds (%s)", e)


def _cpu_flags() -> str:
    """The instruction-set flags of this CPU (Linux), so a cache dir shared by different CPUs keeps one build each."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    load_extension()
    print("CPU kernels ready")
