"""The error a sync servicer's call ended with, read back from the status it aborted with.

`context.abort` raises a bare Exception; a span that records the call's failure wants the
status the servicer chose (its code and message), not that.
"""

from __future__ import annotations

import grpc

from common.runtime.errors import TplaError


def call_error(context: grpc.ServicerContext, raised: BaseException | None) -> BaseException | None:
    """The error the call ended with: the aborted status as a TplaError, else `raised`."""
    if raised is None:
        return None
    details = context.details()
    if not details:
        return raised
    message = details.decode() if isinstance(details, bytes) else str(details)
    code = context.code()
    name = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
    return TplaError(f"{name}: {message}")
