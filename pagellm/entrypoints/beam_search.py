"""Beam search over the engine, with HF transformers' semantics (``generate(num_beams=W, do_sample=False)``).

Each step runs every live beam as a one-token request that returns its top 2W log-probabilities, and keeps its
K/V (``keep_kv``). A beam that goes on is a fork of the request it came from (``LLMEngine.fork_request``): it
shares that request's blocks, the last, partial one copied when two beams write into it, and computes only its
new token. So a step is a decode step of the live beams, with or without prefix caching.

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

from dataclasses import dataclass, field

from pagellm.sampling_params import SamplingParams

_NEG = -1.0e9


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
    # (generated tokens, cumulative logprob, the request whose output scores the beam's next token)
    running: list[tuple[list[int], float, str]]
    finished: list[tuple[list[int], float, float]] = field(default_factory=list)  # (tokens, cum_lp, score)
    improvable: bool = True
    done: bool = False


def beam_search(llm, prompts: list[list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
    engine = llm.llm_engine
    eos = set() if params.ignore_eos else engine.eos_token_ids
    W, K, lp = params.beam_width, 2 * params.beam_width, params.length_penalty
    limit = engine.config.max_model_len
    for p in prompts:
        if len(p) + params.max_tokens > limit:
            raise ValueError(f"max_tokens={params.max_tokens} plus a prompt's {len(p)} tokens exceeds "
                             f"max_model_len={limit}")
    step_params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=min(K, 20))
    searches: list[_Search] = []
    held: set[str] = set()  # the requests whose blocks this search holds (released however it ends)
    try:
        for p in prompts:
            rid = engine.add_request(prompt_token_ids=p, sampling_params=step_params, keep_kv=True)
            held.add(rid)
            searches.append(_Search(list(p), [([], 0.0, rid)]))
        for t in range(params.max_tokens):
            live = [s for s in searches if not s.done]
            if not live:
                break
            scored = _run(engine, [rid for s in live for _, _, rid in s.running])
            for s in live:
                cands = []  # (cumulative logprob, beam index, token)
                for b, (_, score, rid) in enumerate(s.running):
                    cands += [(score + v.logprob, b, tok) for tok, v in scored[rid].items()]
                cands = sorted(cands, key=lambda c: c[0], reverse=True)[:K]
                at_limit = t + 1 >= params.max_tokens
                ends = [at_limit or tok in eos for _, _, tok in cands]
                # finished hypotheses: only among the first W candidates, and only while they can still matter
                all_full = len(s.finished) == W and params.early_stopping is True
                for (acc, b, tok), end in list(zip(cands, ends))[:W]:
                    if end and s.improvable and not all_full:
                        toks = s.running[b][0] + [tok]
                        s.finished.append((toks, acc, acc / ((t + 1) ** lp)))
                s.finished = sorted(s.finished, key=lambda f: f[2], reverse=True)[:W]
                alive = [(acc, b, tok) for (acc, b, tok), end in zip(cands, ends) if not end][:W]
                # HF's early-stop heuristic, evaluated after the step
                if len(s.finished) == W and alive:
                    best_len = (params.max_tokens if params.early_stopping == "never" and lp > 0.0 else t + 1)
                    best_possible = alive[0][0] / (best_len ** lp)
                    s.improvable = s.improvable and any(best_possible > f[2] for f in s.finished)
                full = len(s.finished) == W and params.early_stopping is True
                s.done = not alive or not s.improvable or full
                running = []
                for acc, b, tok in alive:
                    toks, _, parent = s.running[b]
                    rid = "" if s.done else engine.fork_request(parent, [tok], step_params, keep_kv=True)
                    if rid:
                        held.add(rid)
                    running.append((toks + [tok], acc, rid))
                s.running = running
            for rid in scored:  # after the forks, so that a beam's only child writes in place
                engine.release_kv(rid)
                held.discard(rid)
    finally:
        for rid in held:  # (an error: abort the beams' requests that have not finished)
            if not engine.release_kv(rid):
                engine.abort_request(rid)
    tok = engine.tokenizer
    results = []
    for s in searches:
        hyps = s.finished or [(toks, acc, acc / max(1, len(toks)) ** lp) for toks, acc, _ in s.running]
        seqs = [BeamSearchSequence(s.prompt + toks, acc, score,
                                   tok.decode(toks, skip_special_tokens=True) if tok is not None else None)
                for toks, acc, score in sorted(hyps, key=lambda h: h[2], reverse=True)[:W]]
        results.append(BeamSearchOutput(seqs))
    return results


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
