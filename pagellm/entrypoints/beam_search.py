"""Beam search over the engine, with HF transformers' semantics (``generate(num_beams=W, do_sample=False)``).

Each step runs every live beam as a one-token request that returns its top 2W log-probabilities, and keeps its
K/V (``keep_kv``). A beam that goes on is a fork of the request it came from (``LLMEngine.fork_request``): it
shares that request's blocks, the last, partial one copied when two beams write into it, and computes only its
new token. So a step is a decode step of the live beams, with or without prefix caching. ``beam_search`` drives
an ``LLMEngine`` (``LLM.beam_search``); ``beam_search_async`` the server's ``AsyncLLMEngine`` (``use_beam_search``),
whose other requests keep running beside it.

Scoring and stopping follow transformers 5.x exactly:
  - the 2W best continuations over all beams (by cumulative logprob) are considered; the W best that did not
    just end continue as running beams;
  - a continuation that ends (EOS, unless ``ignore_eos``; or the length limit) among the first W candidates becomes
    a finished hypothesis scored ``sum_logprobs / generated_len ** length_penalty``; the W best are kept;
  - ``early_stopping=True`` stops once W hypotheses are finished; ``False`` (HF's default) stops when the best
    running beam, scored at its current length, cannot beat the worst finished one; ``"never"`` scores it at
    the maximum length when ``length_penalty > 0``.
"""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

from pagellm.sampling_params import SamplingParams


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= 10:
            raise ValueError(f"beam_width must be an integer in [1, 10], got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature != 0.0:
            raise ValueError(f"temperature must be 0 (deterministic beams), got {self.temperature}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt + generated
    cum_logprob: float
    score: float  # cum_logprob / generated_len ** length_penalty
    text: str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


@dataclass
class _Search:
    prompt: list[int]
    running: list[tuple[list[int], float]]  # (generated tokens, cumulative logprob)
    rids: list[str]  # per running beam, the request whose output scores its next token
    finished: list[tuple[list[int], float, float]] = field(default_factory=list)  # (tokens, cum_lp, score)
    improvable: bool = True
    done: bool = False

    def advance(self, t: int, scored: list[dict], params: BeamSearchParams, eos: set[int]) -> list[tuple[int, int]]:
        """Step t, given each running beam's top logprobs ({token: Logprob}): keep the finished hypotheses, decide
        whether the search is done, and return the beams that go on as (parent beam, token), best first."""
        W, K, lp = params.beam_width, 2 * params.beam_width, params.length_penalty
        cands = []  # (cumulative logprob, beam index, token)
        for b, ((_, score), entry) in enumerate(zip(self.running, scored)):
            cands += [(score + v.logprob, b, tok) for tok, v in entry.items()]
        cands = sorted(cands, key=lambda c: c[0], reverse=True)[:K]
        at_limit = t + 1 >= params.max_tokens
        ends = [at_limit or tok in eos for _, _, tok in cands]
        # finished hypotheses: only among the first W candidates, and only while they can still matter
        all_full = len(self.finished) == W and params.early_stopping is True
        for (acc, b, tok), end in list(zip(cands, ends))[:W]:
            if end and self.improvable and not all_full:
                self.finished.append((self.running[b][0] + [tok], acc, acc / ((t + 1) ** lp)))
        self.finished = sorted(self.finished, key=lambda f: f[2], reverse=True)[:W]
        alive = [(acc, b, tok) for (acc, b, tok), end in zip(cands, ends) if not end][:W]
        # HF's early-stop heuristic, evaluated after the step
        if len(self.finished) == W and alive:
            best_len = params.max_tokens if params.early_stopping == "never" and lp > 0.0 else t + 1
            best_possible = alive[0][0] / (best_len ** lp)
            self.improvable = self.improvable and any(best_possible > f[2] for f in self.finished)
        full = len(self.finished) == W and params.early_stopping is True
        self.done = not alive or not self.improvable or full
        self.running = [(self.running[b][0] + [tok], acc) for acc, b, tok in alive]
        return [(b, tok) for _, b, tok in alive]

    def output(self, params: BeamSearchParams, tokenizer) -> BeamSearchOutput:
        lp = params.length_penalty
        hyps = self.finished or [(toks, acc, acc / max(1, len(toks)) ** lp) for toks, acc in self.running]
        return BeamSearchOutput([
            BeamSearchSequence(self.prompt + toks, acc, score,
                               tokenizer.decode(toks, skip_special_tokens=True) if tokenizer is not None else None)
            for toks, acc, score in sorted(hyps, key=lambda h: h[2], reverse=True)[:params.beam_width]])


def _check(prompts: list[list[int]], params: BeamSearchParams, max_model_len: int) -> SamplingParams:
    """The one-token requests' params; a ValueError if a prompt cannot take max_tokens more tokens."""
    for p in prompts:
        if len(p) + params.max_tokens > max_model_len:
            raise ValueError(f"max_tokens={params.max_tokens} plus a prompt's {len(p)} tokens exceeds "
                             f"max_model_len={max_model_len}")
    return SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=min(2 * params.beam_width, 20))


def beam_search(llm, prompts: list[list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
    engine = llm.llm_engine
    eos = set() if params.ignore_eos else engine.eos_token_ids
    step_params = _check(prompts, params, engine.config.max_model_len)
    searches: list[_Search] = []
    held: set[str] = set()  # the requests whose blocks this search holds (released however it ends)
    try:
        for p in prompts:
            rid = engine.add_request(prompt_token_ids=p, sampling_params=step_params, keep_kv=True)
            held.add(rid)
            searches.append(_Search(list(p), [([], 0.0)], [rid]))
        for t in range(params.max_tokens):
            live = [s for s in searches if not s.done]
            if not live:
                break
            scored = _run(engine, [rid for s in live for rid in s.rids])
            for s in live:
                moves = s.advance(t, [scored[rid] for rid in s.rids], params, eos)
                parents, s.rids = s.rids, []
                for b, tok in ([] if s.done else moves):
                    s.rids.append(engine.fork_request(parents[b], [tok], step_params, keep_kv=True))
                    held.add(s.rids[-1])
            for rid in scored:  # after the forks, so that a beam's only child writes in place
                engine.release_kv(rid)
                held.discard(rid)
    finally:
        for rid in held:  # (an error: abort the beams' requests that have not finished)
            if not engine.release_kv(rid):
                engine.abort_request(rid)
    return [s.output(params, engine.tokenizer) for s in searches]


def _run(engine, ids: list[str]) -> dict[str, dict]:
    """Step the engine until the given one-token requests have finished; each one's top logprobs."""
    pending, scored = set(ids), {}
    while pending:
        if not engine.has_unfinished_requests():
            raise RuntimeError(f"beam search: {len(pending)} requests ended without an output")
        for out in engine.step():
            if out.finished and out.request_id in pending:
                pending.discard(out.request_id)
                scored[out.request_id] = out.outputs[0].logprobs[0]
    return scored


async def beam_search_async(engine, prompts: list[list[int]], params: list[BeamSearchParams],
                            cache_salt: str | None = None) -> list[BeamSearchOutput]:
    """Beam search on an AsyncLLMEngine, beside its other requests, one BeamSearchParams per prompt. The prompts go
    in step: each step's forks, all prompts', are queued together, then their parents released (in that order on
    the engine's loop thread: a fork takes its parent's blocks first), then their outputs awaited."""
    eos = [set() if p.ignore_eos else engine.engine.eos_token_ids for p in params]
    steps = [_check([p], bp, engine.engine.config.max_model_len) for p, bp in zip(prompts, params)]
    searches = [_Search(list(p), [([], 0.0)], [_new_id()]) for p in prompts]
    held: set[str] = set()
    streams: list = []
    tasks: list[asyncio.Future] = []
    try:
        for s, p, step in zip(searches, prompts, steps):
            held.add(s.rids[0])
            streams.append(engine.submit(None, step, p, s.rids[0], cache_salt, keep_kv=True))
        for t in range(max(p.max_tokens for p in params)):
            live = [i for i, s in enumerate(searches) if not s.done]
            if not live:
                break
            tasks = [asyncio.ensure_future(_last(st)) for st in streams]
            outs = iter(await asyncio.gather(*tasks))
            streams, parents = [], []
            for i in live:
                s = searches[i]
                moves = s.advance(t, [next(outs).outputs[0].logprobs[0] for _ in s.rids], params[i], eos[i])
                mine, s.rids = s.rids, []
                parents += mine
                for b, tok in ([] if s.done else moves):
                    s.rids.append(_new_id())
                    held.add(s.rids[-1])
                    streams.append(engine.submit(None, steps[i], [tok], s.rids[-1], cache_salt, keep_kv=True,
                                                 fork_of=mine[b]))
            for rid in parents:
                engine.release_kv(rid)
                held.discard(rid)
    finally:
        for task in tasks:  # (cancelled or failed: stop reading, release what is kept, abort the others)
            task.cancel()
        for rid in held:
            engine.release_kv(rid)
        for st in streams:
            if not st.ag_running:  # (one that a cancelled task is inside ends with that task)
                await st.aclose()
    return [s.output(bp, engine.tokenizer) for s, bp in zip(searches, params)]


async def _last(stream):
    out = None
    async for out in stream:
        pass
    return out


def _new_id() -> str:
    return f"beam-{uuid.uuid4().hex}"
