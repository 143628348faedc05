"""Model construction: architecture name -> our model class, built without random init, weights loaded."""
from __future__ import annotations

import torch

from pagellm.model_executor.layers.attention import AttentionBackend
from pagellm.model_executor.layers.linear import cpu_kernels
from pagellm.model_executor.layers.quantized import GGUFWeight
from pagellm.model_executor.models.llama import LlamaForCausalLM

# Every supported architecture is a Llama-family decoder with small switches (see models/llama.py).
MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def build_model(hf_config, architecture: str, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device, backend: AttentionBackend, max_position: int,
                reduced_precision_reduction: bool = True,
                quantized: dict[str, GGUFWeight] | None = None,
                int8_activations: bool = True) -> LlamaForCausalLM:
    """Build on the meta device (no wasted random init), materialise on ``device`` in ``dtype``, load weights.
    reduced_precision_reduction: see EngineConfig. quantized: a GGUF's weights in their blocks by HF name
    (LoadedCheckpoint.quantized), for the few-row linears where the CPU kernels run. int8_activations: see
    EngineConfig.gguf_int8_activations. Consumes weights and quantized: the model takes their tensors over
    (LlamaForCausalLM.load_weights); a weight in quantized alone (load_checkpoint's defer_quantized) is made from its
    blocks where a kernel reads it in bf16."""
    if architecture not in MODEL_CLASSES:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: {sorted(MODEL_CLASSES)}")
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = MODEL_CLASSES[architecture](hf_config, architecture, backend, max_position)
    finally:
        torch.set_default_dtype(old)
    # Module.to_empty's empty_like on meta tensors runs torch's Python reference (torch._refs), whose first call
    # imports sympy and torch.fx's symbolic shapes: 0.22-0.36 s of a ~3 s cold start here. torch.empty by shape
    # allocates the same (contiguous) tensors without it.
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.rotary.build_tables(device)
    kernels = (cpu_kernels(backend.ops, dtype, reduced_precision_reduction, int8_activations)
               if device.type == "cpu" else None)
    # a GGUF's layer linears loaded in blocks alone stay so where the CPU linears take blocks (use_cpu_kernels)
    model.load_weights(weights, quantized, defer=kernels is not None and kernels.gguf is not None)
    if device.type == "cpu" and dtype != torch.float32 and getattr(backend, "ops", None) is not None:
        # the paged kernel's fp16 sums for prefill chunks (fp32 keeps fp32 sums: HF-exact)
        backend.fp16_sums = reduced_precision_reduction and bool(backend.ops.paged_attention_fp16_supported())
    if kernels is not None:
        model.use_cpu_kernels(kernels, quantized)
    return model.eval()
