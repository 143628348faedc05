"""Completions and chat completions: one engine request per choice, streamed or collected (with use_beam_search, a
beam search per prompt whose best sequences are its choices)."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from pagellm.engine.async_engine import AsyncLLMEngine
from pagellm.entrypoints.beam_search import beam_search_async
from pagellm.entrypoints.chat_utils import render_chat
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm.sampling_params import SamplingParams, offset_seed


@dataclass
class _Choice:
    """What has been produced (and sent) for one choice."""

    index: int
    prompt_ids: list[int] = field(default_factory=list)
    text: str = ""
    sent_text: int = 0
    token_ids: list[int] = field(default_factory=list)
    sent_tokens: int = 0
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # echo (completions): the prompt's text and, with logprobs, its tokens' logprobs (set by the first update)
    echo: bool = False
    echo_sent: bool = False  # (streaming: the prompt went out in the choice's first chunk)
    prompt_text: str | None = None
    first_token_text: str = ""
    prompt_token_chars: int = 0  # the prompt tokens' texts' length (where echo's completion offsets start)
    prompt_logprobs: list | None = None  # RequestOutput.prompt_logprobs (prompt_logprobs, or echo with logprobs)
    # n > 1 with prompt logprobs: the prompt's first choice, whose request alone computes them (the others read the
    # prompt's blocks from the prefix cache) and whose prompt fields this one takes
    lead: _Choice | None = field(default=None, repr=False)
    prompt_only: bool = False  # echo with max_tokens 0: the prompt alone, the step's token dropped

    @property
    def waiting(self) -> bool:
        """The prompt's logprobs are still to come from the lead's request."""
        return self.lead is not None and self.prompt_logprobs is None


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    # ------------------------------------------------------------------ prompts
    def completion_prompts(self, req: CompletionRequest) -> list[tuple[str | None, list[int] | None]]:
        p = req.prompt
        if isinstance(p, str):
            return [(p, None)]
        if not p:
            raise ValueError("prompt must not be empty")
        if all(isinstance(x, int) for x in p):
            return [(None, list(p))]
        if all(isinstance(x, str) for x in p):
            return [(x, None) for x in p]
        return [(None, list(x)) for x in p]

    def chat_prompt(self, req: ChatCompletionRequest) -> tuple[str, list[int]]:
        text = render_chat(self.engine.tokenizer, [m.as_dict() for m in req.messages], req.add_generation_prompt,
                           chat_template_kwargs=req.chat_template_kwargs)
        return text, self.engine.tokenizer.encode(text, add_special_tokens=False)

    # ------------------------------------------------------------------ running
    @staticmethod
    def choices(total: int, n: int, params: SamplingParams, echo: bool = False,
                prompt_only: bool = False) -> list[_Choice]:
        """The choices of ``total / n`` prompts, n each, as run() yields them (choice i: prompt i // n)."""
        choices = [_Choice(i, echo=echo, prompt_only=prompt_only) for i in range(total)]
        if params.prompt_logprobs is not None:
            for c in choices:
                if c.index % n:
                    c.lead = choices[c.index - c.index % n]
        return choices

    def _streams(self, prompts, params: SamplingParams, n: int,
                 cache_salt: str | None) -> list[AsyncIterator[RequestOutput]]:
        """n engine requests per prompt: choice i gets seed + i when a seed is given, and only the first computes
        the prompt's logprobs (see _Choice.lead) and the prompt's K/V, which the others share (share_prompt_with;
        submitted in this order, the first reaches the engine first)."""
        gens = []
        for prompt, ids in prompts:
            first = _rid()
            for i in range(n):
                p = params
                if i and params.seed is not None:
                    p = replace(p, seed=offset_seed(params.seed, i))
                if i and params.prompt_logprobs is not None:
                    p = replace(p, prompt_logprobs=None)
                gens.append(self.engine.generate(prompt, p, prompt_token_ids=ids, request_id=_rid() if i else first,
                                                 cache_salt=cache_salt, share_prompt_with=first if i else None))
        return gens

    async def run(self, prompts, params: SamplingParams, n: int,
                  cache_salt: str | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Merge the choices' streams: yields (choice index, output) as any of them produces tokens."""
        gens = self._streams(prompts, params, n, cache_salt)
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, gen):
            try:
                async for out in gen:
                    await queue.put((i, out, None))
            except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
                await queue.put((i, None, e))
            finally:
                await queue.put((i, None, StopAsyncIteration()))

        # Validate every choice's request before streaming anything: the first output of each generator is
        # awaited lazily, so start them all and surface the first error.
        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
        live = len(tasks)
        try:
            while live:
                i, out, err = await queue.get()
                if isinstance(err, StopAsyncIteration):
                    live -= 1
                elif err is not None:
                    raise err
                else:
                    yield i, out
        finally:
            for t in tasks:
                t.cancel()
            # A cancelled pump closes the generator it is iterating (which aborts that engine request); closing
            # it from here while the pump is suspended inside it would raise "aclose(): asynchronous generator is
            # already running" and turn e.g. one bad prompt of a batch into a 500.
            for g in gens:
                if not g.ag_running:
                    await g.aclose()

    async def run_beams(self, prompts, req, cache_salt: str | None = None
                        ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """use_beam_search: the prompts' beam searches (req.n beams), in step, beside the engine's other requests;
        yields each prompt's n best sequences as its n choices, finished, once the searches end."""
        tok, engine = self.engine.tokenizer, self.engine.engine
        ids = [p_ids if p_ids is not None else tok.encode(text) for text, p_ids in prompts]
        params = [req.beam_search_params(len(p), engine.config.max_model_len) for p in ids]  # (all checked first)
        results = await beam_search_async(self.engine, ids, params, cache_salt)
        for k, ((text, _), p, bp, res) in enumerate(zip(prompts, ids, params, results)):
            eos = set() if bp.ignore_eos else engine.eos_token_ids
            for j, seq in enumerate(res.sequences):
                gen = seq.tokens[len(p):]
                finish = "stop" if gen and gen[-1] in eos else "length"
                out = CompletionOutput(0, tok.decode(gen, skip_special_tokens=req.skip_special_tokens), gen,
                                       seq.cum_logprob, None, finish, None)
                yield k * bp.beam_width + j, RequestOutput(_rid(), text, p, [out], True, {})

    # ------------------------------------------------------------------ responses
    def update(self, choice: _Choice, out: RequestOutput, hold: int) -> None:
        c = out.outputs[0]
        choice.prompt_ids = out.prompt_token_ids
        if choice.lead is not None:
            self.take_lead(choice)
        else:
            if out.prompt_logprobs is not None:
                choice.prompt_logprobs = out.prompt_logprobs
            if choice.echo and choice.prompt_text is None:
                tok = self.engine.tokenizer
                choice.prompt_text = out.prompt if out.prompt is not None else tok.decode(out.prompt_token_ids)
                choice.first_token_text = tok.decode(out.prompt_token_ids[:1])
                entries = (out.prompt_logprobs or [])[1:]
                choice.prompt_token_chars = len(choice.first_token_text) + sum(
                    len(e[t].decoded_token or "") for t, e in zip(out.prompt_token_ids[1:], entries))
        if choice.prompt_only:  # the step's token is not part of the answer
            choice.finish_reason = "length" if out.finished else None
            return
        choice.text = c.text
        choice.token_ids = c.token_ids
        choice.logprobs = c.logprobs or []
        choice.finish_reason = c.finish_reason
        choice.stop_reason = c.stop_reason
        if not out.finished and hold:
            # A stop string may be completing: hold back text that could still be cut.
            choice.text = c.text[:max(choice.sent_text, len(c.text) - hold)]

    def released(self, choices: list[_Choice], i: int, n: int) -> list[_Choice]:
        """The choices that may have something to send once choice i is updated: i itself unless it still waits on
        its lead, and, where i is a lead, those of its followers that were waiting for its prompt logprobs."""
        c = choices[i]
        ready = [] if c.waiting else [c]
        if c.lead is None and c.prompt_logprobs is not None:
            ready += [f for f in choices[i + 1:i + n] if self.take_lead(f)]
        return ready

    @staticmethod
    def take_lead(choice: _Choice) -> bool:
        """A waiting choice takes its lead's prompt fields once the lead has them; True if it took them now."""
        lead = choice.lead
        if not choice.waiting or lead.prompt_logprobs is None:
            return False
        choice.prompt_logprobs = lead.prompt_logprobs
        choice.prompt_text, choice.first_token_text = lead.prompt_text, lead.first_token_text
        choice.prompt_token_chars = lead.prompt_token_chars
        return True

    def usage(self, choices: list[_Choice], prompt_lens: list[int]) -> dict:
        """prompt_lens: each prompt's tokens once, however many choices it has (as OpenAI and vLLM count)."""
        completion = sum(len(c.token_ids) for c in choices)
        prompt = sum(prompt_lens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_logprobs(choice: _Choice, start: int, end: int, text_offset0: int, with_prompt: bool = False,
                        top: int = 0) -> dict:
    """Legacy completions logprobs for tokens [start, end); with_prompt (echo): the prompt's tokens first, the first
    of them with None for its logprob and top logprobs (as vLLM's), each with its ``top`` most likely tokens, and
    offsets running on through the completion's (text_offset0: the completion's characters before ``start``)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = 0
    if with_prompt:
        for tok, entry in zip(choice.prompt_ids, choice.prompt_logprobs or []):
            text = choice.first_token_text if entry is None else entry[tok].decoded_token or ""
            tokens.append(text)
            token_lps.append(None if entry is None else entry[tok].logprob)
            tops.append(None if entry is None else {(v.decoded_token or ""): v.logprob for t, v in entry.items()
                                                    if t == tok or (v.rank or 0) <= top})
            offsets.append(offset)
            offset += len(text)
    offset = text_offset0 + (choice.prompt_token_chars if choice.echo else 0)
    for tok, entry in zip(choice.token_ids[start:end], choice.logprobs[start:end]):
        lp = entry[tok]
        tokens.append(lp.decoded_token or "")
        token_lps.append(lp.logprob)
        tops.append({(v.decoded_token or ""): v.logprob for t, v in entry.items()})
        offsets.append(offset)
        offset += len(lp.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_json(entries: list | None) -> list | None:
    """RequestOutput.prompt_logprobs as vLLM's responses carry it: None, then {token id: {logprob, rank,
    decoded_token}} per prompt token."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": v.logprob, "rank": v.rank, "decoded_token": v.decoded_token}
                                    for t, v in e.items()} for e in entries]


def chat_logprobs(choice: _Choice, start: int, end: int, top: int) -> dict:
    content = []
    for tok, entry in zip(choice.token_ids[start:end], choice.logprobs[start:end]):
        lp = entry[tok]
        tops = sorted(entry.values(), key=lambda v: v.rank or 0)
        tops = [v for v in tops if v.rank is not None and v.rank <= top][:top]
        content.append({"token": lp.decoded_token or "", "logprob": lp.logprob,
                        "bytes": list((lp.decoded_token or "").encode()),
                        "top_logprobs": [{"token": v.decoded_token or "", "logprob": v.logprob,
                                          "bytes": list((v.decoded_token or "").encode())} for v in tops]})
    return {"content": content}


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def _rid() -> str:
    return uuid.uuid4().hex


def now() -> int:
    return int(time.time())
