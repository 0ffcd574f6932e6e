"""The shared internal token on gRPC calls: one check for every internal servicer."""

from __future__ import annotations

import hmac

import grpc

from common.rpc.clients import TOKEN_METADATA_KEY


def require_token(context: grpc.ServicerContext, token: str | None) -> None:
    """Abort the call UNAUTHENTICATED unless it carries `token` (no token: no check)."""
    if not token:
        return
    got = dict(context.invocation_metadata() or ()).get(TOKEN_METADATA_KEY) or ""
    # Constant time: how long a wrong token takes to reject says nothing about the right one.
    if not hmac.compare_digest(str(got).encode(), token.encode()):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong internal token")
