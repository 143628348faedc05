"""LLMEngine: add_request / step / abort.

One step is: scheduler.schedule() -> model_runner.execute() -> update requests (append tokens, detokenize,
check stops) -> scheduler.finish_request() for those that ended. Data flows one way; the scheduler never sees
logits and the runner never decides who runs.
"""
from __future__ import annotations

import ctypes
import gc
import itertools
import logging
import operator
import threading
import time
from dataclasses import dataclass

import psutil
import torch
from torch.profiler import record_function

from pagellm.config import EngineConfig, default_kv_cache_memory, default_num_threads
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.scheduler import Scheduler
from pagellm.engine.detokenizer import IncrementalDetokenizer
from pagellm.engine.parallel_sampling import ParentRequest, child_params, merge_children
from pagellm.engine.request import Request, RequestStatus
from pagellm.model_executor.layers.attention import preload_cpu_ops, select_backend
from pagellm.model_executor.loader import checkpoint_dtype_of, load_checkpoint
from pagellm.model_executor.model_runner import ModelRunner, kv_bytes_per_block
from pagellm.model_executor.models import build_model
from pagellm.model_executor.models.llama import ModelShape
from pagellm.model_executor.sampler import SamplerOutput
from pagellm.outputs import CompletionOutput, Logprob, RequestOutput
from pagellm.sampling_params import SamplingParams

logger = logging.getLogger("pagellm")


@dataclass
class EngineStats:
    """Counters for metrics and benchmarks."""

    num_blocks: int
    block_size: int
    kv_cache_bytes: int
    num_used_blocks: int = 0
    num_preemptions: int = 0
    num_swaps_out: int = 0
    prompt_tokens_computed: int = 0
    generation_tokens: int = 0
    num_steps: int = 0
    peak_used_blocks: int = 0
    kv_slot_efficiency_at_peak: float = 1.0


def _return_freed_heap() -> None:
    """Hands the heap's free pages back to the OS (glibc's malloc_trim; elsewhere nothing). Why: the checkpoint's
    tensors, freed once the model holds its own forms of them, were served from the heap (glibc's mmap threshold
    adapts up to 32 MiB) below the forms made after them, so the heap cannot shrink past them and they stay
    resident: ~290 MB for the default model (docs/performance-log.md)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        torch.set_num_threads(config.num_threads or default_num_threads())
        t0 = time.perf_counter()
        dev = config.torch_device
        dtype_hint = None if config.dtype == "auto" else config.dtype
        # a GGUF's layer linears in their blocks alone: the model makes a bf16 weight only where a kernel reads it;
        # the blocks unpacked by the C++ kernels where the engine takes them
        cpu_ops = preload_cpu_ops(config.attention_backend, dev)
        ckpt = load_checkpoint(config.model, dtype_hint, defer_quantized=config.gguf_quantized_linears,
                               cpu_ops=cpu_ops)
        cfg = ckpt.hf_config
        config.finalize(checkpoint_dtype_of(ckpt), cfg.max_position_embeddings)
        if ckpt.dtype != config.torch_dtype:
            ckpt.weights = {k: v.to(config.torch_dtype) for k, v in ckpt.weights.items()}
        self.hf_config = cfg
        self.tokenizer = ckpt.tokenizer
        self._token_text: dict[int, str] = {}  # one token decoded alone, for logprobs (decode once per id)
        shape = ModelShape(cfg, ckpt.architecture)
        # (where the kernels could not be built, the torch backend without a second attempt)
        backend = select_backend("torch" if cpu_ops is None and dev.type == "cpu" else config.attention_backend, dev,
                                 shape.num_kv_heads, shape.head_dim, config.block_size, config.torch_kv_dtype)
        self.model = build_model(cfg, ckpt.architecture, ckpt.weights, config.torch_dtype, dev, backend,
                                 config.max_model_len, config.reduced_precision_reduction,
                                 ckpt.quantized if config.gguf_quantized_linears else None,
                                 config.gguf_int8_activations)
        del ckpt
        _return_freed_heap()  # before the KV cache's first pages are mapped: the high-water mark is set there
        self.vocab_size = self.model.shape.vocab_size
        # (an id past the logits, which no step can sample, would break min_tokens' mask)
        self.eos_token_ids = {t for t in _eos_token_ids(cfg, self.tokenizer) if 0 <= t < self.vocab_size}

        per_block = kv_bytes_per_block(self.model.shape, config.block_size, config.torch_kv_dtype)
        budget = config.kv_cache_memory or default_kv_cache_memory(
            dev, config.gpu_memory_utilization, torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={budget} bytes holds no KV block ({per_block} bytes each at "
                             f"block_size={config.block_size}); give at least {per_block}")
        num_host_blocks = config.swap_space // per_block if config.preemption_mode == "swap" else 0
        self.kv_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                         num_host_blocks)
        self.scheduler = Scheduler(self.kv_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill,
                                   shape.attention_keys_per_token() if config.attention_aware_budget else None,
                                   shape.sliding_windows)
        self.runner = ModelRunner(self.model, num_blocks, config.block_size, config.torch_kv_dtype, dev,
                                  num_host_blocks, config.kv_cache_prefault)
        self.choose_int8_outliers()
        self.stats = EngineStats(num_blocks, config.block_size, self.runner.kv_cache_bytes)
        self.requests: dict[str, Request] = {}
        self.parents: dict[str, ParentRequest] = {}  # n > 1 / best_of: parent id -> its children
        self.parent_of: dict[str, str] = {}
        self._ids = itertools.count()
        self._prefault_stopped = False
        self._built_on = threading.get_ident() if dev.type == "cpu" else None  # see step()
        torch.manual_seed(config.seed)
        # The model, tokenizer and imported libraries are hundreds of thousands of long-lived objects: move them
        # out of the collector's reach, so the collections that a step's many small allocations trigger only
        # walk what was made since (as vLLM does after start-up).
        gc.collect()
        gc.freeze()
        logger.info("engine ready in %.1fs: %s %s, %d KV blocks x %d tokens (%.0f MiB%s), max_model_len %d",
                    time.perf_counter() - t0, ckpt_arch(cfg), config.torch_dtype, num_blocks, config.block_size,
                    self.runner.kv_cache_bytes / 2**20,
                    "" if config.kv_cache_dtype == "auto" else f" of {config.torch_kv_dtype}", config.max_model_len)

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | None = None, sampling_params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None, request_id: str | None = None,
                    cache_salt: str | None = None, keep_kv: bool = False,
                    share_prompt_with: str | None = None) -> str:
        """Validate and queue a request; raise ValueError (engine untouched) if it can never run. ``keep_kv``: when
        it finishes (not when aborted), its blocks stay, for ``fork_request``, until ``release_kv`` or until the
        pool needs them (Scheduler: they give way before a running request is preempted). ``share_prompt_with``: the
        id of a request with the same prompt (another sample of it, as the server's choices are): if it is
        unfinished, with the same cache salt, this one takes the K/V it computes for the prompt (Scheduler:
        followers) rather than computing them; otherwise this one runs on its own."""
        params = sampling_params or SamplingParams()
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("prompt: give a string or prompt_token_ids")
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; give prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        return self._queue(prompt, _token_ids(prompt_token_ids), params, request_id, cache_salt, keep_kv,
                           lead=share_prompt_with)

    def _queue(self, prompt, prompt_token_ids, params, request_id, cache_salt, keep_kv, checked: int = 0,
               lead: str | None = None) -> str:
        """add_request past tokenizing; the first ``checked`` tokens are known ids of the vocabulary (a fork's)."""
        self._validate(prompt_token_ids, params, checked)
        request_id = request_id if request_id is not None else str(next(self._ids))
        fan_out = max(params.n, params.best_of or 1)
        if keep_kv and fan_out > 1:
            raise ValueError(f"keep_kv: a request with n={params.n}, best_of={params.best_of} cannot keep its K/V")
        # the ids this request takes: its own, and with n > 1 its children's (which must not be a caller's either)
        children = [f"{request_id}#{i}" for i in range(fan_out)] if fan_out > 1 else []
        for rid in [request_id, *children]:
            if rid in self.requests or rid in self.parents or rid in self.parent_of or rid in self.scheduler.kept:
                raise ValueError(f"request_id {request_id!r} is already in use" if rid == request_id else
                                 f"request_id {request_id!r}: its choice {rid!r} is already a request's id")
        if children:
            kids = [child_params(params, i) for i in range(fan_out)]  # (validated with params: cannot fail)
            self.parents[request_id] = ParentRequest(request_id, params, children)
            for i, (cid, kid) in enumerate(zip(children, kids)):  # the first computes the prompt for all
                self._add(prompt, prompt_token_ids, kid, cid, cache_salt, lead=children[0] if i else lead)
                self.parent_of[cid] = request_id
            return request_id
        return self._add(prompt, prompt_token_ids, params, request_id, cache_salt, keep_kv, lead)

    def fork_request(self, parent_id: str, token_ids: list[int], sampling_params: SamplingParams,
                     request_id: str | None = None, keep_kv: bool = False) -> str:
        """A request that continues a finished ``keep_kv`` request: its prompt is the parent's tokens but its last
        output token (those whose K/V the parent computed), then ``token_ids``. It shares the parent's blocks, so
        only ``token_ids`` are computed (all of its tokens if the pool took the parent's blocks back): beam search
        extends each beam this way. One sequence, without prompt logprobs (its head is not computed); the parent's
        output is the fork's prompt (presence and frequency penalties count only what the fork generates)."""
        parent = self.scheduler.kept.get(parent_id)
        if parent is None:
            raise ValueError(f"parent_id {parent_id!r} is not a finished request that keeps its K/V")
        suffix = _token_ids(token_ids)
        if not suffix:
            raise ValueError("token_ids must not be empty (the fork computes them)")
        if sampling_params.n > 1 or (sampling_params.best_of or 1) > 1 or sampling_params.prompt_logprobs is not None:
            raise ValueError(f"fork_request: n={sampling_params.n}, best_of={sampling_params.best_of}, "
                             f"prompt_logprobs={sampling_params.prompt_logprobs}: a fork is one sequence, without "
                             f"prompt logprobs")
        head = parent.token_at(0, parent.num_tokens - 1)
        rid = self._queue(None, head + suffix, sampling_params, request_id, parent.cache_salt, keep_kv, len(head))
        if parent.blocks:
            self.kv_manager.fork(parent, self.requests[rid])
        return rid

    def release_kv(self, request_id: str) -> bool:
        """Free the blocks of a finished ``keep_kv`` request and forget it; False if it is not kept."""
        return self.scheduler.release(request_id)

    def _add(self, prompt, prompt_token_ids, params, request_id, cache_salt, keep_kv=False,
             lead: str | None = None) -> str:
        max_model_len = self.config.max_model_len
        max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - len(prompt_token_ids)
        params.all_stop_token_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        req = Request(request_id, prompt, prompt_token_ids, params, max_tokens, cache_salt=cache_salt,
                      keep_kv=keep_kv)
        if params.seed is not None:
            req.generator = torch.Generator(device=self.config.torch_device).manual_seed(params.seed)
        if self.tokenizer is not None:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens,
                                                     params.stop, params.include_stop_str_in_output)
        self.requests[request_id] = req
        self.scheduler.add_request(req, self._lead(lead, req))
        return request_id

    def _lead(self, lead_id: str | None, req: Request) -> Request | None:
        """The request whose prompt K/V ``req`` can take (share_prompt_with), or None."""
        lead = self.requests.get(lead_id) if lead_id is not None else None
        if (lead is None or lead is req or lead.is_finished or lead.cache_salt != req.cache_salt
                or req.sampling_params.prompt_logprobs is not None  # (its prompt's logits are computed)
                or lead.prompt_token_ids != req.prompt_token_ids):
            return None
        return lead

    def _validate(self, ids: list[int], params: SamplingParams, checked: int = 0) -> None:
        if not ids:
            raise ValueError("prompt must not be empty (it has 0 tokens)")
        bad = [t for t in ids[checked:] if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids: token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})")
        for name, tokens in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ())):
            if bad := [t for t in tokens if t >= self.vocab_size]:
                raise ValueError(f"{name}: token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})")
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt has {len(ids)} tokens, but max_model_len is {limit}: the prompt plus at least "
                             f"one generated token must fit")
        if params.max_tokens is not None and len(ids) + params.max_tokens > limit:
            raise ValueError(f"max_tokens={params.max_tokens} plus the prompt's {len(ids)} tokens exceeds "
                             f"max_model_len={limit}")
        total = len(ids) + (params.max_tokens if params.max_tokens is not None else limit - len(ids))
        need = self.kv_manager.blocks_needed(total)
        if need > self.kv_manager.num_blocks:
            raise ValueError(f"the request needs up to {need} KV blocks ({total} tokens) but the whole KV cache has "
                             f"{self.kv_manager.num_blocks}; lower max_tokens or raise kv_cache_memory")

    def forward_prompt(self, tokens: list[int], first: int) -> torch.Tensor:
        """The logits that predict tokens[first:] from one prefill of ``tokens`` alone, outside the step loop, in
        blocks borrowed from the pool and returned (ModelRunner.forward_prompt)."""
        blocks = self.kv_manager.pool.allocate(-(-len(tokens) // self.config.block_size))
        try:
            return self.runner.forward_prompt(tokens, [b.block_id for b in blocks], first)
        finally:
            self.kv_manager.pool.free(blocks)

    def choose_int8_outliers(self) -> None:
        """The int8 linears (gguf_int8_activations: GGUF weights, past GEMV_MAX_ROWS rows on CPUs with
        AVX512-VNNI but no AMX, up to it on CPUs with AVX512-VNNI or AVX2) keep a few input channels per weight out
        of x's int8 values, chosen on each kernel's first call. Make those calls a fixed prompt's, now: every engine
        of a model then takes the same channels, whatever its first requests (a prompt prefilled in chunks or
        whole, alone or in a batch, gets the same numbers)."""
        from pagellm.model_executor.layers.linear import GEMV_MAX_ROWS, CPULinear

        lins = [m for m in self.model.modules() if isinstance(m, CPULinear)]
        many = any(m.vnni_int8 is not None for m in lins)
        few = any(f is not None for m in lins for f in m.gguf_int8)
        n = min(64, self.config.max_model_len, self.kv_manager.pool.num_free_blocks * self.config.block_size)
        if not (many or few) or n < 2:
            return
        tokens = [(i * 7919 + 11) % 32000 % self.vocab_size for i in range(n)]  # ids spread over the vocabulary
        if self.tokenizer is not None:
            tokens = (self.tokenizer.encode(_CALIBRATION_TEXT) + tokens)[:n]
        # both prompts in the same borrowed blocks: the pool's free queue hands out unused blocks first, so another
        # block would map more of a cache left unmapped (kv_cache_prefault)
        blocks = self.kv_manager.pool.allocate(-(-n // self.config.block_size))
        try:
            ids = [b.block_id for b in blocks]
            if many:  # logits for every row, so the last layer's linears run on all of them
                self.runner.forward_prompt(tokens, ids, 1)
            if few:  # every linear at most GEMV_MAX_ROWS rows: the few-row kernel's
                self.runner.forward_prompt(tokens[:min(GEMV_MAX_ROWS, n)], ids, 1)
        finally:
            self.kv_manager.pool.free(blocks)

    def abort_request(self, request_id: str) -> bool:
        """Abort a request (all its choices for n > 1; a choice's own id aborts them all too, since the request's
        output needs every one). False if it is unknown or has finished."""
        parent = self.parents.pop(self.parent_of.get(request_id, request_id), None)
        if parent is not None:
            aborted = [self._abort_one(c) for c in parent.child_ids]
            for c in parent.child_ids:
                self.parent_of.pop(c, None)
            return any(aborted)
        return self._abort_one(request_id)

    def _abort_one(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None or req.is_finished:
            return False
        self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
        return True

    def reset_stats(self) -> None:
        """Start counters afresh (benchmarks call this after warm-up)."""
        self.stats = EngineStats(self.stats.num_blocks, self.stats.block_size, self.stats.kv_cache_bytes)
        self.scheduler.num_preemptions = self.scheduler.num_swaps_out = 0
        self.kv_manager.prefix_queries = self.kv_manager.prefix_hits = self.kv_manager.num_copies = 0

    def prefault_kv_cache(self, max_bytes: int) -> bool:
        """Map up to max_bytes more of the KV cache's never-used blocks (CPU: the pool's blocks past
        kv_cache_prefault are mapped by the OS on their first write, inside a step, where each page fault holds up
        every thread); for idle time, as the server's loop does. Stops, for good, while less than twice max_bytes
        of memory is available. Returns True while blocks are left to map."""
        runner, total = self.runner, self.kv_manager.num_blocks
        if self._prefault_stopped or runner.mapped_blocks >= total:
            return False
        if psutil.virtual_memory().available < 2 * max_bytes:
            logger.info("KV cache: %d of %d blocks mapped; the rest are left to map on first use (low memory)",
                        runner.mapped_blocks, total)
            self._prefault_stopped = True
            return False
        runner.prefault_blocks(self.kv_manager.pool.first_unused, max(1, max_bytes // runner.bytes_per_block))
        if runner.mapped_blocks < total:
            return True
        logger.info("KV cache: all %d blocks mapped (%.0f MiB)", total, runner.kv_cache_bytes / 2**20)
        return False

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return an output for each request that got a token or finished."""
        if self._built_on is not None and threading.get_ident() != self._built_on:
            # Both threads then own an OpenMP worker pool: over the CPU count, libgomp sleeps between parallel
            # regions (workload_64: ~20% slower on 2 cores; AsyncLLMEngine builds its engine on its loop thread).
            logger.warning("this engine is stepped on another thread than the one that built it: OpenMP's workers "
                           "then sleep between kernels (~20%% slower steps on CPU); build and step it on one thread")
            self._built_on = None
        with record_function("pagellm.schedule"):
            so = self.scheduler.schedule()
        self.stats.num_preemptions = self.scheduler.num_preemptions
        self.stats.num_swaps_out = self.scheduler.num_swaps_out
        if so.swap_out or so.swap_in or so.copies:
            self.runner.copy_blocks(so)
        if so.is_empty:
            return []
        self._record_kv_usage()
        for s in so.scheduled:
            self.stats.prompt_tokens_computed += max(0, min(s.request.num_prompt_tokens - s.start, s.num_tokens))
        reqs, sampled, prompt_lp = self.runner.execute(so)
        self.stats.num_steps += 1
        with record_function("pagellm.update_detokenize"):
            if prompt_lp is not None:
                self._record_prompt_logprobs(prompt_lp)
            outputs = self._update(reqs, sampled) if reqs else []
        self.stats.num_used_blocks = self.kv_manager.pool.num_used_blocks
        return merge_children(outputs, self.parents, self.parent_of) if self.parent_of else outputs

    def _record_kv_usage(self) -> None:
        """Track the peak of used blocks and, at that peak, the share of allocated slots holding live tokens.
        Empty slots are only ever at the tail of a request's last block (shared blocks are full, but for a fork's
        partial block, counted once per holder)."""
        used = self.kv_manager.pool.num_used_blocks
        self.stats.num_used_blocks = used
        if used > self.stats.peak_used_blocks:
            bs = self.kv_manager.block_size
            empty = sum(len(r.blocks) * bs - r.num_computed_tokens for r in self.scheduler.running)
            self.stats.peak_used_blocks = used
            self.stats.kv_slot_efficiency_at_peak = 1.0 - empty / (used * bs)

    def _update(self, reqs: list[Request], out: SamplerOutput) -> list[RequestOutput]:
        tokens = out.sampled.tolist()
        lp = out.logprob.tolist() if out.logprob is not None else None
        ranks = out.rank.tolist() if out.rank is not None else None
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        now = time.monotonic()
        outputs = []
        for i, (req, tok) in enumerate(zip(reqs, tokens)):
            if req.is_finished:  # aborted between schedule and update (async engine)
                continue
            req.output_token_ids.append(tok)
            self.stats.generation_tokens += 1
            if req.first_token_time is None:
                req.first_token_time = now
            if lp is not None:
                req.cumulative_logprob += lp[i]
                if req.logprobs is not None:
                    req.logprobs.append(self._logprob_entry(req.sampling_params.logprobs, tok, lp[i], ranks[i],
                                                            top_ids[i] if top_ids else [], top_lp[i] if top_lp else []))
            status = self._check_stop(req, tok)
            if status is not None:
                self.scheduler.finish_request(req, status)
            outputs.append(self.make_output(req))
            if req.is_finished:
                del self.requests[req.request_id]
        return outputs

    def _check_stop(self, req: Request, tok: int) -> RequestStatus | None:
        params = req.sampling_params
        past_min = req.num_output_tokens >= params.min_tokens
        if past_min and tok in params.all_stop_token_ids:
            req.stop_reason = tok if tok in params.stop_token_ids else None
            return RequestStatus.FINISHED_STOPPED
        if req.detokenizer is not None:
            hit = req.detokenizer.step(tok, check_stop=past_min)
            if hit is not None:
                req.stop_reason = hit
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _record_prompt_logprobs(self, rows) -> None:
        """Append each request's new prompt-token entries (ModelRunner's PromptLogprobRows, spans in row order)."""
        out = rows.lp
        tokens, lp, ranks = out.sampled.tolist(), out.logprob.tolist(), out.rank.tolist()
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        i = 0
        for req, n in rows.spans:
            k = req.sampling_params.prompt_logprobs
            for j in range(i, i + n):
                req.prompt_logprobs.append(self._logprob_entry(k, tokens[j], lp[j], ranks[j],
                                                               top_ids[j] if top_ids else [],
                                                               top_lp[j] if top_lp else []))
            i += n

    def _logprob_entry(self, k, tok, lp, rank, top_ids, top_lp) -> dict[int, Logprob]:
        """The chosen token first, then the top k (rank = position in the top-k)."""
        entry = {tok: Logprob(lp, rank, self._decode_one(tok))}
        for r, (t, v) in enumerate(zip(top_ids[:k], top_lp[:k]), start=1):
            entry.setdefault(t, Logprob(v, r, self._decode_one(t)))
        return entry

    def _decode_one(self, tok: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._token_text.get(tok)
        if text is None:
            text = self._token_text[tok] = self.tokenizer.decode([tok])
        return text

    def make_output(self, req: Request) -> RequestOutput:
        detok = req.detokenizer
        comp = CompletionOutput(index=0, text=detok.text if detok is not None else "",
                                token_ids=list(req.output_token_ids),
                                cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
                                logprobs=req.logprobs, finish_reason=req.finish_reason, stop_reason=req.stop_reason)
        metrics = {"arrival_time": req.arrival_time, "num_preemptions": req.num_preemptions,
                   "num_prefill_chunks": req.num_prefill_chunks,
                   "num_cached_tokens": req.num_cached_prompt_tokens}
        if req.first_token_time is not None:
            metrics["first_token_time"] = req.first_token_time
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [comp], req.is_finished, metrics,
                             req.prompt_logprobs)


# LLMEngine.choose_int8_outliers' prompt: a paragraph of plain English (without a tokenizer, or past its end, token
# ids spread over the vocabulary).
_CALIBRATION_TEXT = ("The library opens at nine in the morning and closes at six. Visitors may borrow up to five "
                     "books at a time, and most loans last three weeks. Ask at the front desk if you need help.")


def _token_ids(ids) -> list[int]:
    """A prompt's token ids as Python ints (NumPy and torch integers too); a ValueError names one that is not."""
    out = []
    for t in ids:
        try:
            out.append(operator.index(t))
        except TypeError:
            raise ValueError(f"prompt_token_ids: token id {t!r} is not an integer") from None
    return out


def _eos_token_ids(hf_config, tokenizer) -> set[int]:
    ids: set[int] = set()
    eos = getattr(hf_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def ckpt_arch(cfg) -> str:
    return (getattr(cfg, "architectures", None) or [cfg.model_type])[0]
