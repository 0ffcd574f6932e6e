"""One request's life through the disaggregated stack (DESIGN §2), as an async generator.

    admission (a slot, or a bounded FIFO wait; else 429) -> Redis QUEUED
    -> place: a decode group with room + Decode.Reserve   yield Started (HTTP headers go out)
       (a full group is skipped; when every group is full the request waits for room, up to
       queue_timeout_s; a group that fails Reserve is quarantined and another one tried)
    -> PREFILLING: Prefill.Prefill (one retry on another worker if Unavailable)
    -> TRANSFERRING (KV already pushed when Prefill returns; TTFT ends) -> DECODING
    -> Decode.Generate: detokenize, apply stop strings  yield Delta ... ChoiceEnd
       (the group dies or stalls mid-stream: migrate — re-prefill prompt + the tokens
       generated so far on another group and continue the stream, no token lost or repeated)
    -> FINISHED                                        yield Done
n > 1 choices: one reservation (the prompt once, room for every choice), one prefill that
samples every choice's first token, one Generate stream carrying every choice's tokens with
its index; each choice has its own detokenizer and stop strings, and a choice that meets a
stop string is aborted alone on the leader while the others go on. Such a request is not
migrated: a decode group failing under it fails it (its forks end with the group).
Any error -> Decode.Abort (blocks freed) + FAILED; the consumer going away (client
disconnect, cancellation, aclose) -> Decode.Abort + ABORTED. Cleanup is shielded from
cancellation so a disconnect can never leak a reservation or leave a record live. Every
wait is bounded: admission and room by queue_timeout_s, each token by token_timeout_s, the
whole request by request_timeout_s. Placing the request on a decode group and a prefill
worker (and leaving the group) is services/router/placement.py.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, replace

import anyio
import redis

from common.messages import PrefillResult
from common.runtime.errors import DeadlineExceeded, Overloaded, TplaError, Unavailable
from common.runtime.redis_state import InvalidTransition, RequestLog, RequestState
from common.sampling.params import SamplingParams
from common.sampling.sampler import SampledToken
from common.text.tokenizer import Tokenizer
from services.router.admission import Admission
from services.router.metrics import Outcome, RouterMetrics
from services.router.placement import Placement, Run, abort
from services.router.policy import RoutingPolicy
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
_MAX_MIGRATIONS = 2  # per request: a stream that keeps killing groups is not moved forever


@dataclass(frozen=True)
class PipelineConfig:
    model: str
    transport: str = "grpc"
    max_inflight: int = 64
    max_waiting: int = 256
    queue_timeout_s: float = 30.0
    max_inflight_per_group: int = 64
    request_timeout_s: float = 300.0
    token_timeout_s: float = 30.0
    migrate: bool = True
    # How long a failed worker or group is skipped: by then its registry record has expired.
    quarantine_s: float = 10.0
    log_prompts: bool = False


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
        self.admission = Admission(
            config.max_inflight, config.max_waiting, config.queue_timeout_s, metrics.set_load
        )
        self.placement = Placement(config, directory, policy, self.admission, self._record)

    async def run(self, req: GenerationRequest) -> AsyncGenerator[Output, None]:
        """The request's outputs: Started, (with echo) Prompt, every choice's Deltas and
        ChoiceEnd, then Done. Raises TplaError."""
        try:
            await self.admission.acquire()
        except Overloaded:
            self.metrics.outcome(Outcome.REJECTED)
            raise
        try:
            # aclosing: when our consumer closes us, the lifecycle must see it at once (and
            # abort), not whenever the garbage collector finalizes it.
            async with contextlib.aclosing(self._lifecycle(req)) as outputs:
                async for out in outputs:
                    yield out
        finally:
            self.admission.release()

    async def _lifecycle(self, req: GenerationRequest) -> AsyncIterator[Output]:
        run = Run(req)
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
            self.metrics.outcome(Outcome.FAILED)
            raise Unavailable(f"request store unavailable: {exc}") from exc
        if self.config.log_prompts:
            log.info("request %s prompt: %r", req.request_id, req.prompt_text)
        try:
            await self.placement.place(run, req.prompt_ids, req.params.max_tokens)
            yield Started(req.request_id)

            first = await self.placement.prefill_anywhere(run, req.prompt_ids, req.params)
            if len(first.first_tokens) != req.n:
                raise TplaError(
                    f"the prefill worker sampled {len(first.first_tokens)} first tokens "
                    f"for {req.n} choices"
                )
            if req.echo_text is not None:
                yield Prompt(req.echo_text, self._prompt_logprobs(req, first.prompt_logprobs))
            assert run.reservation is not None
            cached = max(first.cached_tokens, run.reservation.cached_tokens)
            texts = [
                TextStream(
                    self.tokenizer,
                    req.prompt_ids,
                    req.stops,
                    req.params.stop_token_ids,
                    self._token_text if req.want_logprobs else None,
                    skip_special_tokens=not req.keep_special_tokens,
                )
                for _ in range(req.n)
            ]
            ended: dict[int, str] = {}
            if req.score_only:  # echo with max_tokens 0: the prompt's logprobs are the answer
                await self._prefilled(run, first)
                for i in range(req.n):
                    ended[i] = "length"
                    yield ChoiceEnd(i, "length")
            else:
                async with contextlib.aclosing(self._tokens(run, first)) as tokens:
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
                            break
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
            )
            run.finished = True
            self.placement.leave_group(run)
            self._finish_metrics(req, count, Outcome.FINISHED)
            if self.config.log_prompts:
                log.info("request %s output: %r", req.request_id, [t.text for t in texts])
            yield Done(reasons, len(req.prompt_ids), count, cached)
        except BaseException as exc:
            if run.finished:  # the consumer closed us after Done: nothing left to clean up
                raise
            error = _as_tpla_error(exc)
            with anyio.CancelScope(shield=True), anyio.move_on_after(_CLEANUP_TIMEOUT_S):
                await self._cleanup(run, error)
            if error is not None and error is not exc:
                raise error from exc
            raise

    async def _tokens(
        self, run: Run, first: PrefillResult
    ) -> AsyncIterator[tuple[int, SampledToken | None]]:
        """(choice, token): the prefill's first tokens, then Decode.Generate's, and
        (choice, None) when the leader ended a choice (its reason in run.reasons). An n = 1
        request migrates to another group if its group fails mid-stream."""
        req = run.req
        await self._prefilled(run, first)
        generated = [first.first_token.token_id]  # choice 0's (what a migration re-feeds)
        feeds = first.first_tokens
        for index, token in enumerate(feeds):
            yield index, token
        while True:
            # The group starts from `feeds`; (n = 1) the rest of `generated` came before.
            params = _remaining(req.params, len(generated) - 1)
            stream = self._decode_stream(run, feeds, params, generated[:-1])
            try:
                async with contextlib.aclosing(stream) as events:
                    async for index, token in events:
                        if token is not None and index == 0:
                            generated.append(token.token_id)
                        yield index, token
                return
            except Unavailable as exc:
                if req.n > 1 or not self._may_migrate(run, generated):
                    raise
                feed = await self._migrate(run, generated, exc)
                generated.append(feed.token_id)
                feeds = (feed,)
                yield 0, feed

    async def _prefilled(self, run: Run, first: PrefillResult) -> None:
        """The prefill is done and its KV in place: TTFT ends, the request is decoding."""
        req = run.req
        ttft = time.monotonic() - req.arrival
        self.metrics.observe_ttft(ttft)
        await self._record(
            req.request_id,
            RequestState.TRANSFERRING,
            transfer_bytes=first.transfer_bytes,
            transfer_seconds=first.transfer_seconds,
            prefill_seconds=first.prefill_seconds,
            prefill_cached_tokens=first.cached_tokens,
            decode_cached_tokens=run.reservation.cached_tokens if run.reservation else 0,
            ttft_seconds=round(ttft, 6),
        )
        await self._record(req.request_id, RequestState.DECODING)

    async def _decode_stream(
        self,
        run: Run,
        feeds: tuple[SampledToken, ...],
        params: SamplingParams,
        earlier: list[int],
    ) -> AsyncIterator[tuple[int, SampledToken | None]]:
        """Decode.Generate on the current group from each choice's `feeds` token, as
        `_tokens` yields it (`earlier`: what the request generated before `feeds` elsewhere,
        a migrated request's). A group that dies, or sends nothing for token_timeout_s,
        raises Unavailable (which may migrate the request)."""
        req = run.req
        assert run.decode is not None and run.group is not None
        deadline = req.arrival + self.config.request_timeout_s
        started = time.monotonic()
        last: dict[int, float] = {}  # per choice: the gap between one choice's tokens
        # Generate runs even when the first token already ends the request: the leader then
        # finishes it at once and frees its blocks. aclosing: leaving early (stop string,
        # client gone) cancels the call right away.
        events = run.decode.generate(
            req.request_id,
            feeds,
            params,
            idle_timeout=self.config.token_timeout_s,
            # The penalties and the grammar count what the request generated elsewhere.
            prompt_ids=req.prompt_ids if params.repetition_penalty != 1.0 else (),
            output_ids=earlier,
        )
        left = len(feeds)
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    now = time.monotonic()
                    index, reason = event.index, event.finish_reason
                    if reason is not None:
                        left -= 1
                        run.decode_live = left > 0
                        if index not in run.stopped:  # (a stopped choice ends as "abort")
                            run.reasons[index] = _checked_reason(reason)
                    if event.token is not None:
                        self.metrics.observe_itl(now - last.get(index, started))
                        last[index] = now
                        yield index, event.token
                    if reason is not None and index not in run.stopped:
                        yield index, None
                    if not left:
                        return
                    if now > deadline:
                        raise DeadlineExceeded(
                            f"request exceeded {self.config.request_timeout_s:g} s"
                        )
        except TimeoutError:
            raise Unavailable(
                f"decode group {run.group.group_id} sent nothing for "
                f"{self.config.token_timeout_s:g} s"
            ) from None
        raise Unavailable("the decode stream ended without a finish reason")

    def _may_migrate(self, run: Run, generated: list[int]) -> bool:
        return (
            self.config.migrate
            and run.migrations < _MAX_MIGRATIONS
            and len(generated) < run.req.params.max_tokens
            and time.monotonic() < run.req.arrival + self.config.request_timeout_s
        )

    async def _migrate(self, run: Run, generated: list[int], cause: Unavailable) -> SampledToken:
        """Move the stream to another decode group: re-prefill prompt + generated tokens
        there and return the next token. Raises `cause` when no other group can take it."""
        req, old = run.req, run.group
        assert old is not None
        self.placement.drop_group(run)
        if not self.placement.healthy_groups_exist():
            raise cause
        run.migrations += 1
        self.metrics.migrated()
        log.warning(
            "request %s: decode group %s failed after %d tokens (%s); migrating",
            req.request_id,
            old.group_id,
            len(generated),
            cause.message,
        )
        await self._record(
            req.request_id, RequestState.QUEUED, retry_reason=f"migration: {cause.message}"
        )
        context = (*req.prompt_ids, *generated)
        params = _remaining(req.params, len(generated))
        try:
            await self.placement.place(run, context, params.max_tokens)
            result = await self.placement.prefill_anywhere(run, context, params, len(generated))
        except TplaError as exc:
            raise cause from exc
        await self._record(
            req.request_id,
            RequestState.TRANSFERRING,
            migrated_to=run.group.group_id if run.group else "",
        )
        await self._record(req.request_id, RequestState.DECODING)
        return result.first_token

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
            self._finish_metrics(run.req, 0, Outcome.FAILED)

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

    def _finish_metrics(self, req: GenerationRequest, generated: int, outcome: Outcome) -> None:
        self.metrics.outcome(outcome)
        self.metrics.add_tokens(len(req.prompt_ids), generated)
        self.metrics.observe_e2e(time.monotonic() - req.arrival)


def _remaining(params: SamplingParams, done: int) -> SamplingParams:
    """The request's params for what is left after `done` tokens: its token limits shrink,
    everything else (penalties, grammar) carries on over the tokens sent along."""
    return replace(
        params,
        max_tokens=params.max_tokens - done,
        min_tokens=max(params.min_tokens - done, 0),
    )


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
