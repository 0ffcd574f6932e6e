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
from common.sampling import SamplingParams
from common.tokenizer import Tokenizer
from services.router.metrics import Outcome, RouterMetrics
from services.router.policy import DecodeGroup, RoutingPolicy
from services.router.text import TextStream, TokenLogprob
from services.router.workers import WorkerDirectory

log = logging.getLogger(__name__)

_CLEANUP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str  # chatcmpl-<hex> / cmpl-<hex>: the same id in Redis and on gRPC
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    stops: tuple[str, ...]
    stream: bool
    want_logprobs: bool
    arrival: float  # time.monotonic() when the HTTP request arrived
    prompt_text: str = ""  # only for logging, and only when log_prompts is on


@dataclass(frozen=True)
class PipelineConfig:
    model: str
    transport: str = "grpc"
    max_inflight: int = 64
    request_timeout_s: float = 300.0
    log_prompts: bool = False


@dataclass(frozen=True)
class Started:
    request_id: str


@dataclass(frozen=True)
class Delta:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Done:
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int


Output = Started | Delta | Done


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
        rid = req.request_id
        await self._record(
            rid,
            None,
            model=self.config.model,
            prompt_tokens=len(req.prompt_ids),
            max_tokens=req.params.max_tokens,
            stream=int(req.stream),
        )
        if self.config.log_prompts:
            log.info("request %s prompt: %r", rid, req.prompt_text)
        decode: DecodeClient | None = None
        decode_live = False  # Decode holds blocks for us that Abort must free
        finished = False
        try:
            group, worker = self.policy.choose(self.directory.snapshot, self.directory.pending)
            self.directory.pending[group.group_id] += 1
            decode = self.directory.decode_client(group.address)
            reservation = await decode.reserve(
                rid, len(req.prompt_ids), req.params.max_tokens, timeout=10.0
            )
            decode_live = True
            yield Started(rid)

            result = await self._prefill(req, reservation, group, worker)
            ttft = time.monotonic() - req.arrival
            self.metrics.observe_ttft(ttft)
            await self._record(
                rid,
                RequestState.TRANSFERRING,
                transfer_bytes=result.transfer_bytes,
                transfer_seconds=result.transfer_seconds,
                prefill_seconds=result.prefill_seconds,
                ttft_seconds=round(ttft, 6),
            )
            await self._record(rid, RequestState.DECODING)

            text = TextStream(
                self.tokenizer,
                req.prompt_ids,
                req.stops,
                req.params.stop_token_ids,
                self._token_text if req.want_logprobs else None,
            )
            out = text.push(result.first_token)
            if out is not None:
                yield Delta(*out)
            reason = "stop" if text.stopped else None
            last = time.monotonic()
            deadline = req.arrival + self.config.request_timeout_s
            if reason is None:
                # Generate runs even when the first token already ends the request: the leader
                # then finishes it at once and frees its blocks.
                async for event in decode.generate(rid, result.first_token, req.params):
                    now = time.monotonic()
                    if event.token is not None:
                        self.metrics.observe_itl(now - last)
                        last = now
                        out = text.push(event.token)
                        if out is not None:
                            yield Delta(*out)
                    if event.finish_reason is not None:
                        decode_live = False
                        reason = _checked_reason(event.finish_reason)
                        break
                    if text.stopped:
                        reason = "stop"
                        break
                    if now > deadline:
                        raise DeadlineExceeded(
                            f"request exceeded {self.config.request_timeout_s:g} s"
                        )
                if reason is None:
                    decode_live = False
                    raise Unavailable("decode stream ended without a finish reason")
            if decode_live:  # stopped on a stop string: the leader is still generating
                decode_live = False
                await self._abort(decode, rid)
            out = text.finish()
            if out is not None:
                yield Delta(*out)
            if text.stopped:
                reason = "stop"
            await self._record(
                rid,
                RequestState.FINISHED,
                completion_tokens=text.count,
                finish_reason=reason,
                e2e_seconds=round(time.monotonic() - req.arrival, 6),
            )
            finished = True
            self._finish_metrics(req, text.count, Outcome.FINISHED)
            if self.config.log_prompts:
                log.info("request %s output: %r", rid, text.text)
            yield Done(reason, len(req.prompt_ids), text.count)
        except BaseException as exc:
            if finished:  # the consumer closed us after Done: nothing left to clean up
                raise
            error = _as_tpla_error(exc)
            with anyio.CancelScope(shield=True), anyio.move_on_after(_CLEANUP_TIMEOUT_S):
                if decode is not None and decode_live:
                    await self._abort(decode, rid)
                if error is None:
                    await self._record_quietly(rid, RequestState.ABORTED, reason="client_gone")
                    self._finish_metrics(req, 0, Outcome.ABORTED)
                else:
                    await self._record_quietly(
                        rid, RequestState.FAILED, error=error.message, error_type=error.error_type
                    )
                    self._finish_metrics(req, 0, Outcome.FAILED)
            if error is not None and error is not exc:
                raise error from exc
            raise

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

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
