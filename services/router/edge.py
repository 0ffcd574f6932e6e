"""The router's HTTP edge: auth, body limits, content types, SSE and OpenAI error bodies.

Everything here runs before or around a route: `GuardMiddleware` rejects unauthenticated
/v1/* calls (401) and oversized bodies (413) before any parsing; `require_json` rejects other
content types (415); `install_error_handlers` turns every TplaError, validation error and
routing error into an OpenAI error body; `SSEResponse` guarantees its pipeline is closed.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import anyio
import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.runtime.errors import (
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    TplaError,
    Unauthorized,
    Unavailable,
    UnsupportedMediaType,
)

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
RETRY_AFTER_S = 1


def error_response(exc: TplaError, headers: dict[str, str] | None = None) -> JSONResponse:
    if isinstance(exc, Overloaded):
        headers = {**(headers or {}), "Retry-After": str(RETRY_AFTER_S)}
    return JSONResponse(exc.openai_body(), status_code=exc.http_status, headers=headers)


class GuardMiddleware:
    """Before any route: API-key check on /v1/* and /admin/* (401) and the body limit (413)."""

    def __init__(self, app: ASGIApp, api_keys: tuple[bytes, ...], max_body: int) -> None:
        self.app, self.max_body = app, max_body
        # Digests, not keys: equal-length values to compare, so timing reveals not even a
        # key's length, and the keys themselves are not kept in this object.
        self._key_digests = tuple(hashlib.sha256(k).digest() for k in api_keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        # Admin endpoints expose request records and worker pids: same keys as the API.
        protected = scope["path"].startswith(("/v1/", "/admin/"))
        if self._key_digests and protected and not self._authorized(headers):
            err = Unauthorized("missing or invalid API key", code="invalid_api_key")
            challenge = {"WWW-Authenticate": "Bearer"}
            return await error_response(err, challenge)(scope, receive, send)
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
        digest = hashlib.sha256(key.strip()).digest()
        # Compare against every key without early exit: timing reveals nothing.
        ok = False
        for candidate in self._key_digests:
            ok |= hmac.compare_digest(digest, candidate)
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


# Type-mismatch errors pydantic reports for each member of a union ("not a string", "not a
# list"): when another error explains the failure better, that one is reported.
_MISMATCH_TYPES = frozenset(
    {"string_type", "list_type", "dict_type", "int_type", "float_type", "bool_type", "model_type"}
)
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _param(loc: Sequence[int | str]) -> str | None:
    # pydantic names union members in locations (`str`, `list[int]`, `function-after[...]`);
    # they are not parameter names.
    parts = [
        str(p)
        for p in loc
        if p != "body" and not (isinstance(p, str) and (p in _UNION_TAGS or "[" in p))
    ]
    return ".".join(parts) or None


def validation_error_body(exc: RequestValidationError) -> InvalidRequest:
    """The one error a client sees for a body that failed validation."""
    errors = list(exc.errors())
    if not errors:
        return InvalidRequest("invalid request")
    if errors[0].get("type") == "json_invalid":
        return InvalidRequest("request body is not valid JSON")
    best = next((e for e in errors if e.get("type") not in _MISMATCH_TYPES), errors[0])
    param = _param(best.get("loc", ()))
    msg = str(best.get("msg", "invalid request")).removeprefix("Value error, ")
    return InvalidRequest(f"{param}: {msg}" if param else msg, param=param)


def install_error_handlers(app: FastAPI) -> None:
    async def tpla_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, TplaError)
        return error_response(exc)

    async def validation_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(validation_error_body(exc))

    async def http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        headers = dict(exc.headers) if exc.headers else None  # e.g. Allow on a 405
        if exc.status_code == 404:
            return error_response(NotFound(str(exc.detail)), headers)
        if exc.status_code == 405:
            return error_response(MethodNotAllowed(str(exc.detail)), headers)
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            # Invalid UTF-8, JSON nested too deeply, a number too long to parse.
            return error_response(
                InvalidRequest("request body is not valid UTF-8 JSON (or is nested too deeply)")
            )
        return error_response(InvalidRequest(str(exc.detail)), headers)

    async def redis_error(_: Request, exc: Exception) -> JSONResponse:
        # Request records live in Redis: while it is unreachable (or refuses our password)
        # that is an unavailable dependency, not a bug in the router.
        log.warning("Redis error in the router: %s", exc)
        return error_response(Unavailable(f"request store unavailable ({type(exc).__name__})"))

    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in the router", exc_info=exc)
        return error_response(TplaError(f"internal error: {type(exc).__name__}"))

    app.add_exception_handler(TplaError, tpla_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(redis.RedisError, redis_error)
    app.add_exception_handler(Exception, unexpected)
