"""Iteration-level scheduler: one token budget per step, decodes first, prompts chunked, recompute preemption.

Each step every scheduled request closes part of its gap ``num_tokens - num_computed_tokens``:

    running (admission order):  r0 [gap 1]  r1 [gap 700, prefilling]  r2 [gap 1]     budget 512
    -> r0: 1, r1: 509 (a chunk; r1 samples nothing this step), r2: 1   (with a token-only budget; see below)
    waiting (FCFS): admitted only while budget, max_num_seqs and free blocks allow.

Decodes come first: a prefill chunk gets only what the running decodes behind it leave (r1 above keeps r2's
token), so a long prompt does not stall the requests already generating as long as the budget exceeds their
number; a younger prefill may get nothing in a step. The oldest running request always gets at least one token,
so it cannot starve. (With a token-only budget a prefilling request is always the youngest running one, as a
partial chunk uses up the budget; the attention-aware budget leaves fractions of a chunk's cost over, which admit
requests behind a long prompt, and this rule keeps them generating.)

Attention-aware budget (``attention_keys_per_token`` = A): a prefill chunk's attention grows with the context it
attends to: 2,048 tokens after 4,096 of a 7,000-token prompt cost twice a fresh 2,048-token prompt (its
attention 1.7 times its linears), in the step every generating request waits for. So a chunk of n tokens after c computed ones counts
``n + (n c + n (n + 1) / 2) / A`` against the budget: each token its linear layers plus its keys' attention, A
keys costing as much as one token's linears (the model's FLOPs ratio: 3,072 for SmolLM2-135M). The chunk is the
longest that fits; fresh short prompts are barely affected, deep chunks shrink so that a step costs about the
same whatever the context. A single token counts one, a decode or a chunk of one: the floor that keeps every
request moving (a decode's attention is a memory-bound read; a one-token chunk only costs more than the whole
budget after budget x A tokens of context, 6.3M at the defaults). Layers with a sliding window of W keys count
at most W keys a token (``attention_windows``: each layer's window, None for full attention).

When the pool runs dry, the most recently admitted running request is preempted by recomputation: its blocks
are freed, its computed count reset, and it goes back to the *front* of the waiting queue. The oldest running
request is scheduled first and is never the victim while a younger one exists, so it cannot starve, and since
every admitted request fits in the pool on its own, the oldest can always make progress.

Blocks held outside the running requests: a finished ``keep_kv`` request's (``kept``, for forks:
LLMEngine.fork_request), and a fork's while it waits. They give way under pressure: when a running request could
only go on by preempting itself, or nothing runs and the head of the queue does not fit, the oldest kept
request's blocks are freed first, then the newest waiting fork's, one at a time until the request fits. A fork
whose blocks went, or made from a kept request whose blocks went, computes its tokens again.

Followers (parallel sampling: n > 1, best_of, and the server's choices): a request added with a ``lead``, a
request with the same prompt that has not sampled yet, waits outside the queue until the lead has computed the
prompt (it has sampled, or it ends; added after the lead has sampled, it does not wait). It then forks the lead's
blocks, all but its last prompt token's, and joins the queue in arrival order: it computes one token (for its own
logits) where it would compute its prompt, and holds only its own copy of the last, partial block (copied on
write) where it would hold the whole prompt's. Under pressure a waiting fork that is a block's last holder gives
its blocks back before one whose blocks are all held by others too (a follower's, beside its running lead).
"""
from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Sequence
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
    # Copy-on-write: device block copies (source, destination), from this step's admissions of forks.
    copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def total_num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def _keys(n: int, context: int, window: int | None) -> float:
    """Keys that n tokens after ``context`` computed ones attend to in all: token i sees context + i + 1 of
    them, at most ``window``."""
    if window is None or context + n <= window:
        return n * context + n * (n + 1) / 2
    m = min(max(window - context, 0), n)  # tokens that still see the whole context
    return m * context + m * (m + 1) / 2 + (n - m) * window


class Scheduler:
    def __init__(self, kv_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, attention_keys_per_token: float | None = None,
                 attention_windows: Sequence[int | None] = ()) -> None:
        """``attention_keys_per_token``: A in the module docstring, or None to count every token as one (it
        only applies with chunked prefill: without it a prompt runs whole). ``attention_windows``: each layer's
        sliding window (None: full attention; empty: all full)."""
        if attention_keys_per_token is not None and not attention_keys_per_token > 0:
            raise ValueError(f"attention_keys_per_token must be > 0, got {attention_keys_per_token!r}")
        if any(w is not None and (not isinstance(w, int) or w < 1) for w in attention_windows):
            raise ValueError(f"attention_windows must hold None or integers >= 1, got {list(attention_windows)!r}")
        self.kv = kv_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.attention_keys_per_token = attention_keys_per_token if enable_chunked_prefill else None
        # the layers' share per window (None: full); the attention part of a cost is their weighted mean
        counts = Counter(attention_windows or [None])
        self._windows = [(w, k / sum(counts.values())) for w, k in counts.items()]
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()  # swapped out, oldest first; they come back before new requests
        self.kept: dict[str, Request] = {}  # finished keep_kv requests, oldest first, until release()
        self.followers: dict[Request, list[Request]] = {}  # lead -> requests waiting for its prompt's K/V
        self._lead_of: dict[Request, Request] = {}
        self.num_preemptions = 0
        self.num_swaps_out = 0

    def cost(self, n: int, context: int) -> float:
        """Budget taken by computing n tokens after ``context`` computed ones (n without attention awareness;
        one token always counts one)."""
        a = self.attention_keys_per_token
        if a is None or n <= 1:
            return float(n)
        return n + sum(share * _keys(n, context, w) for w, share in self._windows) / a

    def fit(self, gap: int, context: int, budget: float) -> int:
        """The most of ``gap`` tokens after ``context`` computed ones whose cost fits ``budget`` (0 if none: a
        budget under one token, or no gap)."""
        if budget < 1 or gap < 1:
            return 0
        a = self.attention_keys_per_token
        if a is None or gap == 1:
            return min(gap, int(budget))
        # full attention: n^2 / 2A + n (1 + (c + 1/2) / A) <= budget, solved for n (a lower bound with windows,
        # which only lower the cost), then made exact against cost(), by bisection when windows make it longer
        p = 1 + (context + 0.5) / a
        n = min(gap, int(2 * budget / (p + math.sqrt(p * p + 2 * budget / a))))
        if any(w is not None for w, _ in self._windows):
            lo, hi = max(n, 1), gap  # the last n in [lo, gap] that fits (the loops below settle the ends)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if self.cost(mid, context) <= budget else (lo, mid - 1)
            n = lo
        while n < gap and self.cost(n + 1, context) <= budget:
            n += 1
        while n > 1 and self.cost(n, context) > budget:
            n -= 1
        return max(n, 1)  # budget >= 1 pays for one token (cost(1) == 1)

    def add_request(self, request: Request, lead: Request | None = None) -> None:
        """Queue a request (between steps). ``lead``: an unfinished request whose prompt and cache salt are this
        one's (the caller checks); this one follows it (module docstring), at once if the lead has sampled."""
        request.status = RequestStatus.WAITING
        if lead is not None and not lead.is_finished:
            if not lead.num_output_tokens:
                self.followers.setdefault(lead, []).append(request)
                self._lead_of[request] = lead
                return
            self._share_prompt(lead, request)
        self.waiting.append(request)

    def _share_prompt(self, lead: Request, request: Request) -> None:
        """Fork what ``lead``'s device blocks hold of ``request``'s prompt, but its last token."""
        n = min(lead.num_computed_tokens, request.num_prompt_tokens - 1)
        if lead.blocks and n > 0 and not request.blocks:
            self.kv.fork(lead, request, n)
            request.num_cached_prompt_tokens = n

    def _release_followers(self, lead: Request) -> None:
        """The lead has sampled or ends: its followers take what it computed and join the queue, in arrival
        order (behind the preempted requests that arrived before them, ahead of those that came after)."""
        for req in self.followers.pop(lead):
            del self._lead_of[req]
            self._share_prompt(lead, req)
            i = next((i for i, w in enumerate(self.waiting) if w.arrival_time > req.arrival_time), len(self.waiting))
            self.waiting.insert(i, req)

    @property
    def num_waiting(self) -> int:
        """Requests not yet admitted: the queue and the followers still waiting for their lead."""
        return len(self.waiting) + len(self._lead_of)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.followers)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.followers:  # leads that sampled in the last step: their prompts' K/V are in their blocks now
            for lead in [lead for lead in self.followers if lead.num_output_tokens]:
                self._release_followers(lead)
        budget = float(self.max_num_batched_tokens)

        # 1. Running requests, oldest first: a decode takes one token, a prefill chunk what fits after keeping one
        # token for each decode behind it; the oldest always gets at least one.
        decodes_left = sum(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
        i = 0
        while i < len(self.running) and budget >= 1:
            req = self.running[i]
            gap, start = req.num_tokens - req.num_computed_tokens, req.num_computed_tokens
            if gap == 1:
                decodes_left -= 1
                n = 1
            else:
                n = self.fit(gap, start, budget - decodes_left) or (1 if i == 0 else 0)
                if n == 0:
                    i += 1
                    continue
            while not self.kv.allocate_slots(req, n):
                if self.running[-1] is req and self._reclaim():
                    continue  # rather than preempt itself
                victim = self.running.pop()  # the youngest: not visited yet, or req itself
                was_decode = victim.num_tokens - victim.num_computed_tokens == 1  # (recompute resets the count)
                self._preempt(victim, out)
                out.preempted.append(victim)
                if victim is req:
                    break
                decodes_left -= was_decode
            else:
                out.scheduled.append(ScheduledRequest(req, start, n))
                budget -= self.cost(n, start)
                i += 1
                continue
            break  # req preempted itself: it was the last running request

        # 2. Swapped-out requests come back first (oldest first), unless this step had to preempt.
        while self.swapped and budget >= 1 and len(self.running) < self.max_num_seqs and not out.preempted:
            req = self.swapped[0]
            n = self.fit(req.num_tokens - req.num_computed_tokens, req.num_computed_tokens, budget)
            if not self.kv.can_swap_in(req, n):
                if not self.running and self._reclaim():
                    continue
                break
            self.swapped.popleft()
            out.swap_in.extend(self.kv.swap_in(req, n))
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, req.num_computed_tokens, n))
            budget -= self.cost(n, req.num_computed_tokens)

        # 3. Waiting requests, FCFS, unless this step preempted or swapped requests still wait.
        while (self.waiting and not self.swapped and budget >= 1 and len(self.running) < self.max_num_seqs
               and not out.preempted):
            req = self.waiting[0]
            computed = self.kv.get_computed_blocks(req)
            start = req.num_computed_tokens + len(computed) * self.kv.block_size
            n = req.num_tokens - start
            if n > budget and not self.enable_chunked_prefill:
                break
            n = self.fit(n, start, budget)
            if not self.kv.allocate_slots(req, n, computed):
                if not self.running and self._reclaim(but=req):
                    continue  # (looked up again: the reclaimed blocks may have been among the cache hits)
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, start, n))
            budget -= self.cost(n, start)

        out.copies = self.kv.take_copies()
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_tokens
            if s.start < s.request.num_prompt_tokens:
                s.request.num_prefill_chunks += 1
        return out

    def _reclaim(self, but: Request | None = None) -> bool:
        """Free the blocks of the oldest kept request that holds any, else of the newest waiting request that holds
        any (a fork not yet admitted) other than ``but``, which will compute its tokens again; among those, first
        one that is the last holder of a block (a follower's blocks are mostly still its running lead's: freeing
        them gives nothing back). False if none."""
        for req in self.kept.values():
            if req.blocks:
                self.kv.free(req)
                req.num_computed_tokens = 0
                return True
        holders = [r for r in reversed(self.waiting) if r.blocks and r is not but]
        if not holders:
            return False
        req = min(holders, key=lambda r: all(b.ref_cnt > 1 for b in r.blocks))  # (the newest such)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        return True

    def release(self, request_id: str) -> bool:
        """Free a kept request's blocks (those the pool has not taken back) and forget it; False if not kept."""
        req = self.kept.pop(request_id, None)
        if req is not None:
            self.kv.free(req)
        return req is not None

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
        if req in self.followers:  # (before its blocks go: they hold what it computed of its followers' prompt)
            self._release_followers(req)
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.SWAPPED:
            self.swapped.remove(req)
            self.kv.free_host(req)
        elif req in self._lead_of:
            lead = self._lead_of.pop(req)
            self.followers[lead].remove(req)
            if not self.followers[lead]:
                del self.followers[lead]
        elif not req.is_finished:
            self.waiting.remove(req)
        req.status = status
        if req.keep_kv and status != RequestStatus.FINISHED_ABORTED:
            self.kept[req.request_id] = req  # its blocks stay, for forks, until release() or the pool needs them
        else:
            self.kv.free(req)
