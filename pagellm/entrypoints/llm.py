"""Offline API, vLLM-compatible: ``LLM(...).generate(prompts, sampling_params)`` and ``.chat(messages)``."""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from pagellm.config import EngineConfig
from pagellm.engine.llm_engine import LLMEngine
from pagellm.entrypoints.chat_utils import render_chat
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import SamplingParams

PromptType = str | dict[str, Any]


class LLM:
    """An engine plus a run-to-completion loop. ``model=None`` loads the default model (SmolLM2-135M-Instruct)."""

    def __init__(self, model: str | None = None, dtype: str | torch.dtype = "auto", max_model_len: int | None = None,
                 block_size: int | str = 32, max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 enable_chunked_prefill: bool = True, enable_prefix_caching: bool = True,
                 kv_cache_memory: int | str | None = None, seed: int = 0, **kwargs: Any) -> None:
        config = EngineConfig(model=model, dtype=dtype, max_model_len=max_model_len, block_size=block_size,
                              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              enable_chunked_prefill=enable_chunked_prefill,
                              enable_prefix_caching=enable_prefix_caching, kv_cache_memory=kv_cache_memory,
                              seed=seed, **kwargs)
        self.llm_engine = LLMEngine(config)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for one or many prompts (strings or ``{"prompt_token_ids": [...]}``); outputs in input order.

        Every prompt is validated before any runs, so one bad prompt raises without starting the others.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        engine = self.llm_engine
        ids = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(self._add(p, sp))
        except Exception:
            for rid in ids:
                engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template: str | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (a list of messages) or several, then generate.
        chat_template_kwargs: the template's own variables (e.g. Qwen3's enable_thinking)."""
        tok = self.llm_engine.tokenizer
        if tok is None:
            raise ValueError("chat needs a tokenizer with a chat template; this model has no tokenizer")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in convs:
            text = render_chat(tok, conv, add_generation_prompt, chat_template, chat_template_kwargs)
            prompts.append({"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params) -> list:
        """Beam search (vLLM's signature: ``BeamSearchParams``); HF transformers' scoring and stopping rules,
        see ``entrypoints/beam_search.py``. Returns one ``BeamSearchOutput`` per prompt, best sequence first."""
        from pagellm.entrypoints.beam_search import beam_search

        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        tok = self.llm_engine.tokenizer
        ids = []
        for p in prompts:
            if isinstance(p, str):
                if tok is None:
                    raise ValueError("prompts: this model has no tokenizer; give prompt_token_ids")
                ids.append(tok.encode(p))
            elif isinstance(p, dict) and "prompt_token_ids" in p:
                ids.append(list(p["prompt_token_ids"]))
            else:
                raise ValueError("prompts: expected strings or dicts with 'prompt_token_ids'")
        return beam_search(self, ids, params)

    def _add(self, prompt: PromptType, params: SamplingParams) -> str:
        if isinstance(prompt, str):
            return self.llm_engine.add_request(prompt=prompt, sampling_params=params)
        if isinstance(prompt, dict) and ("prompt_token_ids" in prompt or "prompt" in prompt):
            return self.llm_engine.add_request(prompt=prompt.get("prompt"), sampling_params=params,
                                               prompt_token_ids=prompt.get("prompt_token_ids"),
                                               cache_salt=prompt.get("cache_salt"))
        raise ValueError(f"prompts: expected a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        t0 = time.perf_counter()
        in_toks = out_toks = 0
        wanted = set(ids)
        try:
            while len(done) < len(ids) and engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        in_toks += len(out.prompt_token_ids)
                        out_toks += len(out.outputs[0].token_ids)
                        if use_tqdm:
                            dt = time.perf_counter() - t0
                            bar.set_postfix_str(f"est. speed input: {in_toks / dt:.2f} toks/s, "
                                                f"output: {out_toks / dt:.2f} toks/s", refresh=False)
                            bar.update(1)
        finally:
            bar.close()
            for rid in wanted - done.keys():
                engine.abort_request(rid)
        return [done[i] for i in ids]
