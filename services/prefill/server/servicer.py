"""The Prefill gRPC servicer: protocol types in, worker calls, protocol types out.

The worker (services/prefill/worker.py) does the work; a worker error becomes its typed
status (common/runtime/errors.py) here, in one place. A prefill runs inside the worker's
drain gate: once the worker drains, new ones are turned away (a router tries another worker)
while those inside run to their last KV push.
"""

from __future__ import annotations

from concurrent.futures import CancelledError

import grpc
from opentelemetry.trace import SpanKind

from common.kv.transfer import TransferError
from common.rpc.aborted import call_error
from common.rpc.auth import require_token
from common.rpc.drain import DrainGate
from common.rpc.gen import common_pb2, prefill_pb2, prefill_pb2_grpc
from common.rpc.prefill_limits import check_prefill
from common.rpc.proto_mapping import params_from_pb, reservation_from_pb, result_to_pb
from common.runtime.errors import (
    DeadlineExceeded,
    InvalidRequest,
    TplaError,
    TransferFailed,
    Unavailable,
)
from common.runtime.spans import Spans, end
from services.prefill.batch.job import PrefillJob
from services.prefill.batch.job_trace import JobTrace
from services.prefill.worker import PrefillWorker


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(
        self,
        worker: PrefillWorker,
        token: str | None = None,
        spans: Spans | None = None,
        gate: DrainGate | None = None,
    ) -> None:
        self.worker = worker
        self.token = token
        self.spans = spans or Spans()
        # Closed when the worker drains: a prefill inside it runs to its last KV push.
        self.gate = gate or DrainGate("the prefill worker")

    def _guard(self, context: grpc.ServicerContext) -> None:
        require_token(context, self.token)

    def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.ServicerContext
    ) -> common_pb2.PrefillResponse:
        if not self.spans.on:
            return self._prefill(request, context, None)
        parent = self.spans.parent_from(context.invocation_metadata() or ())
        attributes = {
            "tpla.request_id": request.request_id,
            "tpla.prompt_tokens": len(request.prompt_ids),
            "tpla.n": request.n or 1,
        }
        span = self.spans.start("prefill", parent, attributes, kind=SpanKind.SERVER)
        trace, error = JobTrace(), None
        try:
            return self._prefill(request, context, trace)
        except BaseException as exc:
            error = exc
            raise
        finally:
            trace.record(self.spans, span)
            end(span, error=call_error(context, error))

    def _prefill(
        self,
        request: prefill_pb2.PrefillRequest,
        context: grpc.ServicerContext,
        trace: JobTrace | None,
    ) -> common_pb2.PrefillResponse:
        self._guard(context)
        try:
            self.gate.enter()
        except Unavailable as exc:
            context.abort(exc.grpc_code, exc.message)
        try:
            return self._run(request, context, trace)
        finally:
            self.gate.leave()

    def _run(
        self,
        request: prefill_pb2.PrefillRequest,
        context: grpc.ServicerContext,
        trace: JobTrace | None,
    ) -> common_pb2.PrefillResponse:
        deadline = request.deadline_seconds or 60.0
        try:
            job = PrefillJob(
                request.request_id,
                list(request.prompt_ids),
                params_from_pb(request.params),
                reservation_from_pb(request.reservation),
                deadline,
                request.num_output_tokens,
                n=request.n or 1,
                prompt_logprobs=(
                    request.prompt_logprobs if request.HasField("prompt_logprobs") else None
                ),
                trace=trace,
            )
            check_prefill(job.n, job.prompt_logprobs)
            if not job.reservation.targets:
                raise InvalidRequest("no KV targets: reserve on a decode group first")
            pending = self.worker.submit(job)
            # A caller that goes away (the client left, the router gave up) cancels the
            # prompt: the worker computes none of its remaining chunks.
            context.add_callback(pending.cancel)
            try:
                done = pending.result(timeout=deadline)
            finally:
                pending.cancel()
        except CancelledError:
            context.abort(grpc.StatusCode.CANCELLED, f"the prefill of {request.request_id} ended")
        except TimeoutError:
            err: TplaError = DeadlineExceeded(f"prefill of {request.request_id} timed out")
            context.abort(err.grpc_code, err.message)
        except TransferError as exc:
            err = TransferFailed(str(exc))
            context.abort(err.grpc_code, err.message)
        # Unavailable: this worker stopped, or its prefill group failed (another may not).
        except (InvalidRequest, Unavailable, ValueError) as exc:
            err = exc if isinstance(exc, TplaError) else InvalidRequest(str(exc))
            context.abort(err.grpc_code, err.message)
        return result_to_pb(done)

    def GetLoad(
        self, request: common_pb2.Empty, context: grpc.ServicerContext
    ) -> prefill_pb2.PrefillLoad:
        self._guard(context)  # the load is internal state too (the router sends the token)
        return prefill_pb2.PrefillLoad(
            queued_requests=self.worker.queued_requests, queued_tokens=self.worker.queued_tokens
        )
