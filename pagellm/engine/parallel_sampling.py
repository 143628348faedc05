"""n > 1 and best_of: a parent request fans out into child requests that share the prompt's KV blocks.

The first child computes the prompt; the others follow it (Scheduler: followers): they wait until it has sampled,
then fork its blocks, copy-on-write, and each computes only the prompt's last token, for its own logits. So n
samples of a long prompt cost one prompt's blocks plus one private tail block per sample, and one prompt's
computation plus n - 1 tokens, with or without prefix caching. The other samples start a step after the first
has computed the prompt (its last chunk, with chunked prefill).

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


def merge_children(outputs: list[RequestOutput], parents: dict[str, ParentRequest],
                   parent_of: dict[str, str]) -> list[RequestOutput]:
    """A step's outputs, where the children of an n > 1 request report only through their parent, once all have
    finished (LLMEngine's ``parents`` and ``parent_of``, updated here: a child's id stays taken until then)."""
    merged = []
    for out in outputs:
        pid = parent_of.get(out.request_id)
        if pid is None:
            merged.append(out)
        elif out.finished:
            done = parents[pid].add(out)
            if done is not None:
                for c in parents.pop(pid).child_ids:
                    del parent_of[c]
                merged.append(done)
    return merged
