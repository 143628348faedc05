"""Write a GGUF file's layer linears in another type, everything else as it is: the default model's trained weights
in Q8_0 / Q5_0 / Q5_1 (gguf's own quantizers), to measure what a type costs in agreement and speed on real weights
(the machine has no model hub):

    .venv/bin/python bench/requantize_gguf.py --type Q8_0 /tmp/smollm2-q8_0.gguf
    .venv/bin/pagellm bench agreement --model /tmp/smollm2-q8_0.gguf --workload ../shared/workloads/workload_16.json

The weights are the source file's dequantized (the default model's Q4_1: on a 4-bit grid), rounded again.
"""
from __future__ import annotations

import argparse

import numpy as np

import gguf
from gguf import GGMLQuantizationType as Q
from gguf import quants

from pagellm.model_executor.default_model import DEFAULT_MODEL_FILENAME, cache_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", help="the file to write")
    ap.add_argument("--type", default="Q8_0", choices=["Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1"])
    ap.add_argument("--source", help="a GGUF file (default: the default model's, once fetched)")
    a = ap.parse_args()
    reader = gguf.GGUFReader(a.source or cache_dir() / DEFAULT_MODEL_FILENAME)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(a.path, arch)
    for field in reader.fields.values():  # the metadata as it is (the writer adds the architecture itself)
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    qtype = Q[a.type]
    for t in reader.tensors:
        if t.name.startswith("blk.") and len(t.shape) == 2:
            w = quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(int(t.shape[1]), int(t.shape[0]))
            writer.add_tensor(t.name, quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main()
