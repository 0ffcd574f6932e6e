"""Typed errors and their one mapping to HTTP (OpenAI error bodies) and gRPC status codes.

Services raise these; the router's exception handler and the gRPC servicers translate them
here and nowhere else. `from_grpc` turns a peer's status back into the same type.
"""

from __future__ import annotations

from typing import Any

import grpc


class TokenizerError(ValueError):
    """A tokenizer directory or file is unusable, or chat-template input is invalid (the
    router answers the latter as InvalidRequest)."""


class GenerationConfigError(ValueError):
    """A model's generation_config.json, or the operator's TPLA_GENERATION_CONFIG, gives
    sampling defaults that cannot be used (the router refuses to start)."""


class TplaError(Exception):
    http_status = 500
    grpc_code = grpc.StatusCode.INTERNAL
    error_type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def openai_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequest(TplaError):
    http_status = 400
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    error_type = "invalid_request_error"


class RequestFailed(InvalidRequest):
    """The request's own failure while it was being served (its grammar could not go on, its
    parameters could not be applied): deterministic, it would fail the same on any worker, so
    it ends that request alone and never counts against the worker that reported it."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message, param=param, code="request_failed")


class PayloadTooLarge(InvalidRequest):
    http_status = 413


class UnsupportedMediaType(InvalidRequest):
    http_status = 415


class MethodNotAllowed(InvalidRequest):
    http_status = 405


class Unauthorized(TplaError):
    http_status = 401
    grpc_code = grpc.StatusCode.UNAUTHENTICATED
    error_type = "authentication_error"


class NotFound(TplaError):
    http_status = 404
    grpc_code = grpc.StatusCode.NOT_FOUND
    error_type = "not_found_error"


class Overloaded(TplaError):
    """Admission limits or the KV pool are full; the client should retry later."""

    http_status = 429
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    error_type = "rate_limit_error"


class Unavailable(TplaError):
    """No healthy worker, or a worker failed mid-request."""

    http_status = 503
    grpc_code = grpc.StatusCode.UNAVAILABLE
    error_type = "service_unavailable"


class TransferFailed(Unavailable):
    """A prefill worker could not push a request's KV to its decode group (the group died
    or hangs): the prefill worker is fine, the request needs another decode group."""

    grpc_code = grpc.StatusCode.ABORTED


class LocalPrefillOff(Unavailable):
    """A decode group asked to prefill a prompt itself was started without local prefill
    (TPLA_LOCAL_PREFILL_CHUNK_TOKENS=0), or predates it: the prompt goes to a prefill worker,
    and the group is not to blame."""

    grpc_code = grpc.StatusCode.UNIMPLEMENTED


class DeadlineExceeded(TplaError):
    http_status = 504
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
    error_type = "timeout_error"


_BY_GRPC = {
    cls.grpc_code: cls
    for cls in (
        InvalidRequest,
        Unauthorized,
        NotFound,
        Overloaded,
        Unavailable,
        TransferFailed,
        LocalPrefillOff,
        DeadlineExceeded,
    )
}


def from_grpc(exc: grpc.RpcError) -> TplaError:
    """A peer's gRPC failure as our typed error (connection failures become Unavailable)."""
    # Every RpcError a stub raises (sync or aio) is also a Call carrying code and details.
    code = exc.code()  # type: ignore[attr-defined]
    details = exc.details()  # type: ignore[attr-defined]
    cls = _BY_GRPC.get(code, Unavailable if code is grpc.StatusCode.CANCELLED else TplaError)
    return cls(details or code.name)
