"""Sampling parameters with vLLM's names, defaults and validation."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5
# The seeds a torch generator takes (negative ones as their 64-bit two's complement).
SEED_MIN, SEED_END = -2**63, 2**64


def offset_seed(seed: int, index: int) -> int:
    """Choice ``index``'s seed of a request seeded ``seed`` (n > 1): seed + index, wrapped into the seeds a generator
    takes, so every valid seed gives n valid ones (a generator reads -1 and 2**64 - 1 alike)."""
    return (seed + index) % SEED_END


@dataclass
class SamplingParams:
    """How to sample one request's completion (vLLM-compatible subset).

    ``temperature == 0`` means greedy. ``top_k`` of 0 or -1 disables top-k. ``seed`` makes a request's
    random draws reproducible whatever else is in the batch.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    # per prompt token after the first: its logprob given the tokens before it, and this many most likely tokens
    # (vLLM's prompt_logprobs; the request then computes its whole prompt, without the prefix cache's blocks)
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # token id (int, or its decimal string as OpenAI's JSON sends it) -> added to its logit before sampling, clamped
    # to [-100, 100] as OpenAI and vLLM do; -100 bans a token in practice, +100 all but forces it
    logit_bias: dict[int, float] | None = None
    # Filled in by the engine: all token ids that end the request (EOS + stop_token_ids).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        self._verify()
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if self.best_of is not None and (not isinstance(self.best_of, int) or self.best_of < self.n):
            raise ValueError(f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")
        if not 0.0 <= self.temperature:
            raise bad("temperature", ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "-1, 0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or not SEED_MIN <= self.seed < SEED_END):
            raise bad("seed", "an integer in [-2**63, 2**64) (a torch generator's seed) or None")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1 or None")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= 20):
                raise bad(name, "an integer in [0, 20] or None")
        if not 0.0 < self.repetition_penalty:
            raise bad("repetition_penalty", "> 0")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _logit_bias(bias) -> dict[int, float]:
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
    out = {}
    for token, value in bias.items():
        try:
            tid = int(token) if isinstance(token, (int, str)) and not isinstance(token, bool) else None
        except ValueError:
            tid = None
        if tid is None or tid < 0:
            raise ValueError(f"logit_bias: key {token!r} is not a token id (a non-negative integer)")
        try:
            bias = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
        except OverflowError:  # an int past float's range
            bias = math.inf if value > 0 else -math.inf
        if math.isnan(bias):
            raise ValueError(f"logit_bias: the bias of token {tid} must be a number, got {value!r}")
        out[tid] = min(100.0, max(-100.0, bias))
    return out
