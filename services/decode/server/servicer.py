"""The Decode gRPC servicer: protocol types in, engine calls, protocol types out.

The engine (services/decode/engine.py) holds all the logic; an engine error becomes its typed
status (common/runtime/errors.py) here, in one place.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future
from typing import TypeVar

import grpc
from opentelemetry.trace import SpanKind

from common.kv.block_pool import OutOfBlocks
from common.messages import PrefillResult
from common.rpc.aborted import call_error
from common.rpc.auth import require_token
from common.rpc.gen import common_pb2, decode_pb2, decode_pb2_grpc
from common.rpc.prefill_limits import check_prefill
from common.rpc.proto_mapping import (
    event_to_pb,
    load_to_pb,
    params_from_pb,
    reservation_to_pb,
    result_to_pb,
    resumed_from_pb,
    token_from_pb,
)
from common.runtime.errors import (
    DeadlineExceeded,
    InvalidRequest,
    Overloaded,
    TplaError,
    Unavailable,
)
from common.runtime.spans import Parent, Spans, end
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
    def __init__(
        self, engine: DecodeEngine, token: str | None = None, spans: Spans | None = None
    ) -> None:
        self.engine = engine
        self.token = token
        # The leader's spans: one per Reserve, one per Generate stream (none per token).
        self.spans = spans or Spans()

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
        if not self.spans.on:
            return self._reserve(request, context)
        attributes = {
            "tpla.request_id": request.request_id,
            "tpla.prompt_tokens": request.prompt_len,
            "tpla.max_tokens": request.max_tokens,
            "tpla.n": request.n or 1,
        }
        span = self.spans.start("reserve", self._parent(context), attributes, kind=SpanKind.SERVER)
        try:
            res = self._reserve(request, context)
        except BaseException as exc:
            end(span, error=call_error(context, exc))
            raise
        end(span, {"tpla.cached_tokens": res.cached_tokens})
        return res

    def _parent(self, context: grpc.ServicerContext) -> Parent:
        return self.spans.parent_from(context.invocation_metadata() or ())

    def _reserve(
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

    def Prefill(
        self, request: decode_pb2.LocalPrefillRequest, context: grpc.ServicerContext
    ) -> common_pb2.PrefillResponse:
        """The reserved prompt prefilled here (DecodeEngine.prefill), within the request's
        deadline; a caller that goes away drops it between its pieces."""
        if not self.spans.on:
            return self._prefill(request, context)
        attributes = {
            "tpla.request_id": request.request_id,
            "tpla.prompt_tokens": len(request.prompt_ids),
            "tpla.n": request.n or 1,
        }
        span = self.spans.start(
            "local_prefill", self._parent(context), attributes, kind=SpanKind.SERVER
        )
        try:
            res = self._prefill(request, context)
        except BaseException as exc:
            end(span, error=call_error(context, exc))
            raise
        end(span, {"tpla.cached_tokens": res.cached_tokens})
        return res

    def _prefill(
        self, request: decode_pb2.LocalPrefillRequest, context: grpc.ServicerContext
    ) -> common_pb2.PrefillResponse:
        n = request.n or 1
        scored = request.prompt_logprobs if request.HasField("prompt_logprobs") else None

        def submit() -> Future[PrefillResult]:
            check_prefill(n, scored)
            return self.engine.prefill(
                request.request_id,
                list(request.prompt_ids),
                params_from_pb(request.params),
                n,
                request.num_output_tokens,
                scored,
            )

        pending = self._call(context, submit)
        context.add_callback(pending.cancel)
        try:
            result = pending.result(timeout=request.deadline_seconds or 60.0)
        except CancelledError:
            context.abort(grpc.StatusCode.CANCELLED, f"the prefill of {request.request_id} ended")
        except TimeoutError:
            err: TplaError = DeadlineExceeded(f"prefill of {request.request_id} timed out")
            context.abort(err.grpc_code, err.message)
        except Exception as exc:  # its own error, or the group's
            err = as_tpla_error(exc)
            context.abort(err.grpc_code, err.message)
        finally:
            pending.cancel()
        return result_to_pb(result)

    def Generate(
        self, request: decode_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[decode_pb2.GenerateEvents]:
        if not self.spans.on:
            yield from self._generate(request, context)
            return
        attributes = {
            "tpla.request_id": request.request_id,
            "tpla.choices": max(len(request.first_tokens), 1),
            "tpla.earlier_tokens": len(request.output_ids),
        }
        span = self.spans.start("generate", self._parent(context), attributes, kind=SpanKind.SERVER)
        tokens, reasons, error = 0, [], None
        try:
            for msg in self._generate(request, context):
                for event in msg.events:
                    tokens += event.HasField("token")
                    if event.finish_reason:
                        reasons.append(event.finish_reason)
                yield msg
        except BaseException as exc:
            error = exc
            raise
        finally:
            done = {"tpla.tokens": tokens, "tpla.finish_reasons": tuple(reasons)}
            end(span, done, error=call_error(context, error))

    def _generate(
        self, request: decode_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[decode_pb2.GenerateEvents]:
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
                hidden=tuple(request.hidden) or None,
            ),
        )
        # A client that goes away (router abort, disconnect) frees the request's blocks.
        context.add_callback(lambda: self._abort_quietly(rid))
        for ready in stream.batches():
            yield decode_pb2.GenerateEvents(events=[event_to_pb(e) for e in ready])

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
