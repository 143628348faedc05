"""Model runner: SchedulerOutput -> input tensors (positions, slot mapping, block tables) -> logits -> tokens.

It owns the model, the KV cache tensor (allocated once from a byte budget) and the sampler. Inputs are built
for the whole step with numpy array arithmetic; the only per-request Python work is gathering each request's
new token ids and block ids.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.profiler import record_function

from pagellm.core.scheduler import SchedulerOutput
from pagellm.model_executor.layers.attention import AttentionMetadata, CascadePrefix, find_cascade_prefix
from pagellm.model_executor.models.llama import LlamaForCausalLM, ModelShape
from pagellm.model_executor.sampler import Sampler, SamplerOutput, SamplingMetadata

PROMPT_LOGPROB_ROWS = 512  # prompt-logprob rows whose logits are made fp32 at a time (a [512, vocab] copy)


@dataclass
class PromptLogprobRows:
    """One step's prompt logprobs: for each (request, n) of ``spans`` in order, its next n rows of ``lp`` (the
    logprobs of its prompt tokens from the next one it lacks on)."""

    spans: list[tuple]
    lp: SamplerOutput


def kv_bytes_per_block(shape: ModelShape, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * shape.num_layers * block_size * shape.num_kv_heads * shape.head_dim * elem


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, num_host_blocks: int = 0, prefault_bytes: int = 0) -> None:
        """dtype: the cache's element type (the model's, or an fp8 kv_cache_dtype). prefault_bytes: how much of a
        CPU cache left unwritten to map now (see below)."""
        self.model = model
        self.block_size = block_size
        self.device = device
        s = model.shape
        # One tensor for all layers: [layers, 2 (K, V), num_blocks, block elements]; the attention backend owns
        # the layout inside a block (block_size x kv_heads x head_dim elements).
        block_elems = block_size * s.num_kv_heads * s.head_dim
        # Zero-filling a CPU cache writes every page of it up front (4 GiB: 1-11 s on the project's VMs, the
        # largest part of a cold start there, and the whole budget resident from the start). Where the backend
        # never reads an unused slot, the cache is left as allocated: the OS maps a page when a block's first
        # token is written, so resident memory follows the blocks in use (beyond the head mapped below).
        alloc = torch.zeros if model.backend.needs_zeroed_cache or device.type != "cpu" else torch.empty
        self.kv_cache = alloc(s.num_layers, 2, num_blocks, block_elems, dtype=dtype, device=device)
        # Mapping a page on its first write costs ~14 us on the project's VMs (the host backs the page only then),
        # and inside a step the KV writer's faults hold up both threads: workload_64 first writes ~0.6 GB of
        # blocks, 1.2-1.3 s of an ~11 s run. So the blocks the pool hands out first (the lowest ids) are mapped
        # now, by writing zeros into them: 1 GiB (prefault_bytes' default) took 1.8 s at start-up there.
        self.bytes_per_block = kv_bytes_per_block(s, block_size, dtype)
        # Blocks [0, mapped_blocks) are mapped (written at start-up); the OS maps those past it when tokens are
        # first written into them, unless prefault_blocks has (the server calls it while idle).
        self.mapped_blocks = num_blocks
        if alloc is torch.empty:
            self.mapped_blocks = min(num_blocks, -(-prefault_bytes // self.bytes_per_block))
            self.kv_cache[:, :, :self.mapped_blocks].zero_()
        self.kv_caches = list(self.kv_cache.unbind(0))
        self.kv_cache_bytes = self.kv_cache.numel() * self.kv_cache.element_size()
        # Swap space for preempted requests: the same layout in host memory (pinned when the cache is on a GPU).
        # Never zero-filled: a host block is read only after a device block was copied into it.
        self.host_kv_cache = None
        if num_host_blocks:
            self.host_kv_cache = torch.empty(s.num_layers, 2, num_host_blocks, block_elems, dtype=dtype,
                                             pin_memory=device.type == "cuda")
        self.sampler = Sampler(model.ops)
        self.supports_cascade = model.supports_cascade and dtype == torch.bfloat16

    def prefault_blocks(self, first_unused: int, max_blocks: int) -> None:
        """Map up to max_blocks more blocks of the cache by writing zeros into them, starting past both those
        mapped so far and first_unused (the pool has never handed out a block from there on, so none holds data)."""
        lo = max(self.mapped_blocks, first_unused)  # <= the block count: first_unused is a block id + 1
        self.mapped_blocks = min(self.kv_cache.shape[2], lo + max_blocks)
        self.kv_cache[:, :, lo:self.mapped_blocks].zero_()

    def copy_blocks(self, so: SchedulerOutput) -> None:
        """This step's block copies, before its forward pass: swap-outs (device to host), copy-on-write copies
        (device to device: fresh destinations, sources that stay held), then swap-ins (host to device)."""
        cache, host_cache = _raw(self.kv_cache), _raw(self.host_kv_cache)
        if so.swap_out:
            dev, host = (torch.tensor(x, dtype=torch.int64) for x in zip(*so.swap_out))
            host_cache.index_copy_(2, host, cache.index_select(2, dev.to(self.device)).cpu())
        if so.copies:
            src, dst = (torch.tensor(x, dtype=torch.int64, device=self.device) for x in zip(*so.copies))
            cache.index_copy_(2, dst, cache.index_select(2, src))
        if so.swap_in:
            host, dev = (torch.tensor(x, dtype=torch.int64) for x in zip(*so.swap_in))
            blocks = host_cache.index_select(2, host).to(self.device, non_blocking=True)
            cache.index_copy_(2, dev.to(self.device), blocks)

    # ------------------------------------------------------------------ inputs
    def _prepare(self, so: SchedulerOutput):
        sched = so.scheduled
        bs = self.block_size
        q_lens = np.fromiter((s.num_tokens for s in sched), dtype=np.int64, count=len(sched))
        starts = np.fromiter((s.start for s in sched), dtype=np.int64, count=len(sched))
        seq_lens = starts + q_lens
        cu = np.zeros(len(sched) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        total = int(cu[-1])

        token_ids = np.empty(total, dtype=np.int64)
        max_blocks = int(-(-seq_lens.max() // bs))
        block_tables = np.zeros((len(sched), max_blocks), dtype=np.int64)
        asks_prompt_logprobs = []  # (rows of requests asking for prompt logprobs)
        for i, s in enumerate(sched):
            token_ids[cu[i]:cu[i + 1]] = s.request.token_at(s.start, s.start + s.num_tokens)
            if s.request.prompt_logprobs is not None:
                asks_prompt_logprobs.append(i)
            n = -(-int(seq_lens[i]) // bs)
            block_tables[i, :n] = [b.block_id for b in s.request.blocks[:n]]

        req_of_token = np.repeat(np.arange(len(sched)), q_lens)
        positions = np.arange(total, dtype=np.int64) - cu[:-1][req_of_token] + starts[req_of_token]
        slot_mapping = block_tables[req_of_token, positions // bs] * bs + positions % bs

        samples = np.fromiter((s.samples for s in sched), dtype=bool, count=len(sched))
        logits_indices = cu[1:][samples] - 1
        plp_spans = None
        if asks_prompt_logprobs:
            plp_spans, plp_rows, plp_targets = _prompt_logprob_rows(sched, asks_prompt_logprobs, cu)
        if plp_spans:  # their logits follow the sampling rows'
            logits_indices = np.concatenate([logits_indices, plp_rows])
        decode_rows = np.nonzero(q_lens == 1)[0]
        prefill_rows = np.nonzero(q_lens > 1)[0].tolist()

        dev = self.device
        t = lambda a: torch.from_numpy(a).to(dev, non_blocking=True)  # noqa: E731
        cascade = None
        if self.supports_cascade:
            found = find_cascade_prefix(block_tables, seq_lens, decode_rows, cu, bs)
            if found is not None:
                blocks, rows, kv_start = found
                cascade = CascadePrefix(t(blocks), t(rows), t(kv_start))
        meta = AttentionMetadata(
            slot_mapping=t(slot_mapping), block_tables=t(block_tables), seq_lens=t(seq_lens),
            query_start_loc=t(cu), seq_lens_list=seq_lens.tolist(), query_start_list=cu.tolist(),
            query_lens_list=q_lens.tolist(), decode_q_idx=t(cu[:-1][decode_rows]),
            decode_block_tables=t(np.ascontiguousarray(block_tables[decode_rows])),
            decode_seq_lens=t(seq_lens[decode_rows]), prefill_rows=prefill_rows,
            max_decode_seq_len=int(seq_lens[decode_rows].max()) if len(decode_rows) else 0, cascade=cascade)
        plp = (plp_spans, t(np.array(plp_targets, dtype=np.int64))) if plp_spans else None
        return (t(token_ids), t(positions), meta, t(logits_indices), [s.request for s, f in zip(sched, samples) if f],
                plp)

    @torch.inference_mode()
    def forward_prompt(self, tokens: list[int], block_ids: list[int], first: int) -> torch.Tensor:
        """One prefill of ``tokens`` as a request of its own, into ``block_ids`` (enough for all of them; the
        caller keeps them from the scheduler meanwhile): the logits [len - first, vocab] that predict
        tokens[first:], each from the tokens before it. For measures and calibration outside the step loop."""
        bs, L = self.block_size, len(tokens)
        ids = torch.tensor(block_ids, dtype=torch.int64)
        pos = torch.arange(L)
        empty = torch.zeros(0, dtype=torch.int64)
        meta = AttentionMetadata(
            slot_mapping=ids[pos // bs] * bs + pos % bs, block_tables=ids[None, :], seq_lens=torch.tensor([L]),
            query_start_loc=torch.tensor([0, L]), seq_lens_list=[L], query_start_list=[0, L], query_lens_list=[L],
            decode_q_idx=empty, decode_block_tables=torch.zeros(0, len(block_ids), dtype=torch.int64),
            decode_seq_lens=empty, max_decode_seq_len=0, prefill_rows=[0])
        dev = self.device
        return self.model(torch.tensor(tokens, device=dev), pos.to(dev), self.kv_caches, meta,
                          torch.arange(first - 1, L - 1, device=dev))

    def _sampling_metadata(self, reqs) -> SamplingMetadata:
        dev = self.device
        params = [r.sampling_params for r in reqs]
        temperature = torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32)
        all_greedy = all(p.greedy for p in params)
        top_k = top_p = min_p = None
        if not all_greedy:
            if any(p.top_k > 0 for p in params):
                vocab = self.model.shape.vocab_size  # (a larger k keeps every token, as k = vocab)
                top_k = torch.tensor([min(p.top_k, vocab) for p in params], dtype=torch.int64, device=dev)
            if any(p.top_p < 1.0 for p in params):
                top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
            if any(p.min_p > 0.0 for p in params):
                min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
        generators = {i: r.generator for i, r in enumerate(reqs) if r.generator is not None and not r.sampling_params.greedy}

        prompt_ids = output_ids = rep = pres = freq = None
        if any(p.uses_penalties for p in params):
            prompt_ids = _pad([r.prompt_token_ids for r in reqs], dev)
            output_ids = _pad([r.output_token_ids for r in reqs], dev)
            rep = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=dev)
            pres = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=dev)
            freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=dev)

        rows, toks = [], []
        for i, r in enumerate(reqs):
            if r.num_output_tokens < r.sampling_params.min_tokens:
                stop_ids = r.sampling_params.all_stop_token_ids
                rows += [i] * len(stop_ids)
                toks += sorted(stop_ids)
        stop_rows = torch.tensor(rows, dtype=torch.int64, device=dev) if rows else None
        stop_toks = torch.tensor(toks, dtype=torch.int64, device=dev) if rows else None

        bias_rows = bias_toks = bias_vals = None
        if bias := [(i, t, b) for i, p in enumerate(params) if p.logit_bias for t, b in p.logit_bias.items()]:
            rows_of, toks_of, vals_of = zip(*bias)
            bias_rows = torch.tensor(rows_of, dtype=torch.int64, device=dev)
            bias_toks = torch.tensor(toks_of, dtype=torch.int64, device=dev)
            bias_vals = torch.tensor(vals_of, dtype=torch.float32, device=dev)

        nlp = [p.logprobs for p in params if p.logprobs is not None]
        return SamplingMetadata(
            temperature=temperature.to(dev), all_greedy=all_greedy, top_k=top_k, top_p=top_p, min_p=min_p,
            generators=generators, prompt_token_ids=prompt_ids, output_token_ids=output_ids,
            repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq,
            stop_mask_rows=stop_rows, stop_mask_tokens=stop_toks, max_num_logprobs=max(nlp) if nlp else None,
            bias_rows=bias_rows, bias_tokens=bias_toks, bias_values=bias_vals)

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> tuple[list, SamplerOutput | None, PromptLogprobRows | None]:
        """Run one step; returns the requests that sampled a token (in row order), the sampler's output, and the
        prompt logprobs this step computed (None if none)."""
        with record_function("pagellm.prepare_inputs"):
            input_ids, positions, meta, logits_indices, sampling_reqs, plp = self._prepare(so)
            m = self._sampling_metadata(sampling_reqs) if sampling_reqs else None
        with record_function("pagellm.forward"):
            # a plain greedy batch may get its tokens from the LM head's kernel directly (no logits)
            out = self.model(input_ids, positions, self.kv_caches, meta, logits_indices,
                             argmax=m is not None and plp is None and self.sampler.argmax_only(m))
        prompt_lp = None
        if plp is not None:
            with record_function("pagellm.prompt_logprobs"):
                prompt_lp = self._prompt_logprobs(out[len(sampling_reqs):], *plp)
            out = out[:len(sampling_reqs)]
        if not sampling_reqs:
            return [], None, prompt_lp
        if out.dtype == torch.int64:
            return sampling_reqs, SamplerOutput(out, None, None, None, None), prompt_lp
        with record_function("pagellm.sample"):
            return sampling_reqs, self.sampler(out, m), prompt_lp

    def _prompt_logprobs(self, logits: torch.Tensor, spans: list, targets: torch.Tensor) -> PromptLogprobRows:
        k = max(r.sampling_params.prompt_logprobs for r, _ in spans)
        parts = [self.sampler.logprobs(logits[i:i + PROMPT_LOGPROB_ROWS].float(), targets[i:i + PROMPT_LOGPROB_ROWS],
                                       k) for i in range(0, len(targets), PROMPT_LOGPROB_ROWS)]
        cat = lambda xs: None if xs[0] is None else torch.cat(xs)  # noqa: E731
        return PromptLogprobRows(spans, SamplerOutput(*(cat([getattr(p, f) for p in parts]) for f in (
            "sampled", "logprob", "rank", "top_ids", "top_logprobs"))))


def _prompt_logprob_rows(sched, asking: list[int], cu: np.ndarray) -> tuple[list, np.ndarray, list[int]]:
    """The step's rows whose logits give prompt logprobs: of the requests that ask for them (``asking``: their
    indices in ``sched``), the positions p < prompt length - 1 (each predicts prompt token p + 1) whose entry they
    lack (a recompute after a preemption has some). Returns (request, row count) spans, the rows, and the tokens
    they predict."""
    spans, rows, targets = [], [], []
    for i in asking:
        s = sched[i]
        r = s.request
        if r.prompt_logprobs_pending and s.start <= len(r.prompt_logprobs) - 1:
            lo, hi = len(r.prompt_logprobs) - 1, min(s.start + s.num_tokens, r.num_prompt_tokens - 1)
            if lo < hi:
                spans.append((r, hi - lo))
                rows.append(np.arange(cu[i] + lo - s.start, cu[i] + hi - s.start))
                targets += r.prompt_token_ids[lo + 1:hi + 1]
    return spans, np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64), targets


def _raw(cache: torch.Tensor | None) -> torch.Tensor | None:
    """An fp8 cache as bytes (torch has no index_copy_ for fp8 types); others as they are."""
    return cache.view(torch.uint8) if cache is not None and cache.element_size() == 1 else cache


def _pad(rows: list[list[int]], device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    out = np.full((len(rows), width), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return torch.from_numpy(out).to(device)
