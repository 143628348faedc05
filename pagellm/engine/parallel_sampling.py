"""n > 1 and best_of: a parent request fans out into child requests that share the prompt's KV blocks.

Sharing comes from the prefix cache (as in vLLM v1): the first child's full prompt blocks are registered as soon
as they are scheduled, and every sibling admitted after it finds them, takes a reference, and computes only its
last, partial prompt block. So n samples of a long prompt cost one prompt's blocks plus one private tail block
per sample, and no block is ever written by two sequences (no copy-on-write needed). Without prefix caching the
children simply run independently.

best_of > n: all best_of children run; the n with the highest cumulative logprob are returned.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm.sampling_params import SamplingParams, offset_seed


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Child i samples once; seeds are offset so samples differ yet stay reproducible; best_of needs logprobs."""
    logprobs = params.logprobs
    if params.best_of is not None and params.best_of > params.n and logprobs is None:
        logprobs = 0  # the sampled token's logprob only, to rank the samples
    seed = None if params.seed is None else offset_seed(params.seed, index)
    # the prompt's logprobs once, from the first child (the others share its prompt blocks)
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return replace(params, n=1, best_of=None, seed=seed, logprobs=logprobs, prompt_logprobs=prompt_logprobs)


@dataclass
class ParentRequest:
    request_id: str
    params: SamplingParams
    child_ids: list[str]
    finished: dict[str, RequestOutput] = field(default_factory=dict)

    def add(self, out: RequestOutput) -> RequestOutput | None:
        """Record a finished child; when all are done, return the parent's output (n completions)."""
        self.finished[out.request_id] = out
        if len(self.finished) < len(self.child_ids):
            return None
        children = [self.finished[c] for c in self.child_ids]
        comps = [c.outputs[0] for c in children]
        if len(comps) > self.params.n:  # best_of: keep the n most likely samples
            comps = sorted(comps, key=lambda c: c.cumulative_logprob or 0.0, reverse=True)[:self.params.n]
        outputs = []
        for i, c in enumerate(comps):
            keep_lp = self.params.logprobs is not None
            outputs.append(CompletionOutput(i, c.text, c.token_ids, c.cumulative_logprob if keep_lp else None,
                                            c.logprobs if keep_lp else None, c.finish_reason, c.stop_reason))
        first = children[0]
        metrics = {"num_cached_tokens": sum(c.metrics.get("num_cached_tokens", 0) for c in children)}
        return RequestOutput(self.request_id, first.prompt, first.prompt_token_ids, outputs, True, metrics,
                             first.prompt_logprobs)
