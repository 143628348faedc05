"""``pagellm serve [MODEL]``: build the async engine and run the OpenAI-compatible server with uvicorn."""
from __future__ import annotations

import argparse
import logging
import os

logger = logging.getLogger("pagellm")


def add_parser(sub, engine_args) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("model_tag", nargs="?", default=None, help="HF checkpoint dir or .gguf (default model if omitted)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=os.environ.get("PAGELLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes")
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--max-body-bytes", type=int, default=4 * 2**20)
    s.add_argument("--log-interval", type=float, default=5.0, help="seconds between stats log lines while busy")
    s.add_argument("--no-idle-prefault", dest="idle_prefault", action="store_false",
                   help="CPU: leave the KV cache's blocks past --kv-cache-prefault to map on first use (by default "
                        "the server maps them while no request runs, so steps take no page faults in them)")
    engine_args(s)
    s.set_defaults(func=cmd_serve)


def served_name(model: str | None) -> str:
    from pagellm.model_executor.default_model import DEFAULT_MODEL_NAME

    return DEFAULT_MODEL_NAME if model is None else model


def cmd_serve(a: argparse.Namespace) -> None:
    import uvicorn

    from pagellm.config import EngineConfig
    from pagellm.engine.async_engine import AsyncLLMEngine
    from pagellm.entrypoints.cli import engine_kwargs
    from pagellm.entrypoints.openai.api_server import build_app

    kwargs = engine_kwargs(a)
    if a.model_tag is not None:
        kwargs["model"] = a.model_tag
    engine = AsyncLLMEngine(EngineConfig(**kwargs), log_interval_s=a.log_interval, prefault_when_idle=a.idle_prefault)
    name = a.served_model_name or served_name(kwargs["model"])
    app = build_app(engine, name, api_key=a.api_key, max_body_bytes=a.max_body_bytes)
    base = f"http://{a.host}:{a.port}"
    logger.info("serving %s at %s/v1 — try:\n  curl %s/v1/chat/completions -H 'Content-Type: application/json' "
                "-d '{\"model\": \"%s\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}]}'",
                name, base, base, name)
    try:
        uvicorn.run(app, host=a.host, port=a.port, log_level="info", timeout_keep_alive=30)
    finally:
        engine.shutdown()
