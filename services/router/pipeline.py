"""One request's life through the disaggregated stack (DESIGN §2), as an async generator.

    admit (429 over max_inflight) -> Redis QUEUED -> pick decode group + prefill worker
    -> Decode.Reserve                                  yield Started (HTTP headers go out)
    -> PREFILLING: Prefill.Prefill (one retry on another worker if Unavailable)
    -> TRANSFERRING (KV already pushed when Prefill returns; TTFT ends) -> DECODING
    -> Decode.Generate: detokenize, apply stop strings  yield Delta ...
    -> FINISHED                                        yield Done
Any error -> Decode.Abort (blocks freed) + FAILED; the consumer going away (client
disconnect, cancellation, aclose) -> Decode.Abort + ABORTED. Cleanup is shielded from
cancellation so a disconnect can never leak a reservation or leave a record live.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
import redis

from common.errors import DeadlineExceeded, Overloaded, TplaError, Unavailable
from common.redis_state import RequestLog, RequestState, WorkerRecord
from common.rpc.clients import DecodeClient, PrefillResult
from common.rpc.convert import ReservationInfo
from common.sampling import SampledToken
from common.tokenizer import Tokenizer
from services.router.metrics import Outcome, RouterMetrics
from services.router.policy import DecodeGroup, RoutingPolicy
from services.router.request import Delta, Done, GenerationRequest, Output, Started
from services.router.text import TextStream
from services.router.workers import WorkerDirectory

log = logging.getLogger(__name__)

_CLEANUP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class PipelineConfig:
    model: str
    transport: str = "grpc"
    max_inflight: int = 64
    request_timeout_s: float = 300.0
    log_prompts: bool = False


@dataclass
class _Run:
    """One request's bookkeeping, shared by the lifecycle steps and the cleanup."""

    req: GenerationRequest
    decode: DecodeClient | None = None
    decode_live: bool = False  # the leader holds blocks for us that Abort must free
    reason: str | None = None  # the leader's finish_reason
    finished: bool = False


class Pipeline:
    def __init__(
        self,
        config: PipelineConfig,
        tokenizer: Tokenizer,
        directory: WorkerDirectory,
        policy: RoutingPolicy,
        requests: RequestLog,
        metrics: RouterMetrics,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.directory = directory
        self.policy = policy
        self.requests = requests
        self.metrics = metrics
        self.inflight = 0

    async def run(self, req: GenerationRequest) -> AsyncIterator[Output]:
        """The request's outputs: Started, then Deltas, then Done. Raises TplaError."""
        if self.inflight >= self.config.max_inflight:
            self.metrics.outcome(Outcome.REJECTED)
            raise Overloaded(
                f"too many requests in flight (limit {self.config.max_inflight})",
                code="too_many_requests",
            )
        self.inflight += 1
        self.metrics.set_running(self.inflight)
        try:
            # aclosing: when our consumer closes us, the lifecycle must see it at once (and
            # abort), not whenever the garbage collector finalizes it.
            async with contextlib.aclosing(self._lifecycle(req)) as outputs:
                async for out in outputs:
                    yield out
        finally:
            self.inflight -= 1
            self.metrics.set_running(self.inflight)

    async def _lifecycle(self, req: GenerationRequest) -> AsyncIterator[Output]:
        run = _Run(req)
        await self._record(
            req.request_id,
            None,
            model=self.config.model,
            prompt_tokens=len(req.prompt_ids),
            max_tokens=req.params.max_tokens,
            stream=int(req.stream),
        )
        if self.config.log_prompts:
            log.info("request %s prompt: %r", req.request_id, req.prompt_text)
        try:
            group, worker = self.policy.choose(self.directory.snapshot, self.directory.pending)
            self.directory.pending[group.group_id] += 1
            run.decode = self.directory.decode_client(group.address)
            reservation = await run.decode.reserve(
                req.request_id, len(req.prompt_ids), req.params.max_tokens, timeout=10.0
            )
            run.decode_live = True
            yield Started(req.request_id)

            first = await self._prefill(req, reservation, group, worker)
            text = TextStream(
                self.tokenizer,
                req.prompt_ids,
                req.stops,
                req.params.stop_token_ids,
                self._token_text if req.want_logprobs else None,
            )
            async with contextlib.aclosing(self._tokens(run, first)) as tokens:
                async for token in tokens:
                    out = text.push(token)
                    if out is not None:
                        yield Delta(*out)
                    if text.stopped:
                        break
            if run.decode_live:  # stopped on a stop string: the leader is still generating
                run.decode_live = False
                await self._abort(run.decode, req.request_id)
            out = text.finish()
            if out is not None:
                yield Delta(*out)
            reason = "stop" if text.stopped else run.reason
            assert reason is not None, "the token stream ends with a reason or raises"
            await self._record(
                req.request_id,
                RequestState.FINISHED,
                completion_tokens=text.count,
                finish_reason=reason,
                e2e_seconds=round(time.monotonic() - req.arrival, 6),
            )
            run.finished = True
            self._finish_metrics(req, text.count, Outcome.FINISHED)
            if self.config.log_prompts:
                log.info("request %s output: %r", req.request_id, text.text)
            yield Done(reason, len(req.prompt_ids), text.count)
        except BaseException as exc:
            if run.finished:  # the consumer closed us after Done: nothing left to clean up
                raise
            error = _as_tpla_error(exc)
            with anyio.CancelScope(shield=True), anyio.move_on_after(_CLEANUP_TIMEOUT_S):
                await self._cleanup(run, error)
            if error is not None and error is not exc:
                raise error from exc
            raise

    async def _tokens(self, run: _Run, first: PrefillResult) -> AsyncIterator[SampledToken]:
        """The prefill's first token, then Decode.Generate's; sets run.reason at the end."""
        req = run.req
        ttft = time.monotonic() - req.arrival
        self.metrics.observe_ttft(ttft)
        await self._record(
            req.request_id,
            RequestState.TRANSFERRING,
            transfer_bytes=first.transfer_bytes,
            transfer_seconds=first.transfer_seconds,
            prefill_seconds=first.prefill_seconds,
            ttft_seconds=round(ttft, 6),
        )
        await self._record(req.request_id, RequestState.DECODING)
        yield first.first_token
        assert run.decode is not None
        deadline = req.arrival + self.config.request_timeout_s
        last = time.monotonic()
        # Generate runs even when the first token already ends the request: the leader then
        # finishes it at once and frees its blocks. aclosing: leaving early (stop string,
        # client gone) cancels the call right away.
        events = run.decode.generate(req.request_id, first.first_token, req.params)
        async with contextlib.aclosing(events):
            async for event in events:
                now = time.monotonic()
                if event.finish_reason is not None:
                    run.decode_live = False
                    run.reason = _checked_reason(event.finish_reason)
                if event.token is not None:
                    self.metrics.observe_itl(now - last)
                    last = now
                    yield event.token
                if run.reason is not None:
                    return
                if now > deadline:
                    raise DeadlineExceeded(f"request exceeded {self.config.request_timeout_s:g} s")
        raise Unavailable("the decode stream ended without a finish reason")

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def _cleanup(self, run: _Run, error: TplaError | None) -> None:
        """Free the reservation and close the record: FAILED on error, else ABORTED."""
        rid = run.req.request_id
        if run.decode is not None and run.decode_live:
            await self._abort(run.decode, rid)
        if error is None:
            await self._record_quietly(rid, RequestState.ABORTED, reason="client_gone")
            self._finish_metrics(run.req, 0, Outcome.ABORTED)
        else:
            await self._record_quietly(
                rid, RequestState.FAILED, error=error.message, error_type=error.error_type
            )
            self._finish_metrics(run.req, 0, Outcome.FAILED)

    async def _prefill(
        self,
        req: GenerationRequest,
        reservation: ReservationInfo,
        group: DecodeGroup,
        worker: WorkerRecord,
    ) -> PrefillResult:
        """Prefill on `worker`; if it is unavailable, once more on another worker."""
        tried: set[str] = set()
        remaining = req.arrival + self.config.request_timeout_s - time.monotonic()
        while True:
            await self._record(
                req.request_id,
                RequestState.PREFILLING,
                prefill_worker=worker.worker_id,
                decode_group=group.group_id,
                attempt=len(tried) + 1,
            )
            self.directory.pending[worker.worker_id] += len(req.prompt_ids)
            client = self.directory.prefill_client(worker.address)
            try:
                return await client.prefill(
                    req.request_id,
                    list(req.prompt_ids),
                    req.params,
                    reservation,
                    transport=self.config.transport,
                    timeout=max(remaining, 1.0),
                )
            except Unavailable as exc:
                tried.add(worker.worker_id)
                if len(tried) > 1:
                    raise
                try:
                    worker = self.policy.choose_prefill(
                        self.directory.snapshot, self.directory.pending, frozenset(tried)
                    )
                except Unavailable:
                    raise exc from None
                log.warning("request %s: prefill failed (%s); retrying", req.request_id, exc)
                await self._record(req.request_id, RequestState.QUEUED, retry_reason=exc.message)

    async def _abort(self, decode: DecodeClient, request_id: str) -> None:
        try:
            await decode.abort(request_id)
        except TplaError as exc:  # the lease frees the blocks if the leader is unreachable
            log.warning("request %s: abort failed: %s", request_id, exc.message)

    async def _record(self, rid: str, state: RequestState | None, **fields: object) -> None:
        try:
            if state is None:
                await self.requests.create(rid, **fields)
            else:
                await self.requests.transition(rid, state, **fields)
        except (redis.RedisError, OSError) as exc:
            raise Unavailable(f"request store unavailable: {exc}") from exc

    async def _record_quietly(self, rid: str, state: RequestState, **fields: object) -> None:
        with contextlib.suppress(Exception):  # best effort: the request is already lost
            await self._record(rid, state, **fields)

    def _finish_metrics(self, req: GenerationRequest, generated: int, outcome: Outcome) -> None:
        self.metrics.outcome(outcome)
        self.metrics.add_tokens(len(req.prompt_ids), generated)
        self.metrics.observe_e2e(time.monotonic() - req.arrival)


def _checked_reason(reason: str) -> str:
    if reason in ("stop", "length"):
        return reason
    raise Unavailable(f"decode group ended the request: {reason}")


def _as_tpla_error(exc: BaseException) -> TplaError | None:
    """The typed error a failure maps to, or None when the consumer went away."""
    if isinstance(exc, TplaError):
        return exc
    if isinstance(exc, GeneratorExit | anyio.get_cancelled_exc_class()):
        return None
    if isinstance(exc, TimeoutError):
        return DeadlineExceeded("a worker did not answer in time")
    if isinstance(exc, Exception):
        log.exception("router pipeline failed")
        return TplaError(f"internal error: {type(exc).__name__}")
    return None
