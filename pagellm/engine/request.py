"""Request: the state of one prompt as it moves through the engine.

A request's tokens are ``prompt_token_ids + output_token_ids``. ``num_computed_tokens`` counts those whose K/V
sit in the cache; each step the scheduler closes part of the gap ``num_tokens - num_computed_tokens``. There is
no prefill or decode phase: a new prompt has a large gap (prefilled in chunks), a running request a gap of one.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from pagellm.core.block_pool import KVCacheBlock
from pagellm.outputs import PromptLogprobs, SampleLogprobs
from pagellm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    SWAPPED = "swapped"  # preempted by swapping: its KV sits in host blocks
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: sampling_params.max_tokens or what is left of max_model_len
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    blocks: list[KVCacheBlock] = field(default_factory=list)
    host_blocks: list[KVCacheBlock] = field(default_factory=list)  # while SWAPPED
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    num_prefill_chunks: int = 0
    # Prefix caching: chained hashes of the request's full blocks (computed lazily), and the salt that keeps
    # tenants apart (requests with different salts never share blocks).
    cache_salt: str | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks already registered in the prefix cache
    num_cached_prompt_tokens: int = 0  # prompt tokens found in the cache at the last admission
    keep_kv: bool = False  # when it ends (but by abort), its blocks stay held for forks (LLMEngine.fork_request)

    # Outputs
    output_text: str = ""
    logprobs: SampleLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None  # filled as the prompt's chunks run
    cumulative_logprob: float = 0.0
    first_token_time: float | None = None
    generator: torch.Generator | None = None  # per-request RNG when sampling_params.seed is set
    detokenizer: object | None = None

    def __post_init__(self) -> None:
        if self.sampling_params.logprobs is not None:
            self.logprobs = []
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def prompt_logprobs_pending(self) -> bool:
        """Asked for prompt logprobs that are not all computed yet (its prompt must run, not come from the cache)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def token_at(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output without building the concatenation."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
