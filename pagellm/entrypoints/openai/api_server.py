"""``pagellm serve``: FastAPI + uvicorn, OpenAI-compatible routes over the async engine."""
from __future__ import annotations

import asyncio
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagellm import __version__
from pagellm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagellm.entrypoints.chat_utils import render_chat
from pagellm.entrypoints.openai.limits import ApiKeyAuth, BodySizeLimit
from pagellm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                 GenerateRequest, TokenizeRequest, error_body)
from pagellm.entrypoints.openai.serving import (OpenAIServing, _Choice, chat_logprobs, completion_logprobs, now,
                                                prompt_logprobs_json, sse)
from pagellm.sampling_params import SamplingParams

logger = logging.getLogger("pagellm")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def _param_of(message: str) -> str | None:
    """Our ValueErrors start with the offending field's name ("top_p must be ...")."""
    word = message.split(" ", 1)[0].rstrip(":")
    return word if word.isidentifier() else None


def build_app(engine: AsyncLLMEngine, model_name: str, api_key: str | None = None,
              max_body_bytes: int = 4 * 2**20) -> FastAPI:
    app = FastAPI(title="pagellm", version=__version__)
    serving = OpenAIServing(engine, model_name)
    app.state.engine = engine
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    app.add_middleware(ApiKeyAuth, api_key=api_key)  # added last = outermost: 401 before 413

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return JSONResponse(error_body(e.message, e.type, e.status, e.param), e.status)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_, e: EngineDeadError):
        return JSONResponse(error_body(str(e), "internal_error", 503), 503)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in err.get("loc", []) if x != "body"]
        param = ".".join(loc) or None
        return JSONResponse(error_body(f"{param or 'body'}: {err.get('msg', 'invalid request')}",
                                       "invalid_request_error", 400, param), 400)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "not_found_error", "model")

    def warn_ignored(req) -> None:
        if req.model_extra:  # (as vLLM: a client sending fields this server lacks should find out from its log)
            logger.warning("The following fields were present in the request but ignored: %s", sorted(req.model_extra))

    def to_400(e: ValueError) -> APIError:
        return APIError(400, str(e), param=_param_of(str(e)))

    # ------------------------------------------------------------------ simple routes
    @app.get("/health")
    async def health():
        return Response(status_code=200 if engine.is_alive else 503)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": now(),
                                            "owned_by": "pagellm", "root": model_name,
                                            "max_model_len": engine.engine.config.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        check_model(req.model)
        tok = engine.tokenizer
        if req.messages is not None:
            try:
                text = render_chat(tok, [m.as_dict() for m in req.messages], req.add_generation_prompt)
            except ValueError as e:
                raise to_400(e) from None
            ids = tok.encode(text, add_special_tokens=False)
        elif req.prompt is not None:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise APIError(400, "give prompt or messages", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.engine.config.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        check_model(req.model)
        vocab = engine.engine.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"tokens: ids must be in [0, {vocab})", param="tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    @app.post("/generate")
    async def generate(req: GenerateRequest, raw: Request):
        try:
            params = SamplingParams(temperature=req.temperature, max_tokens=req.max_tokens)
            choices = await collect(raw, serving.run([(req.prompt, None)], params, 1), serving.choices(1, 1, params),
                                    0)
        except ValueError as e:
            raise to_400(e) from None
        return {"text": choices[0].text}

    # ------------------------------------------------------------------ OpenAI routes
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        check_model(req.model)
        warn_ignored(req)
        try:
            if req.best_of is not None and req.best_of != req.n:
                raise ValueError(f"best_of must equal n ({req.n}) for now, got {req.best_of}")
            params = req.sampling_params()
            prompts = serving.completion_prompts(req)
            if not 1 <= req.n <= 16:
                raise ValueError(f"n must be in [1, 16], got {req.n}")
            gen = (serving.run_beams(prompts, req, req.cache_salt) if req.use_beam_search else
                   serving.run(prompts, params, req.n, req.cache_salt))
            choices = serving.choices(len(prompts) * req.n, req.n, params, req.echo, req.prompt_only)
            hold = max((len(s) for s in params.stop), default=1) - 1
            if req.stream:
                return await stream_response(raw, gen, choices, hold, completion_chunk, req)
            choices = await collect(raw, gen, choices, hold)
        except ValueError as e:
            raise to_400(e) from None
        body = {"id": f"cmpl-{_id()}", "object": "text_completion", "created": now(), "model": model_name,
                "choices": [{"index": c.index, "text": (c.prompt_text or "") + c.text, "finish_reason": c.finish_reason,
                             "stop_reason": c.stop_reason,
                             "logprobs": completion_logprobs(c, 0, len(c.token_ids), 0, req.echo, req.logprobs)
                             if req.logprobs is not None else None,
                             "prompt_logprobs": prompt_logprobs_json(c.prompt_logprobs)
                             if req.prompt_logprobs is not None else None} for c in choices],
                "usage": serving.usage(choices, [len(c.prompt_ids) for c in choices[::req.n]])}
        return body

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request):
        check_model(req.model)
        warn_ignored(req)
        try:
            params = req.sampling_params()
            if not 1 <= req.n <= 16:
                raise ValueError(f"n must be in [1, 16], got {req.n}")
            prompts = [(None, serving.chat_prompt(req)[1])]
            gen = (serving.run_beams(prompts, req, req.cache_salt) if req.use_beam_search else
                   serving.run(prompts, params, req.n, req.cache_salt))
            choices = serving.choices(req.n, req.n, params)
            hold = max((len(s) for s in params.stop), default=1) - 1
            if req.stream:
                return await stream_response(raw, gen, choices, hold, chat_chunk, req)
            choices = await collect(raw, gen, choices, hold)
        except ValueError as e:
            raise to_400(e) from None
        top = req.top_logprobs or 0
        return {"id": f"chatcmpl-{_id()}", "object": "chat.completion", "created": now(), "model": model_name,
                "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                             "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                             "logprobs": chat_logprobs(c, 0, len(c.token_ids), top) if req.logprobs else None}
                            for c in choices],
                "prompt_logprobs": prompt_logprobs_json(choices[0].prompt_logprobs)
                if req.prompt_logprobs is not None else None,
                "usage": serving.usage(choices, [len(choices[0].prompt_ids)])}

    # ------------------------------------------------------------------ helpers
    async def collect(raw: Request, gen, choices: list[_Choice], hold: int) -> list[_Choice]:
        """Run to completion; a client that disconnects meanwhile gets its requests aborted."""

        async def consume():
            async for i, out in gen:
                serving.update(choices[i], out, 0)

        task = asyncio.create_task(consume())
        while not task.done():
            await asyncio.wait([task], timeout=0.5)
            if not task.done() and await raw.is_disconnected():
                # Cancelling the consumer closes gen inside it (aborting its requests); gen.aclose() from here
                # would fail with "asynchronous generator is already running".
                task.cancel()
                await asyncio.wait([task])
                raise APIError(499, "client disconnected")
        task.result()
        for c in choices:  # (a choice whose lead's prompt logprobs came after its own last output)
            serving.take_lead(c)
        return choices

    def completion_chunk(rid, c: _Choice, text: str, tok_start: int, req) -> dict:
        with_prompt = c.echo and not c.echo_sent  # echo: the prompt leads the choice's first chunk
        if with_prompt:
            text, c.echo_sent = c.prompt_text + text, True
        lp = (completion_logprobs(c, tok_start, len(c.token_ids), c.sent_text, with_prompt, req.logprobs)
              if req.logprobs is not None else None)
        return {"id": rid, "object": "text_completion", "created": now(), "model": model_name,
                "choices": [{"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                             "stop_reason": c.stop_reason}]}

    def chat_chunk(rid, c: _Choice, text: str, tok_start: int, req) -> dict:
        delta = {"role": "assistant", "content": text} if tok_start == 0 else {"content": text}
        lp = chat_logprobs(c, tok_start, len(c.token_ids), req.top_logprobs or 0) if req.logprobs else None
        return {"id": rid, "object": "chat.completion.chunk", "created": now(), "model": model_name,
                "choices": [{"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": c.finish_reason,
                             "stop_reason": c.stop_reason}]}

    async def stream_response(raw: Request, gen, choices: list[_Choice], hold: int, make_chunk,
                              req) -> StreamingResponse:
        # Wait for the first output so a bad request still gets a proper 400 instead of a 200 stream; a client that
        # leaves meanwhile (a beam search's first output comes when it ends) has its requests aborted.
        task = asyncio.ensure_future(gen.__anext__())
        while not task.done():
            await asyncio.wait([task], timeout=0.5)
            if not task.done() and await raw.is_disconnected():
                task.cancel()  # (inside gen: its requests are aborted)
                await asyncio.wait([task])
                raise APIError(499, "client disconnected")
        first = task.result()
        rid = f"{'chatcmpl' if make_chunk is chat_chunk else 'cmpl'}-{_id()}"
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunks(c: _Choice):
            """c's new text and tokens, if any (c no longer waits on its lead: serving.released)."""
            text, tok_start = c.text[c.sent_text:], c.sent_tokens
            if text or c.finish_reason or len(c.token_ids) > c.sent_tokens:
                chunk = make_chunk(rid, c, text, tok_start, req)
                c.sent_text, c.sent_tokens = len(c.text), len(c.token_ids)
                yield sse(chunk)

        async def body():
            try:
                item = first
                while item is not None:
                    i, out = item
                    c = choices[i]
                    serving.update(c, out, hold)
                    for ready in serving.released(choices, i, req.n):
                        for chunk in chunks(ready):
                            yield chunk
                    item = await anext(gen, None)
                for c in choices:  # (none waits by now: a lead's first output carries its prompt logprobs)
                    if c.waiting:
                        c.lead = None  # send what it has, without the prompt's logprobs, rather than nothing
                        for chunk in chunks(c):
                            yield chunk
                if include_usage:
                    yield sse({"id": rid, "object": "chat.completion.chunk" if make_chunk is chat_chunk
                               else "text_completion", "created": now(), "model": model_name, "choices": [],
                               "usage": serving.usage(choices, [len(c.prompt_ids) for c in choices[::req.n]])})
                yield sse("[DONE]")
            finally:
                await gen.aclose()  # client gone or done: abort whatever still runs

        return StreamingResponse(body(), media_type="text/event-stream")

    return app


def _id() -> str:
    return f"{time.time_ns():x}"


__all__ = ["build_app", "APIError", "EngineDeadError"]
