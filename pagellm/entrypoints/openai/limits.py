"""Request guards: body size limit (413) and bearer-token check."""
from __future__ import annotations

import hmac
import json

from starlette.requests import Request
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

        async def limited_receive() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge()
            return msg

        try:
            await self.app(scope, limited_receive, send)
        except _TooLarge:
            await self._reject(send)

    async def _reject(self, send: Send) -> None:
        body = json.dumps(error_body(f"request body larger than {self.max_bytes} bytes", "invalid_request_error",
                                     413)).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


def check_api_key(request: Request, api_key: str) -> bool:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())
