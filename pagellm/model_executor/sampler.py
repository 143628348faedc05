"""Batched sampling: penalties, min_tokens, temperature, top-k / top-p / min-p, seeded draws, logprobs.

All work is tensor work over the [num_requests, vocab] logits; per-request values arrive as tensors in
``SamplingMetadata``. Nothing sorts or draws over the whole vocabulary: on [64, 49152] logits a full sort takes
~100-170 ms and one exponential per logit ~100 ms, several times a model step. Top-k / top-p find each row's cut
from a histogram of its logits (C++ kernel, CPU) or from its most likely tokens (``torch.topk``, elsewhere; a row
those do not settle is sorted whole), and every random row draws one uniform and inverts its cumulative
distribution. A request with a seed draws its uniform from its own generator, and tokens with equal logits keep
one order (token id ascending), so its tokens do not depend on which other requests share the batch.
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
    # logit_bias: (row, token, bias) triples added to the logits before anything else (None when no row has one)
    bias_rows: torch.Tensor | None = None  # [B] row index
    bias_tokens: torch.Tensor | None = None  # [B] token id
    bias_values: torch.Tensor | None = None  # [B] float32


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # [R] int64
    logprob: torch.Tensor | None  # [R] logprob of the sampled token
    rank: torch.Tensor | None  # [R] its rank (1 = most likely)
    top_ids: torch.Tensor | None  # [R, k]
    top_logprobs: torch.Tensor | None  # [R, k]


def apply_penalties(logits: torch.Tensor, m: SamplingMetadata, inplace: bool = False) -> torch.Tensor:
    """vLLM semantics: repetition penalty on tokens seen in prompt or output (divide positive logits, multiply
    negative ones); frequency and presence penalties on output tokens only (OpenAI's formula).

    Sparse: only the (row, token) pairs that occur are read and written (a few hundred per row), not [R, V]
    masks and counts (~15 passes over [64, 49152] took ~30 ms a step). A pair that occurs several times is
    written several times with the same value, except the frequency penalty, which accumulates once per time.
    ``inplace``: write into ``logits`` (the sampler's own fp32 copy when no logprobs need the raw values)."""
    if not inplace:
        logits = logits.clone()
    rows, toks = _pairs(torch.cat([m.prompt_token_ids, m.output_token_ids], dim=1))
    x = logits[rows, toks]
    rep = m.repetition_penalty[rows]
    logits[rows, toks] = torch.where(x > 0, x / rep, x * rep)
    rows, toks = _pairs(m.output_token_ids)
    logits.index_put_((rows, toks), -m.frequency_penalty[rows], accumulate=True)
    logits[rows, toks] = logits[rows, toks] - m.presence_penalty[rows]
    return logits


def _pairs(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, L] token ids padded with -1 -> the (row, token) index pairs of the ids present, repeats included."""
    present = ids >= 0
    rows = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)
    return rows[present], ids[present]


def apply_min_p(logits: torch.Tensor, m: SamplingMetadata) -> torch.Tensor:
    """-inf for the tokens whose probability is below min_p times the row's largest (the torch path's min-p)."""
    if m.min_p is None:
        return logits
    probs = logits.softmax(-1)
    threshold = probs.amax(-1, keepdim=True) * m.min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p_min_p(logits: torch.Tensor, m: SamplingMetadata) -> torch.Tensor:
    """The reference: every row's logits with the tokens min-p, top-k and top-p remove set to -inf, through a full
    sort (``sample_random`` takes the same cut without sorting whole rows)."""
    logits = apply_min_p(logits, m)
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
        self.ops = ops  # the CPU kernels (argmax_rows, sample_rows, logprobs_rows), or None

    @staticmethod
    def argmax_only(m: SamplingMetadata) -> bool:
        """A plain greedy batch (no penalties, biases, stop masks or logprobs): its tokens are the logits' argmax,
        which the model may hand over in place of the logits (LlamaForCausalLM.forward's argmax)."""
        return (m.all_greedy and m.prompt_token_ids is None and m.bias_rows is None and m.stop_mask_rows is None
                and m.max_num_logprobs is None)

    def __call__(self, logits: torch.Tensor, m: SamplingMetadata) -> SamplerOutput:
        """logits: [R, V] in the model's dtype, one row per request that samples this step. A plain greedy batch
        takes the argmax of them as they are (exact: every bf16 value converts exactly to fp32); anything else
        works on an fp32 copy."""
        if self.argmax_only(m):
            return SamplerOutput(self._argmax(logits), None, None, None, None)
        private = logits.dtype != torch.float32  # .float() copies: the penalties may write into the copy
        logits = logits.float()
        raw = logits  # what logprobs report (as vLLM's default): the model's, before biases and penalties
        if m.bias_rows is not None:  # (as vLLM: the bias first, then the penalties on the biased logits)
            logits = logits.index_put((m.bias_rows, m.bias_tokens), m.bias_values, accumulate=True)
        if m.prompt_token_ids is not None:
            logits = apply_penalties(logits, m, inplace=private and m.max_num_logprobs is None)
        if m.stop_mask_rows is not None:
            logits = logits.index_put((m.stop_mask_rows, m.stop_mask_tokens),
                                      torch.tensor(float("-inf"), device=logits.device))

        if m.all_greedy:
            sampled = self._argmax(logits)
        else:
            temp = torch.where(m.temperature > 0, m.temperature, 1.0)
            sampled = sample_random(logits, temp, m, self.ops)
            greedy = m.temperature == 0
            if bool(greedy.any()):
                sampled = torch.where(greedy, self._argmax(logits), sampled)

        if m.max_num_logprobs is None:
            return SamplerOutput(sampled, None, None, None, None)
        return self.logprobs(raw, sampled, m.max_num_logprobs)

    def logprobs(self, raw: torch.Tensor, tokens: torch.Tensor, k: int) -> SamplerOutput:
        """Each row's log-softmax (raw: [R, V] fp32) at its token (int64 [R]), that token's rank, and the row's k
        most likely tokens (none for k = 0); ``tokens`` comes back as ``sampled``."""
        if self.ops is not None and raw.is_cpu:  # one C++ pass pair per row instead of ~10 ms of [R, V] ops
            r = raw.shape[0]
            chosen, rank = torch.empty(r), torch.empty(r, dtype=torch.int64)
            top_ids, top_lp = torch.empty(r, k, dtype=torch.int64), torch.empty(r, k)
            self.ops.logprobs_rows(raw.contiguous(), tokens.contiguous(), k, chosen, rank, top_ids, top_lp)
            return SamplerOutput(tokens, chosen, rank, top_ids if k > 0 else None, top_lp if k > 0 else None)
        logprobs = raw.log_softmax(-1)
        chosen = logprobs.gather(1, tokens[:, None])
        rank = (logprobs > chosen).sum(-1) + 1
        top_lp, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (None, None)
        return SamplerOutput(tokens, chosen.squeeze(1), rank, top_ids, top_lp)

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if self.ops is None or not logits.is_cpu:
            return logits.argmax(-1)
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self.ops.argmax_rows(logits, out)  # torch's CPU argmax is several times slower on [64, 49152]
        return out


FIRST_CANDIDATES = 256  # the torch path looks at this many tokens of a top-k / top-p row first


def sample_random(logits: torch.Tensor, temperature: torch.Tensor, m: SamplingMetadata, ops=None) -> torch.Tensor:
    """One token per row from softmax(logits / temperature) under the rows' min-p, top-k and top-p ([R, V] fp32;
    [R] temperature > 0): one uniform per row inverts the row's cumulative distribution, in token-id order. On CPU
    one C++ call (``sample_rows``) scales, cuts and draws each row without writing its probabilities out."""
    u = _uniforms(m, logits.shape[0], logits.device)
    r = logits.shape[0]
    if ops is not None and logits.is_cpu:
        top_k = m.top_k if m.top_k is not None else torch.zeros(r, dtype=torch.int64)
        top_p = m.top_p if m.top_p is not None else torch.ones(r)
        min_p = m.min_p if m.min_p is not None else torch.zeros(r)
        out = torch.empty(r, dtype=torch.int64)
        ops.sample_rows(logits.contiguous(), temperature.contiguous(), top_k.contiguous(), top_p.contiguous(),
                        min_p.contiguous(), u, out)
        return out
    # min-p's threshold is on the distribution after the temperature
    probs = top_k_top_p_probs(apply_min_p(logits / temperature[:, None], m), m.top_k, m.top_p)
    return _inverse_cdf(probs, u)


def top_k_top_p_probs(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                      ops=None, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """[R, V] probabilities, unnormalised, with 0 for the tokens top-k and top-p remove (top_k: [R], 0 = off;
    top_p: [R], 1 = off; either None when no row uses it). On CPU the C++ kernel takes each row's cut from a
    histogram of its logits (and min-p's, given min_p); elsewhere ``_candidates`` takes it from the rows' most
    likely tokens (the caller applies min-p first)."""
    r = logits.shape[0]
    if ops is not None and logits.is_cpu:
        out = torch.empty_like(logits)
        ops.top_k_top_p_probs(logits.contiguous(),
                              top_k if top_k is not None else torch.zeros(r, dtype=torch.int64),
                              top_p if top_p is not None else torch.ones(r),
                              min_p if min_p is not None else torch.zeros(r), out)
        return out
    if top_k is None and top_p is None:
        return (logits - logits.amax(-1, keepdim=True)).exp()
    if top_k is None:
        top_k = torch.zeros(r, dtype=torch.int64, device=logits.device)
    if top_p is None:
        top_p = torch.ones(r, dtype=torch.float32, device=logits.device)
    probs = (logits - logits.amax(-1, keepdim=True)).exp()
    rows = ((top_k > 0) | (top_p < 1.0)).nonzero().squeeze(1)
    if rows.numel():
        vocab = logits.shape[1]
        n = min(vocab, max(FIRST_CANDIDATES, int(top_k[rows].max()) + 1))  # one past the largest k: its tie shows
        ids, cand, settled = _candidates(logits[rows], top_k[rows], top_p[rows], n)
        done, rest = rows[settled], rows[~settled]
        probs[done] = torch.zeros_like(probs[done]).scatter_(1, ids[settled], cand[settled].softmax(-1))
        if rest.numel():  # rows whose cut the first candidates do not settle: all their tokens, in order
            ids, cand, _ = _candidates(logits[rest], top_k[rest], top_p[rest], vocab)
            probs[rest] = torch.zeros_like(probs[rest]).scatter_(1, ids, cand.softmax(-1))
    return probs


def _candidates(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's n most likely tokens and their logits, -inf where top-k or top-p removes them ([R, n] ids and
    logits, logit descending, then id ascending), and whether that settles the row's cut ([R] bool; always with
    n = vocab). A top-k row is settled when its k-th logit is above the smallest candidate (else tokens tied with
    it may be missing); a top-p row without top-k when the candidates above the smallest one hold more than p of
    the row's mass (every other token then comes after more than p).
    """
    vocab = logits.shape[1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    vals, ids = _canonical_topk(logits, n)
    remove = torch.arange(n, device=logits.device)[None, :] >= k[:, None]
    lse = vals.masked_fill(remove, float("-inf")).logsumexp(-1)  # top-p's mass is over what top-k keeps
    if bool((k == vocab).any()):
        lse = torch.where(k == vocab, logits.logsumexp(-1), lse)
    probs = (vals - lse[:, None]).exp().masked_fill(remove, 0.0)
    before = probs.cumsum(-1) - probs  # mass strictly before each token; the first is always kept
    remove |= before > top_p[:, None]
    if n == vocab:
        return ids, vals.masked_fill(remove, float("-inf")), torch.ones_like(k, dtype=torch.bool)
    last = vals[:, -1:]
    kth = vals.gather(1, (k.clamp(max=n) - 1)[:, None]).squeeze(1)
    settled = torch.where(k < vocab, kth > last.squeeze(1),
                          (top_p >= 1.0) | (probs.masked_fill(vals <= last, 0.0).sum(-1) > top_p))
    return ids, vals.masked_fill(remove, float("-inf")), settled


def _canonical_topk(logits: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n largest logits of each row and their ids, logit descending, then id ascending among ties: one order
    whatever n is (n depends on the other rows of the batch)."""
    if n >= logits.shape[1]:
        return logits.sort(dim=-1, descending=True, stable=True)
    vals, ids = logits.topk(n, dim=-1, sorted=False)
    ids, order = ids.sort(dim=-1)
    vals, order2 = vals.gather(1, order).sort(dim=-1, descending=True, stable=True)
    return vals, ids.gather(1, order2)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative probability exceeds u * total ([R, N] probs, unnormalised; [R] u
    in [0, 1)): a draw from probs; zero-probability entries are never chosen."""
    c = probs.cumsum(-1)
    idx = torch.searchsorted(c, u[:, None] * c[:, -1:], right=True).squeeze(1)
    return idx.clamp_(max=probs.shape[1] - 1)


def _uniforms(m: SamplingMetadata, r: int, device) -> torch.Tensor:
    """One uniform per row; a seeded row's from its own generator."""
    u = torch.rand(r, device=device)
    for row, gen in m.generators.items():
        u[row] = torch.rand(1, generator=gen, device=gen.device).to(device)[0]
    return u

