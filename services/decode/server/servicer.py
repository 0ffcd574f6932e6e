"""The Decode gRPC servicer: protocol types in, engine calls, protocol types out.

The engine (services/decode/engine.py) holds all the logic; an engine error becomes its typed
status (common/runtime/errors.py) here, in one place.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import TypeVar

import grpc

from common.kv.block_pool import OutOfBlocks
from common.rpc.auth import require_token
from common.rpc.convert import (
    load_to_pb,
    params_from_pb,
    reservation_to_pb,
    resumed_from_pb,
    token_from_pb,
    token_to_pb,
)
from common.rpc.gen import common_pb2, decode_pb2, decode_pb2_grpc
from common.runtime.errors import InvalidRequest, Overloaded, TplaError, Unavailable
from common.sampling.params import SamplingError
from services.decode.engine import DecodeEngine
from services.decode.leader.scheduler import SchedulerError
from services.decode.stream import EngineError

T = TypeVar("T")


def as_tpla_error(exc: Exception) -> TplaError:
    """Engine exceptions as the typed errors that map to gRPC codes in one place."""
    if isinstance(exc, TplaError):
        return exc
    if isinstance(exc, OutOfBlocks):
        return Overloaded(f"KV cache full: {exc}")
    if isinstance(exc, SchedulerError | SamplingError | ValueError):
        return InvalidRequest(str(exc))
    if isinstance(exc, EngineError):
        return Unavailable(str(exc))
    return TplaError(str(exc))


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, engine: DecodeEngine, token: str | None = None) -> None:
        self.engine = engine
        self.token = token

    def _guard(self, context: grpc.ServicerContext) -> None:
        require_token(context, self.token)

    def _call(self, context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
        """Check the caller, run an engine call; any failure aborts with its typed status."""
        self._guard(context)
        try:
            return fn()
        except Exception as exc:  # every failure becomes a typed status
            err = as_tpla_error(exc)
            context.abort(err.grpc_code, err.message)
            raise  # unreachable: abort raises; kept so the type checker sees no fall-through

    def Reserve(
        self, request: decode_pb2.ReserveRequest, context: grpc.ServicerContext
    ) -> decode_pb2.ReserveResponse:
        res = self._call(
            context,
            lambda: self.engine.reserve(
                request.request_id,
                request.prompt_len,
                request.max_tokens,
                request.prompt_ids,
                request.n or 1,
            ),
        )
        return reservation_to_pb(res)

    def Generate(
        self, request: decode_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[decode_pb2.GenerateEvent]:
        rid = request.request_id
        firsts = list(request.first_tokens) or [request.first_token]
        stream = self._call(
            context,
            lambda: self.engine.generate(
                rid,
                [token_from_pb(t).token_id for t in firsts],
                params_from_pb(request.params),
                prompt_ids=request.prompt_ids,
                output_ids=request.output_ids,
                resumed=[resumed_from_pb(c) for c in request.resumed],
            ),
        )
        # A client that goes away (router abort, disconnect) frees the request's blocks.
        context.add_callback(lambda: self._abort_quietly(rid))
        for event in stream:
            msg = decode_pb2.GenerateEvent(
                finish_reason=event.finish_reason or "", index=event.index
            )
            if event.token is not None:
                msg.token.CopyFrom(token_to_pb(event.token))
            yield msg

    def _abort_quietly(self, request_id: str) -> None:
        # The group may be gone; its requests then already ended with an error.
        with contextlib.suppress(EngineError):
            self.engine.abort(request_id)

    def Abort(
        self, request: decode_pb2.AbortRequest, context: grpc.ServicerContext
    ) -> decode_pb2.AbortResponse:
        choices = frozenset(request.choices) or None
        found = self._call(context, lambda: self.engine.abort(request.request_id, choices))
        return decode_pb2.AbortResponse(found=found)

    def GetLoad(
        self, request: common_pb2.Empty, context: grpc.ServicerContext
    ) -> decode_pb2.DecodeLoad:
        load = self._call(context, self.engine.load)
        par = self.engine.cfg.parallel
        layout = {"tp": par.tp, "latent_groups": par.latent_groups, "parallel": par.name}
        return load_to_pb(dataclasses.replace(load, **layout))
