"""What every HTTP request passes through before its route: a request id, the body cap, and the
one answer to an unexpected error.

- Every response carries `X-Request-ID: req_<24 hex>`, made here (never taken from the client,
  whose value could forge or collide with log lines).
- Every body is capped (413 `request_too_large`): a declared Content-Length over the route's
  cap is refused before a byte is read, and a body streamed without one is counted as the
  route reads it (`BODY_LIMITS`; `api.deps.read_body` applies the same caps with advice).
  Routes that take no body get `NO_BODY_BYTES`.
- An exception no handler knows (a bug, a database that went away mid-request) is logged once,
  with the request id, method, path and traceback, on `uvicorn.error` (the server's log), and
  answered 500 with the service's error body naming the same request id, so a user's report leads
  to the log line. Nothing of the exception reaches the client.
"""

from __future__ import annotations

import json
import logging
import secrets

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import PayloadTooLarge
from harvest.errors import HarvestError

__all__ = ["RequestGuard", "BODY_LIMITS", "NO_BODY_BYTES", "body_limit", "REQUEST_ID_HEADER"]

log = logging.getLogger("uvicorn.error")

REQUEST_ID_HEADER = "X-Request-ID"
MAX_HARVEST_BODY_BYTES = 50 * 1024 * 1024
"""A harvest body over 50 MB is refused with 413."""
INLINE_MAX_BODY_BYTES = 8 * 1024 * 1024
"""A completion's body: a prompt of 128k token ids is ~1 MB of JSON; 8 MB leaves room."""
NO_BODY_BYTES = 64 * 1024
"""Routes that read no body: anything bigger is refused rather than carried."""

BODY_LIMITS = {
    ("POST", "/v1/harvest"): MAX_HARVEST_BODY_BYTES,
    ("POST", "/v1/completions"): INLINE_MAX_BODY_BYTES,
    ("POST", "/v1/chat/completions"): INLINE_MAX_BODY_BYTES,
}


def body_limit(method: str, path: str) -> int:
    return BODY_LIMITS.get((method, path.rstrip("/") or "/"), NO_BODY_BYTES)


def too_large(limit: int, advice: str = "") -> PayloadTooLarge:
    size = f"{limit // (1024 * 1024)} MB" if limit >= 1024 * 1024 else f"{limit // 1024} KB"
    return PayloadTooLarge(f"The request body is over this route's limit of {size}.{' ' + advice if advice else ''}")


class RequestGuard:
    """Pure ASGI middleware (inside Starlette's ServerErrorMiddleware, outside the routes)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = "req_" + secrets.token_hex(12)
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                MutableHeaders(scope=message).append(REQUEST_ID_HEADER, request_id)
            await send(message)

        limit = body_limit(scope["method"], scope["path"])
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            await _answer(send_with_id, too_large(limit))
            return

        received = 0

        async def capped_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise too_large(limit)
            return message

        try:
            await self.app(scope, capped_receive, send_with_id)
        except Exception as exc:
            if started:  # the answer is half sent: nothing to do but log it and drop the connection
                log.exception("request %s %s %s failed after its answer began", request_id, scope["method"], scope["path"])
                raise
            if isinstance(exc, HarvestError) and exc.status < 500:
                await _answer(send_with_id, exc)  # e.g. a cap crossed while reading outside a route
                return
            log.error("request %s %s %s failed: unexpected error", request_id, scope["method"], scope["path"], exc_info=exc)
            await _answer(send_with_id, HarvestError(
                f"The server had an error while processing your request. If it persists, show us request id {request_id}."
            ))


async def _answer(send: Send, error: HarvestError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
