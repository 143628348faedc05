"""Request guards: body size limit (413) and bearer-token check (401), both pure ASGI middleware."""
from __future__ import annotations

import hmac
import json

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagellm.entrypoints.openai.protocol import error_body


class BodySizeLimit:
    """Pure ASGI middleware: refuse bodies over ``max_bytes`` with 413, by Content-Length or while streaming."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._reject(send)
        seen = 0
        too_large = started = False

        # Past the limit the app is told the client left, and whatever it answers to that (FastAPI turns any
        # error while reading the body into its own 400) is dropped in favour of our 413. Raising from receive()
        # would not do: FastAPI catches exceptions raised while it reads the body.
        async def limited_receive() -> Message:
            nonlocal seen, too_large
            if too_large:
                return {"type": "http.disconnect"}
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    too_large = True
                    return {"type": "http.disconnect"}
            return msg

        async def guarded_send(msg: Message) -> None:
            nonlocal started
            if too_large and not started:
                return
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not too_large or started:
                raise
        if too_large and not started:
            await self._reject(send)

    async def _reject(self, send: Send) -> None:
        body = json.dumps(error_body(f"request body larger than {self.max_bytes} bytes", "invalid_request_error",
                                     413)).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def check_api_key(request: Request, api_key: str) -> bool:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


class ApiKeyAuth:
    """Pure ASGI middleware: ``/v1`` routes need ``Authorization: Bearer KEY`` (401 otherwise).

    Pure ASGI rather than ``@app.middleware("http")``: BaseHTTPMiddleware wraps ``receive`` so that
    ``Request.is_disconnected()`` never sees the client leave, and non-streaming requests would run on for a
    client that is gone.
    """

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and self.api_key and scope["path"].startswith("/v1")
                and not check_api_key(Request(scope), self.api_key)):
            response = JSONResponse(error_body("Invalid or missing API key", "authentication_error", 401), 401)
            return await response(scope, receive, send)
        await self.app(scope, receive, send)
