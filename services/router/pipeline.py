"""One request's life through the disaggregated stack, as an async generator of its
outputs; the lifecycle itself is written once, in DESIGN §2.

`Pipeline.run` takes a router slot (admission.py), opens the request's Redis record and
yields Started, (with echo) Prompt, each choice's Deltas and ChoiceEnd, then Done.
placement.py places the request, prefilling.py prefills it (on a prefill worker or on its
decode group) and decoding.py streams its tokens; here each choice's
tokens become text (detokenizer, stop strings) and the request ends: FINISHED or, on an
error or when its consumer goes away, an Abort on its decode group and FAILED / ABORTED.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator

import anyio
import redis
from opentelemetry.trace import Span, SpanKind

from common.messages import PrefillResult
from common.runtime.errors import DeadlineExceeded, Overloaded, TplaError, Unavailable
from common.runtime.redis_state import InvalidTransition, RequestLog, RequestState
from common.runtime.spans import Parent, Spans, annotate, end, wall_ns
from common.sampling.sampler import SampledToken
from common.sampling.thinking import Thinking
from common.text.tokenizer import Tokenizer
from services.router.admission import Admission
from services.router.config import PipelineConfig
from services.router.decoding import Decoding
from services.router.disagg_policy import DisaggConfig
from services.router.load import RouterLoad
from services.router.metrics import Outcome, RouterMetrics
from services.router.placement import Placement, Run, abort
from services.router.policy import RoutingPolicy
from services.router.prefilling import Prefilling
from services.router.request import (
    ChoiceEnd,
    Delta,
    Done,
    GenerationRequest,
    Output,
    Prompt,
    Started,
)
from services.router.text import TextStream, TokenLogprob
from services.router.workers import WorkerDirectory

log = logging.getLogger(__name__)

_CLEANUP_TIMEOUT_S = 5.0


class Pipeline:
    def __init__(
        self,
        config: PipelineConfig,
        tokenizer: Tokenizer,
        directory: WorkerDirectory,
        policy: RoutingPolicy,
        requests: RequestLog,
        metrics: RouterMetrics,
        spans: Spans | None = None,
        disagg: DisaggConfig | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.directory = directory
        self.policy = policy
        self.requests = requests
        self.metrics = metrics
        self.spans = spans or Spans()  # off unless the router set tracing up
        self.load = RouterLoad(
            config.max_inflight, config.max_waiting, config.max_inflight_per_group
        )
        self.admission = Admission(
            self.load, config.queue_timeout_s, metrics.set_load, metrics.observe_queue
        )
        self.placement = Placement(config, directory, policy, self.load, self._record)
        self.prefilling = Prefilling(
            config, disagg or DisaggConfig(), self.placement, metrics, self._record
        )
        self.decoding = Decoding(config, self.placement, self.prefilling, metrics, self._record)

    async def run(
        self, req: GenerationRequest, parent: Parent = None
    ) -> AsyncGenerator[Output, None]:
        """The request's outputs: Started, (with echo) Prompt, every choice's Deltas and
        ChoiceEnd, then Done. Raises TplaError. `parent`: the client's trace context."""
        span = self._request_span(req, parent)
        try:
            with self.spans.span("queue", span):
                await self.admission.acquire()
        except Overloaded as exc:
            self.metrics.outcome(Outcome.REJECTED)
            end(span, error=exc)
            raise
        error: BaseException | None = None
        try:
            # aclosing: when our consumer closes us, the lifecycle must see it at once (and
            # abort), not whenever the garbage collector finalizes it.
            async with contextlib.aclosing(self._lifecycle(req, span)) as outputs:
                async for out in outputs:
                    if isinstance(out, Done):
                        annotate(span, _done_attributes(out))
                    yield out
        except BaseException as exc:
            error = exc
            raise
        finally:
            end(span, error=error)
            self.admission.release()
            # The request has ended: one waiting for room on a decode group looks again.
            self.placement.room_freed()

    def _request_span(self, req: GenerationRequest, parent: Parent) -> Span | None:
        if not self.spans.on:
            return None
        attributes = {
            "gen_ai.request.model": self.config.model,
            "tpla.request_id": req.request_id,
            "tpla.prompt_tokens": len(req.prompt_ids),
            "tpla.n": req.n,
            "tpla.max_tokens": req.params.max_tokens,
            "tpla.stream": req.stream,
        }
        start_ns = wall_ns(req.arrival)
        return self.spans.start(
            "request", parent, attributes, kind=SpanKind.SERVER, start_ns=start_ns
        )

    async def _lifecycle(self, req: GenerationRequest, span: Span | None) -> AsyncIterator[Output]:
        run = Run(req, spans=self.spans, span=span)
        await self._open_record(req)
        try:
            await self.placement.place(run, req.prompt_ids, req.params.max_tokens)
            yield Started(req.request_id)

            first = await self.prefilling.prefill(run, req.prompt_ids, req.params)
            if len(first.first_tokens) != req.n:
                raise TplaError(
                    f"the prefill worker sampled {len(first.first_tokens)} first tokens "
                    f"for {req.n} choices"
                )
            if req.echo_text is not None:
                yield Prompt(req.echo_text, self._prompt_logprobs(req, first.prompt_logprobs))
            assert run.reservation is not None
            cached = max(first.cached_tokens, run.reservation.cached_tokens)
            texts = [self._text_stream(req) for _ in range(req.n)]
            ended: dict[int, str] = {}
            if req.score_only:  # echo with max_tokens 0: the prompt's logprobs are the answer
                await self.decoding.prefilled(run, first)
                for i in range(req.n):
                    ended[i] = "length"
                    yield ChoiceEnd(i, "length")
            else:
                async with contextlib.aclosing(self._choices(run, first, texts, ended)) as outs:
                    async for out in outs:
                        yield out
            yield await self._finish(run, texts, ended, cached)
        except BaseException as exc:
            if run.finished:  # the consumer closed us after Done: nothing left to clean up
                raise
            error = _as_tpla_error(exc)
            with anyio.CancelScope(shield=True), anyio.move_on_after(_CLEANUP_TIMEOUT_S):
                await self._cleanup(run, error)
            if error is not None and error is not exc:
                raise error from exc
            raise

    async def _open_record(self, req: GenerationRequest) -> None:
        """The request's Redis record, QUEUED; Unavailable (and no request) without Redis."""
        try:
            await self.requests.create(
                req.request_id,
                model=self.config.model,
                prompt_tokens=len(req.prompt_ids),
                max_tokens=req.params.max_tokens,
                stream=int(req.stream),
            )
        except (redis.RedisError, OSError) as exc:
            # Without its record a request could be lost without trace: refuse it instead.
            self.metrics.outcome(Outcome.FAILED, Unavailable.error_type)
            raise Unavailable(f"request store unavailable: {exc}") from exc
        if self.config.log_prompts:
            log.info("request %s prompt: %r", req.request_id, req.prompt_text)

    def _text_stream(self, req: GenerationRequest) -> TextStream:
        return TextStream(
            self.tokenizer,
            req.prompt_ids,
            req.stops,
            req.params.stop_token_ids,
            self._token_text if req.want_logprobs else None,
            skip_special_tokens=not req.keep_special_tokens,
            thinking=Thinking.start(req.params) if req.thinking else None,
        )

    async def _choices(
        self, run: Run, first: PrefillResult, texts: list[TextStream], ended: dict[int, str]
    ) -> AsyncIterator[Output]:
        """Every choice's Deltas and its ChoiceEnd (recorded in `ended`) as its tokens come,
        until every choice has ended."""
        req = run.req
        async with contextlib.aclosing(self.decoding.tokens(run, first)) as tokens:
            async for index, token in tokens:
                text = texts[index]
                if index in ended:
                    continue
                if token is not None:
                    out = text.push(token)
                    if out is not None:
                        yield Delta(*out, index=index)
                    if not text.stopped:
                        continue
                    # A stop string: this choice is over here, and on the leader.
                    run.stopped.add(index)
                    if run.decode_live and len(ended) + 1 < req.n:
                        assert run.decode is not None
                        await abort(run.decode, req.request_id, (index,))
                out = text.finish()
                if out is not None:
                    yield Delta(*out, index=index)
                ended[index] = "stop" if text.stopped else run.reasons[index]
                yield ChoiceEnd(index, ended[index])
                if len(ended) == req.n:
                    return

    async def _finish(
        self, run: Run, texts: list[TextStream], ended: dict[int, str], cached: int
    ) -> Done:
        """Every choice ended: the request is FINISHED, its group left, its usage counted."""
        req = run.req
        # Ended on stop strings (or only scored the prompt): the leader still has it.
        if run.decode_live:
            run.decode_live = False
            assert run.decode is not None
            await abort(run.decode, req.request_id)
        reasons = tuple(ended[i] for i in range(req.n))
        count = sum(t.count for t in texts)
        await self._record(
            req.request_id,
            RequestState.FINISHED,
            completion_tokens=count,
            finish_reason=",".join(reasons),
            migrations=run.migrations,
            e2e_seconds=round(time.monotonic() - req.arrival, 6),
            spec_draft_tokens=run.spec_drafted,
            spec_accepted_tokens=run.spec_accepted,
        )
        run.finished = True
        self.placement.leave_group(run)
        self._finish_metrics(req, count, Outcome.FINISHED)
        if self.config.log_prompts:
            log.info("request %s output: %r", req.request_id, [t.text for t in texts])
        thought = sum(t.reasoning_tokens for t in texts) if req.thinking else None
        return Done(reasons, len(req.prompt_ids), count, cached, thought)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def _cleanup(self, run: Run, error: TplaError | None) -> None:
        """Free the reservation and close the record: FAILED on error, else ABORTED."""
        rid = run.req.request_id
        if run.decode is not None and run.decode_live:
            run.decode_live = False
            await abort(run.decode, rid)
        self.placement.leave_group(run)
        if error is None:
            await self._record(rid, RequestState.ABORTED, reason="client_gone")
            self._finish_metrics(run.req, 0, Outcome.ABORTED)
        else:
            await self._record(
                rid, RequestState.FAILED, error=error.message, error_type=error.error_type
            )
            self._finish_metrics(run.req, 0, Outcome.FAILED, error.error_type)

    def _prompt_logprobs(
        self, req: GenerationRequest, scored: tuple[SampledToken, ...]
    ) -> tuple[TokenLogprob, ...]:
        """The echoed prompt's logprobs (none unless asked for): its first token has none."""
        if req.prompt_logprobs is None:
            return ()
        first = TokenLogprob(self._token_text(req.prompt_ids[0]), None)
        return (
            first,
            *(
                TokenLogprob(
                    self._token_text(t.token_id),
                    t.logprob,
                    tuple((self._token_text(i), lp) for i, lp in t.top_logprobs),
                )
                for t in scored
            ),
        )

    async def _record(self, rid: str, state: RequestState, **fields: object) -> None:
        """Best effort once the request exists: a Redis outage must not fail requests that
        are already being served: their record then misses the transitions it could not
        write — or is gone, when Redis restarted empty)."""
        try:
            await self.requests.transition(rid, state, **fields)
        except (redis.RedisError, OSError, InvalidTransition) as exc:
            log.warning("request %s: could not record %s: %s", rid, state.value, exc)

    def _finish_metrics(
        self, req: GenerationRequest, generated: int, outcome: Outcome, error_type: str = ""
    ) -> None:
        self.metrics.finished(outcome, len(req.prompt_ids), generated, error_type)
        self.metrics.observe_e2e(time.monotonic() - req.arrival)


def _done_attributes(done: Done) -> dict[str, str | int | tuple[str, ...]]:
    return {
        "tpla.completion_tokens": done.completion_tokens,
        "tpla.cached_tokens": done.cached_tokens,
        "tpla.finish_reasons": done.finish_reasons,
    }


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
