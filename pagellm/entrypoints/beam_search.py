"""Beam search over the engine, with HF transformers' semantics (``generate(num_beams=W, do_sample=False)``).

Each step runs every live beam as a one-token request that returns its top 2W log-probabilities. Beams share
their common history through the prefix cache: a fork is a reference-count bump on the cached full blocks, and
only a beam's last, partial block is recomputed (never copied or written by two beams).

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
    running: list[tuple[list[int], float]]  # (generated tokens, cumulative logprob)
    finished: list[tuple[list[int], float, float]] = field(default_factory=list)  # (tokens, cum_lp, score)
    improvable: bool = True
    done: bool = False


def beam_search(llm, prompts: list[list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
    engine = llm.llm_engine
    eos = set() if params.ignore_eos else engine.eos_token_ids
    W, K, lp = params.beam_width, 2 * params.beam_width, params.length_penalty
    searches = [_Search(list(p), [([], 0.0)]) for p in prompts]
    step_params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=min(K, 20))
    for t in range(params.max_tokens):
        live = [s for s in searches if not s.done]
        if not live:
            break
        batch = [{"prompt_token_ids": s.prompt + toks} for s in live for toks, _ in s.running]
        outs = iter(llm.generate(batch, step_params, use_tqdm=False))
        for s in live:
            cands = []  # (cumulative logprob, beam index, token)
            for b, (toks, score) in enumerate(s.running):
                entry = next(outs).outputs[0].logprobs[0]
                cands += [(score + v.logprob, b, tok) for tok, v in entry.items()]
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
            s.running = [(s.running[b][0] + [tok], acc) for acc, b, tok in alive]
            # HF's early-stop heuristic, evaluated after the step
            if len(s.finished) == W and s.running:
                best_len = (params.max_tokens if params.early_stopping == "never" and lp > 0.0 else t + 1)
                best_possible = s.running[0][1] / (best_len ** lp)
                s.improvable = s.improvable and any(best_possible > f[2] for f in s.finished)
            full = len(s.finished) == W and params.early_stopping is True
            s.done = not s.running or not s.improvable or full
    tok = engine.tokenizer
    results = []
    for s in searches:
        hyps = s.finished or [(toks, acc, acc / max(1, len(toks)) ** lp) for toks, acc in s.running]
        seqs = [BeamSearchSequence(s.prompt + toks, acc, score,
                                   tok.decode(toks, skip_special_tokens=True) if tok is not None else None)
                for toks, acc, score in sorted(hyps, key=lambda h: h[2], reverse=True)[:W]]
        results.append(BeamSearchOutput(seqs))
    return results
