"""Iteration-level scheduler: one token budget per step, decodes first, prompts chunked, recompute preemption.

Each step every scheduled request closes part of its gap ``num_tokens - num_computed_tokens``:

    running (admission order):  r0 [gap 1]  r1 [gap 1]  r2 [gap 700, prefilling]     budget 512
    -> r0: 1, r1: 1, r2: 510 (a chunk; r2 samples nothing this step)
    waiting (FCFS): admitted only while budget, max_num_seqs and free blocks allow.

When the pool runs dry, the most recently admitted running request is preempted by recomputation: its blocks
are freed, its computed count reset, and it goes back to the *front* of the waiting queue. The oldest running
request is scheduled first and is never the victim while a younger one exists, so it cannot starve, and since
every admitted request fits in the pool on its own, the oldest can always make progress.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    start: int  # num_computed_tokens before this step: position of the first token computed now
    num_tokens: int  # tokens computed for this request in this step (the prefill chunk, or 1 to decode)

    @property
    def samples(self) -> bool:
        """Only the step that reaches the end of the request's known tokens produces a new token."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Swap preemption: block copies the runner performs before this step's forward pass.
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)

    @property
    def total_num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, kv_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True) -> None:
        self.kv = kv_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()  # swapped out, oldest first; they come back before new requests
        self.num_preemptions = 0
        self.num_swaps_out = 0

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        # 1. Running requests, oldest first; each gets min(gap, budget).
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim, out)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, req.num_computed_tokens, n))
                budget -= n
                i += 1
                continue
            break  # req preempted itself: it was the last running request

        # 2. Swapped-out requests come back first (oldest first), unless this step had to preempt.
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            req = self.swapped[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.can_swap_in(req, n):
                break
            self.swapped.popleft()
            out.swap_in.extend(self.kv.swap_in(req, n))
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, req.num_computed_tokens, n))
            budget -= n

        # 3. Waiting requests, FCFS, unless this step preempted or swapped requests still wait.
        while self.waiting and not self.swapped and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            req = self.waiting[0]
            computed = self.kv.get_computed_blocks(req)
            n = req.num_tokens - req.num_computed_tokens - len(computed) * self.kv.block_size
            if n > budget and not self.enable_chunked_prefill:
                break
            n = min(n, budget)
            if not self.kv.allocate_slots(req, n, computed):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, req.num_computed_tokens, n))
            budget -= n

        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_tokens
            if s.start < s.request.num_prompt_tokens:
                s.request.num_prefill_chunks += 1
        return out

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Swap the request's KV to host memory when a host pool exists and has room; else recompute later."""
        req.num_preemptions += 1
        self.num_preemptions += 1
        pairs = self.kv.swap_out(req)
        if pairs is not None:
            out.swap_out.extend(pairs)
            req.status = RequestStatus.SWAPPED
            self.num_swaps_out += 1
            self.swapped.appendleft(req)  # victims go newest first, so the oldest ends up in front
            return
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """End a request (stop, length or abort): leave the queues and free its blocks at once."""
        assert status.finished
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.SWAPPED:
            self.swapped.remove(req)
            self.kv.free_host(req)
        elif not req.is_finished:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)
