"""A random-weight HF checkpoint of the default model's shape (SmolLM2-135M: Llama, 30 layers, hidden 576,
9 query / 3 KV heads, vocab 49,152, tied embeddings), for benchmarking where the model file cannot go (a machine
with no network, or a size limit on what travels). The workloads are token ids and ignore EOS, so a run does the
same work as on the real weights; the tokens themselves mean nothing.

    python bench/random_checkpoint.py DIR [--dtype bfloat16]
    pagellm bench throughput --model DIR --workload ../shared/workloads/workload_64.json --dtype bfloat16
"""
from __future__ import annotations

import argparse

import torch
import transformers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cfg = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, args.dtype))
    model.save_pretrained(args.dir)
    print(args.dir)


if __name__ == "__main__":
    main()
