"""How fine a GGUF type's steps are against the int8 form's (layers/quantized.py: pack_vnni_int8): a trained model's
weights rounded to a type, then to int8 per output column; the worst column's added squared error over the type's
own (the guard CPULinear compares with VNNI_INT8_MAX_EXCESS), with a step per column and, for the types a step per
column cannot follow, per 32-deep block ("/block"). The weights are the default model's (its Q4_1 file
dequantized: real magnitudes and outliers, on a 4-bit grid), by layer kind:

    .venv/bin/python bench/int8_excess.py [model.gguf]

Q4_1 / Q5_0 / Q5_1 / Q8_0 are gguf's own quantizers. gguf cannot write K-quants, so "Q6_K-like" is llama.cpp's
Q6_K in outline: a step of max|w| / 32 per 16 weights, its 8-bit scale against one per 64 (SmolLM2's 576 columns
hold no 256-weight super-block), values in [-32, 31].
"""
from __future__ import annotations

import argparse

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, quants

from pagellm.model_executor.default_model import DEFAULT_MODEL_FILENAME, cache_dir
from pagellm.model_executor.layers.quantized import GGUFWeight, pack_vnni_int8


def q6k_like_excess(w: torch.Tensor, per_block: bool = False) -> float:
    n, k = w.shape
    g = w.view(n, k // 16, 16)
    step = g.abs().amax(-1) / 32
    top = step.view(n, k // 64, 4).amax(-1, keepdim=True) / 127
    d = (torch.round(step.view(n, k // 64, 4) / top).clamp(1, 127) * top).view(n, k // 16, 1)
    wq = (torch.round(g / d).clamp(-32, 31) * d).view(n, -1, 32 if per_block else k)
    s = wq.abs().amax(-1, keepdim=True) / 127
    added = ((torch.round(wq / s) * s - wq) ** 2).sum((-2, -1))
    return (added / (d.square().sum((-2, -1)) * 16 / 12)).max().item()


def gguf_excess(w: torch.Tensor, qtype: Q, per_block: bool = False) -> float:
    raw = quants.quantize(w.numpy(), qtype)
    q = GGUFWeight.from_blocks(qtype.name, torch.from_numpy(raw.view(np.uint8).reshape(w.shape[0], -1)))
    return pack_vnni_int8(q, per_block=per_block)[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="a GGUF file (default: the default model's, once fetched)")
    path = ap.parse_args().model
    if path is None:
        path = cache_dir() / DEFAULT_MODEL_FILENAME
    types = {"Q4_1": Q.Q4_1, "Q5_0": Q.Q5_0, "Q5_1": Q.Q5_1, "Q8_0": Q.Q8_0}
    worst: dict[str, dict[str, list[float]]] = {}
    for t in GGUFReader(path).tensors:
        if "blk." not in t.name or len(t.shape) != 2:
            continue
        w = torch.from_numpy(quants.dequantize(t.data, t.tensor_type).astype(np.float32)).reshape(-1, int(t.shape[0]))
        row = worst.setdefault(t.name.split(".")[2], {})
        for name, qtype in types.items():
            row.setdefault(name, []).append(gguf_excess(w, qtype))
        row.setdefault("Q8_0/block", []).append(gguf_excess(w, Q.Q8_0, per_block=True))
        if w.shape[1] % 64 == 0:
            row.setdefault("Q6_K-like", []).append(q6k_like_excess(w))
            row.setdefault("Q6_K-like/block", []).append(q6k_like_excess(w, per_block=True))
    names = list(types) + ["Q8_0/block", "Q6_K-like", "Q6_K-like/block"]
    print("worst column's excess over the layers (median layer)")
    print(f"{'':12s}" + "".join(f"{n:>17s}" for n in names))
    for kind, row in worst.items():
        cells = [f"{max(row[n]):.2f} ({np.median(row[n]):.2f})" if n in row else "-" for n in names]
        print(f"{kind:12s}" + "".join(f"{c:>17s}" for c in cells))


if __name__ == "__main__":
    main()
