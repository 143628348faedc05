"""Request bodies of the OpenAI-compatible API (pydantic), with vLLM's extra sampling fields."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagellm.entrypoints.beam_search import BeamSearchParams
from pagellm.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM's extras)."""

    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, as vLLM's server does (with a warning)

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (a string in JSON) -> bias in [-100, 100]
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and this many top ones
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None  # requests with different salts never share prefix-cache blocks
    # vLLM's beam search: n beams, their n best sequences as the choices (entrypoints/beam_search.py)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def _beam_search_params(self, max_tokens: int | None, logprobs: int | None, prompt_len: int,
                            max_model_len: int) -> BeamSearchParams:
        """use_beam_search: greedy beams; a field that would change the output, which beam search does not take, is
        refused. max_tokens None: up to max_model_len."""
        if max_tokens is None:
            if prompt_len >= max_model_len:
                raise ValueError(f"prompt has {prompt_len} tokens, but max_model_len is {max_model_len}: the prompt "
                                 f"plus at least one generated token must fit")
            max_tokens = max_model_len - prompt_len
        unsupported = {"logprobs": logprobs is not None, "prompt_logprobs": self.prompt_logprobs is not None,
                       "temperature": self.temperature not in (None, 0), "top_p": self.top_p not in (None, 1),
                       "top_k": self.top_k not in (None, 0, -1), "min_p": self.min_p not in (None, 0),
                       "stop": bool(self.stop), "stop_token_ids": bool(self.stop_token_ids),
                       "presence_penalty": self.presence_penalty != 0, "frequency_penalty": self.frequency_penalty != 0,
                       "repetition_penalty": self.repetition_penalty not in (None, 1),
                       "logit_bias": bool(self.logit_bias), "min_tokens": self.min_tokens != 0}
        if bad := [name for name, given in unsupported.items() if given]:
            others = f" (nor can {', '.join(bad[1:])})" if len(bad) > 1 else ""
            raise ValueError(f"{bad[0]} cannot be used with use_beam_search{others}")
        if not 1 <= self.n <= 10:
            raise ValueError(f"n must be in [1, 10] with use_beam_search (the beam width), got {self.n}")
        return BeamSearchParams(beam_width=self.n, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                                length_penalty=self.length_penalty, early_stopping=self.early_stopping)

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        """One SamplingParams per choice; n is handled by the server (one engine request per choice)."""
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not available with stream=true (as in vLLM)")
        # an OpenAI field that would change the output, which the engine does not implement: refused, not ignored
        if (fmt := (self.model_extra or {}).get("response_format")) is not None and fmt != {"type": "text"}:
            raise ValueError(f"response_format: only {{'type': 'text'}} is supported, got {fmt!r}")
        return SamplingParams(
            n=1, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0, seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            skip_special_tokens=self.skip_special_tokens, logit_bias=self.logit_bias,
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0 (vLLM's way to score a prompt): the prompt alone comes back."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise ValueError("suffix is not supported")
        prompt_logprobs = None  # echo with logprobs: the prompt's tokens get theirs too
        if self.echo and self.logprobs is not None:
            prompt_logprobs = max(self.logprobs, self.prompt_logprobs or 0)
        # (the prompt alone still runs one step, whose token is dropped: the engine takes max_tokens >= 1)
        max_tokens = 1 if self.prompt_only else self.max_tokens
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs)

    def beam_search_params(self, prompt_len: int, max_model_len: int) -> BeamSearchParams:
        if self.echo:
            raise ValueError("echo cannot be used with use_beam_search")
        return self._beam_search_params(self.max_tokens, self.logprobs, prompt_len, max_model_len)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"messages: content part type {part.get('type')!r} is not supported (only 'text')")
            parts.append(part.get("text", ""))
        return "".join(parts)

    def as_dict(self) -> dict[str, str]:
        """The message as a chat template takes it (role, text content)."""
        return {"role": self.role, "content": self.text()}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)

    def beam_search_params(self, prompt_len: int, max_model_len: int) -> BeamSearchParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._beam_search_params(max_tokens, 0 if self.logprobs else None, prompt_len, max_model_len)


class GenerateRequest(BaseModel):
    prompt: str
    temperature: float = 1.0
    max_tokens: int | None = 16


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


ErrorType = Literal["invalid_request_error", "authentication_error", "not_found_error", "internal_error"]


def error_body(message: str, type_: ErrorType, code: int, param: str | None = None) -> dict:
    """OpenAI's error JSON shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
