"""Llama-family decoder (Llama 1/2/3, SmolLM2, TinyLlama, Mistral, Qwen2, Qwen3) over flattened tokens.

The architectures differ only in small switches read from the HF config:
  - Qwen2: bias on q/k/v projections;           - Qwen3: RMSNorm on each head of q and k before rope;
  - Mistral / Qwen sliding-window layers;        - tied input/output embeddings.
Q/K/V and gate/up projections are fused into one matmul each; ``load_weights`` fuses HF's separate tensors.
Activations are [num_tokens, hidden]: there is no batch dimension, requests are told apart by the attention
metadata only.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from pagellm.model_executor.layers.attention import AttentionBackend, AttentionMetadata
from pagellm.model_executor.layers.linear import (AMX_MAX_ROWS, AMX_Q4_MAX_ROWS, GEMV_MAX_ROWS, CPUKernels, CPULinear,
                                                  replace_linears)
from pagellm.model_executor.layers.quantized import GGUFParts, GGUFWeight
from pagellm.model_executor.layers.rotary import RotaryEmbedding, apply_rotary


def _range(name: str):
    """A profiler range, only while a profiler runs: ``record_function`` costs ~15 us even when nobody
    listens, and a decode step would enter 90 of them."""
    return record_function(name) if torch.autograd._profiler_enabled() else nullcontext()


class RMSNorm(nn.Module):
    """As HF's LlamaRMSNorm: normalise in fp32, scale in the activation dtype.

    With a residual, first adds it (``residual = x + residual``, as HF's skip connection) and returns both the
    normalised sum and the new residual. ``ops`` are the fused CPU kernels (in place, one pass); None: torch.
    """

    def __init__(self, dim: int, eps: float, ops=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.ops is not None and x.dim() == 2 and x.stride(-1) == 1:
            if residual is None:
                out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
                self.ops.rms_norm(x, self.weight, out, self.eps)
                return out
            self.ops.add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class ModelShape:
    """The numbers a model and its KV cache are built from, read once from the HF config."""

    def __init__(self, cfg, architecture: str) -> None:
        self.architecture = architecture
        self.hidden_size = cfg.hidden_size
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.intermediate_size = cfg.intermediate_size
        self.vocab_size = cfg.vocab_size
        self.eps = cfg.rms_norm_eps
        self.qkv_bias = architecture == "Qwen2ForCausalLM" or bool(getattr(cfg, "attention_bias", False))
        self.o_bias = architecture != "Qwen2ForCausalLM" and bool(getattr(cfg, "attention_bias", False))
        self.mlp_bias = bool(getattr(cfg, "mlp_bias", False))
        self.qk_norm = architecture == "Qwen3ForCausalLM"
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.max_position_embeddings = cfg.max_position_embeddings
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
        window = getattr(cfg, "sliding_window", None)
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types is not None:
            self.sliding_windows = [window if t == "sliding_attention" else None for t in layer_types]
        else:  # Mistral: one window for every layer (None when disabled)
            self.sliding_windows = [window] * self.num_layers

    def attention_keys_per_token(self) -> float:
        """Keys whose attention costs the FLOPs of one token's linear layers (the scheduler's A): per layer, the
        linears' weights (q, k, v, o, gate, up, down: a multiply-add each per token) over the 2 x heads x head_dim
        multiply-adds of one key (q.k and p.v). The scheduler caps the keys of sliding-window layers itself."""
        h, d = self.hidden_size, self.head_dim
        linears = h * d * 2 * (self.num_heads + self.num_kv_heads) + 3 * h * self.intermediate_size
        return linears / (2 * self.num_heads * d)


class Attention(nn.Module):
    def __init__(self, s: ModelShape, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = s.num_heads, s.num_kv_heads, s.head_dim
        self.q_size, self.kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self.qkv_proj = nn.Linear(s.hidden_size, self.q_size + 2 * self.kv_size, bias=s.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, s.hidden_size, bias=s.o_bias)
        self.q_norm = RMSNorm(s.head_dim, s.eps) if s.qk_norm else None
        self.k_norm = RMSNorm(s.head_dim, s.eps) if s.qk_norm else None
        self.scale = s.head_dim ** -0.5
        self.sliding_window = s.sliding_windows[layer_idx]
        self.backend = backend
        self.ops = backend.ops

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], kv_cache, meta: AttentionMetadata):
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.ops is not None:
            self.ops.rotary_embedding(q, k, *rope)  # in place, q and k stay views of qkv
        else:
            q, k = apply_rotary(q, k, *rope)
        with _range("pagellm.attention_backend"):
            o = self.backend.forward(q, k, v, kv_cache, meta, self.scale, self.sliding_window)
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, s: ModelShape, ops=None) -> None:
        super().__init__()
        self.intermediate_size = s.intermediate_size
        self.gate_up_proj = nn.Linear(s.hidden_size, 2 * s.intermediate_size, bias=s.mlp_bias)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=s.mlp_bias)
        self.ops = ops

    def forward(self, x):
        if isinstance(self.gate_up_proj, CPULinear) and (h := self.gate_up_proj.silu_and_mul(x)) is not None:
            return self.down_proj(h)
        gate_up = self.gate_up_proj(x)
        if self.ops is not None:
            h = torch.empty(gate_up.shape[0], self.intermediate_size, dtype=x.dtype, device=x.device)
            self.ops.silu_and_mul(gate_up, h)
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            h = F.silu(gate) * up
        return self.down_proj(h)


class DecoderLayer(nn.Module):
    """Pre-norm block. The residual stream travels separately (as in vLLM) so each skip-add fuses into the
    next norm: returns (this layer's output, residual); the caller adds them in the next norm."""

    def __init__(self, s: ModelShape, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.eps, backend.ops)
        self.self_attn = Attention(s, layer_idx, backend)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.eps, backend.ops)
        self.mlp = MLP(s, backend.ops)

    def forward(self, x, residual, rope, kv_cache, meta):
        with _range("pagellm.layer.attention"):
            if residual is None:
                residual, h = x, self.input_layernorm(x)
            else:
                h, residual = self.input_layernorm(x, residual)
            h = self.self_attn(h, rope, kv_cache, meta)
        with _range("pagellm.layer.mlp"):
            h, residual = self.post_attention_layernorm(h, residual)
            return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, hf_config, architecture: str, backend: AttentionBackend, max_position: int) -> None:
        super().__init__()
        s = self.shape = ModelShape(hf_config, architecture)
        self.rotary = RotaryEmbedding(hf_config, s.head_dim, max(max_position, 1))
        # given its (meta) weight, so no random init runs: normal_ on the meta device goes through torch._refs,
        # whose first use imports torch._dynamo (~1.3 s of a cold start)
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size, _weight=torch.empty(s.vocab_size, s.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(s, i, backend) for i in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.eps, backend.ops)
        self.ops = backend.ops
        self.supports_cascade = backend.supports_cascade
        self.lm_head = None if s.tie_word_embeddings else nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        self.fast_lm_head: CPULinear | None = None
        self.linear_kernels = "torch"  # which linear kernels run (CPUKernels.name), for benchmark reports
        self.backend = backend
        # The layer stack as one C++ call (csrc/decoder_cpu.cpp), set by use_cpu_kernels where it applies.
        self.decoder = None
        self.prune_last_layer = True  # see forward; the tests switch it off to hold the two loops bit-equal
        self._bound_caches: list[torch.Tensor] | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, logits_indices: torch.Tensor, argmax: bool = False) -> torch.Tensor:
        """Hidden states for all T tokens; logits only for the rows in ``logits_indices`` (model dtype).
        argmax (greedy sampling): where the LM head's kernel can, each of those rows' index of its largest logit
        instead (int64 [R], torch.argmax of the logits), the logits never written; else the logits as without."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary.lookup(positions, x.dtype)
        keep = None
        if self.decoder is not None:
            # In a prefill step the C++ loop's last layer computes only the rows that get logits and returns them.
            if meta.prefill_rows and self.prune_last_layer:
                req = torch.searchsorted(meta.query_start_loc, logits_indices, right=True) - 1
                keep = (logits_indices, req, positions[logits_indices] + 1)
            x, residual = self._fused_layers(x, rope, kv_caches, meta, keep)
        else:
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches):
                x, residual = layer(x, residual, rope, kv_cache, meta)
        if keep is None:
            x, residual = x[logits_indices], residual[logits_indices]
        x, _ = self.norm(x, residual)
        if self.fast_lm_head is not None:
            if argmax and (ids := self.fast_lm_head.argmax(x)) is not None:
                return ids
            return self.fast_lm_head(x)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, weight)

    def _fused_layers(self, x, rope, kv_caches, meta: AttentionMetadata, keep=None):
        if kv_caches is not self._bound_caches:  # the runner passes the same list every step
            views = [self.backend.views(c) for c in kv_caches]
            self.decoder.bind_cache([k for k, _ in views], [v for _, v in views])
            self._bound_caches = kv_caches
        c = meta.cascade
        return self.decoder.forward(x, *rope, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, bool(meta.prefill_rows), c and c.blocks, c and c.rows,
                                    c and c.kv_start, *(keep or (None, None, None)))

    def use_cpu_kernels(self, kernels: CPUKernels, quantized: dict[str, GGUFWeight] | None = None) -> None:
        """CPU decode speed: every linear layer and the LM head get a pre-packed weight (see layers/linear), and,
        where the C++ decoder covers the model (bf16 on AMX or AVX-512, no q/k norms), the layer loop runs in C++.
        quantized: a GGUF file's weights in their blocks by HF name, fused as load_weights fuses the parameters, for
        the few-row path (layers/quantized.py)."""
        replace_linears(self.layers, kernels, self._fused_gguf(quantized) if quantized else None)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.fast_lm_head = CPULinear(weight, None, kernels)
        self.fast_lm_head.enable_argmax_screen()  # (before its blocks: the screen keeps the bf16 weight)
        self.linear_kernels = kernels.name
        if quantized:
            head = quantized.get("model.embed_tokens.weight" if self.lm_head is None else "lm_head.weight")
            lins = [m for m in self.layers.modules() if isinstance(m, CPULinear)]
            if self.fast_lm_head.set_gguf(head, int8_form=False) | any(m.gguf is not None for m in lins):
                nibbles = "+amx_q4" if any(m.amx_q4 is not None for m in lins) else ""
                int8 = "+vnni_int8" if any(m.vnni_int8 is not None for m in lins) else ""
                gguf = "+gguf_int8" if any(f is not None for m in lins for f in m.gguf_int8) else "+gguf"
                self.linear_kernels += nibbles + int8 + gguf
        self.decoder = self._build_decoder(kernels)

    def _fused_gguf(self, quantized: dict[str, GGUFWeight]) -> dict[str, GGUFWeight | GGUFParts]:
        """Each layer linear whose every part is in ``quantized``: its (fused) blocks, by module name under layers.
        Those parts leave ``quantized`` (as load_weights consumes the weights), so a linear that keeps only its int8
        forms frees them."""
        parts = {"self_attn.qkv_proj": [f"self_attn.{p}_proj" for p in "qkv"], "self_attn.o_proj": ["self_attn.o_proj"],
                 "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"], "mlp.down_proj": ["mlp.down_proj"]}
        fused = {}
        for i in range(len(self.layers)):
            for name, sources in parts.items():
                keys = [f"model.layers.{i}.{src}.weight" for src in sources]
                if all(k in quantized for k in keys):
                    fused[f"{i}.{name}"] = GGUFWeight.cat([quantized.pop(k) for k in keys])
        return fused

    def _build_decoder(self, kernels: CPUKernels):
        """The C++ layer loop over this model's weights, or None where it does not apply (the Python loop runs)."""
        s, backend = self.shape, self.backend
        linears = [m for layer in self.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                        layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        if (s.qk_norm or getattr(backend, "ops", None) is None or self.embed_tokens.weight.dtype != torch.bfloat16
                or not all(isinstance(m, CPULinear) and (m.amx_weight is not None or m.vnni_int8 is not None)
                           for m in linears)):
            return None
        decoder = torch.classes.pagellm.LlamaDecoder(s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate_size,
                                                     s.eps, self.layers[0].self_attn.scale, AMX_MAX_ROWS,
                                                     backend.max_query(torch.bfloat16), GEMV_MAX_ROWS,
                                                     backend.fp16_sums, kernels.fma_dot, AMX_Q4_MAX_ROWS)
        no_bias, no_blocks = torch.empty(0, dtype=torch.bfloat16), torch.empty(0)
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            tensors = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            lins = (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)
            pieces = [[q for q, _ in lin.gguf.pieces] if lin.gguf is not None else [] for lin in lins]
            for lin, qs in zip(lins, pieces):
                packed = no_bias if lin.amx_weight is None else lin.amx_weight  # none: the int8 kernels take all rows
                tensors += [packed, lin.weight, no_bias if lin.bias is None else lin.bias,
                            qs[0].qs if qs else no_blocks, qs[0].scales if qs else no_blocks]
            decoder.add_layer([t.detach() for t in tensors], a.sliding_window or 0, [lin.w_inv for lin in lins])
            for which, qs in enumerate(pieces):  # a fused weight of mixed layouts: its further parts
                for q in qs[1:]:
                    decoder.add_gguf_part(which, q.qs, q.scales)
            for which, lin in enumerate(lins):
                for part, form in enumerate(lin.gguf_int8):
                    if form is not None:
                        decoder.set_gguf_int8(which, part, *form)
                if lin.amx_q4 is not None:
                    decoder.set_amx_q4(which, *lin.amx_q4)
                if lin.vnni_int8 is not None:
                    decoder.set_vnni_int8(which, *lin.vnni_int8)
        return decoder

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor], quantized: dict[str, GGUFWeight] | None = None,
                     defer: bool = False) -> None:
        """Take HF-named tensors in, fusing q/k/v and gate/up; every parameter must be set exactly once. Consumes
        ``weights``: each tensor leaves the dict as it is loaded and becomes the parameter itself where it matches
        (dtype, device, contiguous), so the checkpoint's tensors and the model's are never both held (a 7B model's
        14 GB more at load). A weight absent from ``weights`` is made from its blocks in ``quantized`` (a GGUF
        loaded with defer_quantized), or, with defer (the CPU linears will take the blocks: use_cpu_kernels), a
        linear's weight whose every part is in blocks is left to them: its parameter on the meta device, made by its
        CPULinear only if a kernel reads it."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        blocks, dtype = quantized or {}, self.embed_tokens.weight.dtype

        def put(name: str, tensor: torch.Tensor | None) -> None:
            p = params[name]
            if tensor is None:  # left to the blocks
                module, _, attr = name.rpartition(".")
                meta = torch.empty(p.shape, dtype=p.dtype, device="meta")
                setattr(self.get_submodule(module), attr, nn.Parameter(meta, requires_grad=False))
            elif p.shape != tensor.shape:
                raise ValueError(f"weight {name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(p.shape)}")
            elif tensor.dtype == p.dtype and tensor.device == p.device and tensor.is_contiguous():
                p.data = tensor
            else:
                p.copy_(tensor)
            loaded.add(name)

        def need(name: str) -> torch.Tensor:
            if name in weights:
                return weights.pop(name)
            if name in blocks:
                return blocks[name].dequantize(dtype)
            raise ValueError(f"checkpoint is missing weight {name!r}")

        def fused(names: list[str], weight: bool) -> torch.Tensor | None:
            """The tensors of names, stacked; None for a weight left to its blocks."""
            if weight and defer and all(n in blocks and n not in weights for n in names):
                return None
            parts = [need(n) for n in names]
            return torch.cat(parts) if len(parts) > 1 else parts[0]

        put("embed_tokens.weight", need("model.embed_tokens.weight"))
        put("norm.weight", need("model.norm.weight"))
        if self.lm_head is not None:
            put("lm_head.weight", need("lm_head.weight"))
        for i in range(self.shape.num_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            for suffix in ("weight", "bias"):
                w = suffix == "weight"
                if f"{dst}self_attn.qkv_proj.{suffix}" in params:
                    put(f"{dst}self_attn.qkv_proj.{suffix}",
                        fused([f"{src}self_attn.{p}_proj.{suffix}" for p in "qkv"], w))
                if f"{dst}mlp.gate_up_proj.{suffix}" in params:
                    put(f"{dst}mlp.gate_up_proj.{suffix}",
                        fused([f"{src}mlp.{p}_proj.{suffix}" for p in ("gate", "up")], w))
                for name in ("self_attn.o_proj", "mlp.down_proj"):
                    if f"{dst}{name}.{suffix}" in params:
                        put(f"{dst}{name}.{suffix}", fused([f"{src}{name}.{suffix}"], w))
            for name in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
                if f"{dst}{name}.weight" in params:
                    put(f"{dst}{name}.weight", need(f"{src}{name}.weight"))
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"parameters not loaded from the checkpoint: {sorted(missing)[:5]}")
