"""Batched sampling: penalties, min_tokens, temperature, top-k / top-p / min-p, seeded draws, logprobs.

All work is tensor work over the [num_requests, vocab] logits; per-request values arrive as tensors in
``SamplingMetadata``. Random rows sample by the exponential race (``argmax(p / E)`` with ``E ~ Exp(1)``), which
equals sampling from ``p``; a request with a seed draws its ``E`` row from its own generator, so its tokens do
not depend on which other requests share the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [R] float32, 0 for greedy rows
    all_greedy: bool
    top_k: torch.Tensor | None  # [R] int64, 0 = off; None when no row uses it
    top_p: torch.Tensor | None  # [R] float32; None when no row uses it
    min_p: torch.Tensor | None  # [R] float32; None when no row uses it
    generators: dict[int, torch.Generator]  # row -> generator, for seeded rows
    # Penalties (None when no row uses any): token ids padded with -1
    prompt_token_ids: torch.Tensor | None  # [R, Lp]
    output_token_ids: torch.Tensor | None  # [R, Lo]
    repetition_penalty: torch.Tensor | None  # [R]
    presence_penalty: torch.Tensor | None
    frequency_penalty: torch.Tensor | None
    # min_tokens: rows whose stop tokens are masked this step, and those tokens
    stop_mask_rows: torch.Tensor | None  # [M] row index
    stop_mask_tokens: torch.Tensor | None  # [M] token id
    max_num_logprobs: int | None  # largest top-k logprobs asked by any row; None = no row wants logprobs


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # [R] int64
    logprob: torch.Tensor | None  # [R] logprob of the sampled token
    rank: torch.Tensor | None  # [R] its rank (1 = most likely)
    top_ids: torch.Tensor | None  # [R, k]
    top_logprobs: torch.Tensor | None  # [R, k]


def _counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, L] ids padded with -1 -> [R, V] occurrence counts."""
    counts = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.float32, device=ids.device)
    idx = torch.where(ids < 0, vocab, ids)
    counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float32))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, m: SamplingMetadata) -> torch.Tensor:
    """vLLM semantics: repetition penalty on tokens seen in prompt or output (divide positive logits, multiply
    negative ones); frequency and presence penalties on output tokens only (OpenAI's formula)."""
    vocab = logits.shape[1]
    out_counts = _counts(m.output_token_ids, vocab)
    seen = (_counts(m.prompt_token_ids, vocab) > 0) | (out_counts > 0)
    rep = m.repetition_penalty[:, None].expand_as(logits)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - m.frequency_penalty[:, None] * out_counts
    return logits - m.presence_penalty[:, None] * (out_counts > 0).to(logits.dtype)


def apply_top_k_top_p_min_p(logits: torch.Tensor, m: SamplingMetadata) -> torch.Tensor:
    if m.min_p is not None:
        probs = logits.softmax(-1)
        threshold = probs.amax(-1, keepdim=True) * m.min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if m.top_k is None and m.top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if m.top_k is not None:
        k = torch.where(m.top_k > 0, m.top_k, vocab).clamp(max=vocab)
        remove |= torch.arange(vocab, device=logits.device)[None, :] >= k[:, None]
    if m.top_p is not None:
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(-1)
        before = probs.cumsum(-1) - probs  # mass strictly before each token; the first token is always kept
        remove |= before > m.top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class Sampler:
    def __init__(self, ops=None) -> None:
        self.ops = ops  # the CPU kernels (argmax_rows), or None

    def __call__(self, logits: torch.Tensor, m: SamplingMetadata) -> SamplerOutput:
        """logits: [R, V] in the model's dtype, one row per request that samples this step. A plain greedy batch
        takes the argmax of them as they are (exact: every bf16 value converts exactly to fp32); anything else
        works on an fp32 copy."""
        if (m.all_greedy and m.prompt_token_ids is None and m.stop_mask_rows is None
                and m.max_num_logprobs is None):
            return SamplerOutput(self._argmax(logits), None, None, None, None)
        logits = logits.float()
        raw = logits
        if m.prompt_token_ids is not None:
            logits = apply_penalties(logits, m)
        if m.stop_mask_rows is not None:
            logits = logits.index_put((m.stop_mask_rows, m.stop_mask_tokens),
                                      torch.tensor(float("-inf"), device=logits.device))

        greedy_tokens = self._argmax(logits)
        if m.all_greedy:
            sampled = greedy_tokens
        else:
            temp = torch.where(m.temperature > 0, m.temperature, 1.0)
            scaled = apply_top_k_top_p_min_p(logits / temp[:, None], m)
            probs = scaled.softmax(-1)
            e = torch.empty_like(probs).exponential_()
            for row, gen in m.generators.items():
                e[row].exponential_(generator=gen)
            random_tokens = (probs / e).argmax(-1)
            sampled = torch.where(m.temperature > 0, random_tokens, greedy_tokens)

        if m.max_num_logprobs is None:
            return SamplerOutput(sampled, None, None, None, None)
        logprobs = raw.log_softmax(-1)
        chosen = logprobs.gather(1, sampled[:, None])
        rank = (logprobs > chosen).sum(-1) + 1
        k = m.max_num_logprobs
        top_lp, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (None, None)
        return SamplerOutput(sampled, chosen.squeeze(1), rank, top_ids, top_lp)

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if self.ops is None or not logits.is_cpu:
            return logits.argmax(-1)
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self.ops.argmax_rows(logits, out)  # torch's CPU argmax is several times slower on [64, 49152]
        return out
