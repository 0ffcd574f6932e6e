"""The router's HTTP edge: auth, body limits, content types, SSE and OpenAI error bodies.

Everything here runs before or around a route: `GuardMiddleware` rejects unauthenticated
/v1/* calls (401) and oversized bodies (413) before any parsing; `require_json` rejects other
content types (415); `install_error_handlers` turns every TplaError, validation error and
routing error into an OpenAI error body; `SSEResponse` guarantees its pipeline is closed.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.errors import (
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    TplaError,
    Unauthorized,
    UnsupportedMediaType,
)

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
RETRY_AFTER_S = 1


def error_response(exc: TplaError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if isinstance(exc, Overloaded) else None
    return JSONResponse(exc.openai_body(), status_code=exc.http_status, headers=headers)


class GuardMiddleware:
    """Before any route: API-key check on /v1/* and /admin/* (401) and the body limit (413)."""

    def __init__(self, app: ASGIApp, api_keys: tuple[bytes, ...], max_body: int) -> None:
        self.app, self.api_keys, self.max_body = app, api_keys, max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        # Admin endpoints expose request records and worker pids: same keys as the API.
        protected = scope["path"].startswith(("/v1/", "/admin/"))
        if self.api_keys and protected and not self._authorized(headers):
            err = Unauthorized("missing or invalid API key", code="invalid_api_key")
            return await error_response(err)(scope, receive, send)
        too_large = PayloadTooLarge(
            f"request body exceeds {self.max_body} bytes", code="body_too_large"
        )
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit() or int(length) > self.max_body:
                return await error_response(too_large)(scope, receive, send)
            return await self.app(scope, receive, send)
        # No content-length (chunked): buffer up to the limit, then replay the body.
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            body += message.get("body", b"")
            if len(body) > self.max_body:
                return await error_response(too_large)(scope, receive, send)
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)

    def _authorized(self, headers: dict[str, bytes]) -> bool:
        scheme, _, key = headers.get("authorization", b"").partition(b" ")
        # Compare against every key without early exit: timing reveals nothing.
        ok = False
        for candidate in self.api_keys:
            ok |= hmac.compare_digest(key.strip(), candidate)
        return ok and scheme.lower() == b"bearer"


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its pipeline, even if the body never starts."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(
            body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_close()


async def require_json(request: Request) -> None:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json" and not ctype.endswith("+json"):
        raise UnsupportedMediaType(
            "Content-Type must be application/json", code="unsupported_media_type"
        )


def install_error_handlers(app: FastAPI) -> None:
    async def tpla_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, TplaError)
        return error_response(exc)

    async def validation_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return error_response(InvalidRequest("request body is not valid JSON"))
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        param = ".".join(loc) or None
        text = f"{param}: {msg}" if param else msg
        return error_response(InvalidRequest(text, param=param))

    async def http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            return error_response(NotFound(str(exc.detail)))
        if exc.status_code == 405:
            return error_response(MethodNotAllowed(str(exc.detail)))
        return error_response(InvalidRequest(str(exc.detail)))

    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in the router", exc_info=exc)
        return error_response(TplaError(f"internal error: {type(exc).__name__}"))

    app.add_exception_handler(TplaError, tpla_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
