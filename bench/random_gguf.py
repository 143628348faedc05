"""Write a llama GGUF of random quantized weights in a real model's shapes, to measure what a GGUF type costs end
to end without its file (the machine has no model hub):

    .venv/bin/python bench/random_gguf.py /tmp/tinyllama-q4km.gguf          # TinyLlama-1.1B's shapes, Q4_K_M's mix
    .venv/bin/pagellm bench latency --model /tmp/tinyllama-q4km.gguf --input-len 128 --output-len 128
    .venv/bin/pagellm bench latency --model /tmp/tinyllama-q4km.gguf ... --no-gguf-quantized-linears
    .venv/bin/python bench/random_gguf.py --mix q4_0 /tmp/tinyllama-q4_0.gguf  # every linear in Q4_0

The default mix is llama.cpp's Q4_K_M: Q4_K everywhere but the output head, attn_v and ffn_down in Q6_K (llama.cpp
keeps those two in Q6_K for a part of the layers only: this is the heavier case); ``--mix q4_0`` is its Q4_0: every
layer linear and the embeddings in Q4_0, the output head in Q6_K; ``--mix q5_0`` and ``q8_0`` likewise. Quants are
random bytes (Q8_0's in [-127, 127] with each block's largest at 127, as llama.cpp's quantizer leaves them), the
fp16 scales drawn in a trained model's range, the norms ones; no tokenizer (prompts are token ids). The text it
generates means nothing; the bytes each step reads are a real file's (but random quants fill a block's range
evenly, so how the int8 form's guard judges them says little about a trained model's: bench/int8_excess.py).
"""
from __future__ import annotations

import argparse

import numpy as np

import gguf
from gguf import GGMLQuantizationType as Q

# (hidden, intermediate, layers, heads, kv heads, vocab): TinyLlama-1.1B
SHAPES = {"tinyllama": (2048, 5632, 22, 32, 4, 32000)}
# where each block's fp16 d (and Q4_K's dmin) lie
D_AT = {Q.Q4_K: (0, 2), Q.Q6_K: (208,), Q.Q4_0: (0,), Q.Q5_0: (0,), Q.Q8_0: (0,)}
# each type's d: a 6-bit scale times a 4- / 6-bit quant (K-quants), a 4- / 5- / 8-bit quant alone (Q4_0, Q5_0, Q8_0):
# |w| up to ~0.1
D_RANGE = {Q.Q4_K: (0.0002, 0.0008), Q.Q6_K: (0.0002, 0.0008), Q.Q4_0: (0.004, 0.012), Q.Q5_0: (0.002, 0.006),
           Q.Q8_0: (0.0002, 0.0008)}
# --mix: (embeddings, q / k / o / gate / up, v and down)
MIXES = {"q4_k_m": (Q.Q4_K, Q.Q4_K, Q.Q6_K), "q4_0": (Q.Q4_0, Q.Q4_0, Q.Q4_0), "q5_0": (Q.Q5_0, Q.Q5_0, Q.Q5_0),
         "q8_0": (Q.Q8_0, Q.Q8_0, Q.Q8_0)}


def blocks(rng: np.random.Generator, qtype: Q, rows: int, cols: int) -> np.ndarray:
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // per, size), dtype=np.uint8)
    for i, at in enumerate(D_AT[qtype]):
        scale = rng.uniform(*D_RANGE[qtype], (raw.shape[0], 1)) * (1 if i == 0 else 2)
        raw[:, at:at + 2] = scale.astype(np.float16).view(np.uint8)
    if qtype == Q.Q8_0:
        q = raw[:, 2:].view(np.int8)
        np.clip(q, -127, 127, out=q)
        q[:, 0] = 127
    return raw.reshape(rows, cols // per * size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--shapes", default="tinyllama", choices=sorted(SHAPES))
    ap.add_argument("--mix", default="q4_k_m", choices=sorted(MIXES))
    a = ap.parse_args()
    embed, main_q, heavy = MIXES[a.mix]
    hidden, inter, layers, heads, kv_heads, vocab = SHAPES[a.shapes]
    head_dim = hidden // heads
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(a.path, "llama")
    w.add_name(f"random {a.shapes} {a.mix.upper()}")
    w.add_block_count(layers)
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(vocab)
    w.add_tensor("token_embd.weight", blocks(rng, embed, vocab, hidden), raw_dtype=embed)
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    w.add_tensor("output.weight", blocks(rng, Q.Q6_K, vocab, hidden), raw_dtype=Q.Q6_K)
    kv = kv_heads * head_dim
    linears = (("attn_q", main_q, hidden, hidden), ("attn_k", main_q, kv, hidden), ("attn_v", heavy, kv, hidden),
               ("attn_output", main_q, hidden, hidden), ("ffn_gate", main_q, inter, hidden),
               ("ffn_up", main_q, inter, hidden), ("ffn_down", heavy, hidden, inter))
    for i in range(layers):
        for name, qtype, rows, cols in linears:
            w.add_tensor(f"blk.{i}.{name}.weight", blocks(rng, qtype, rows, cols), raw_dtype=qtype)
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
