"""The token stream of a placed, prefilled request, from whichever decode group holds it.

`tokens` yields (choice, token) from the prefill's first tokens on, over Decode.Generate.
When the group dies or stalls mid-stream, the request migrates to another group and the
stream carries on from there, no token lost or repeated: n = 1, prompt + the tokens generated
so far are prefilled there; n > 1, the prompt is prefilled there once, forked into one
sequence per live choice, and each replays its own tokens so far before it samples again.
Only the group's failures move a request (services/router/faults.py): the request's own end
it, and a second failure for the same reason ends it too. Where this sits in a request's
lifecycle: DESIGN §2.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from opentelemetry.trace import SpanKind

from common.messages import PrefillResult, ResumedChoice
from common.runtime import spans
from common.runtime.errors import DeadlineExceeded, TplaError, Unavailable
from common.runtime.redis_state import RequestState
from common.sampling.params import SamplingParams
from common.sampling.sampler import SampledToken
from services.router.config import PipelineConfig
from services.router.faults import GroupFailed, GroupFault, finished, group_failure
from services.router.metrics import RouterMetrics
from services.router.placement import Placement, Record, Run
from services.router.prefilling import Prefilling

log = logging.getLogger(__name__)

_MAX_MIGRATIONS = 2  # per request: a stream that keeps killing groups is not moved forever


class Decoding:
    def __init__(
        self,
        config: PipelineConfig,
        placement: Placement,
        prefilling: Prefilling,
        metrics: RouterMetrics,
        record: Record,
    ) -> None:
        self.config = config
        self.placement = placement
        self.prefilling = prefilling
        self.metrics = metrics
        self._record = record

    async def tokens(
        self, run: Run, first: PrefillResult
    ) -> AsyncIterator[tuple[int, SampledToken | None]]:
        """(choice, token): the prefill's first tokens, then Decode.Generate's, and
        (choice, None) when the leader ended a choice (its reason in run.reasons). The
        request migrates to another group if its group fails mid-stream."""
        req = run.req
        await self.prefilled(run, first)
        feeds = first.first_tokens
        generated = [[t.token_id] for t in feeds]  # each choice's: what a migration re-feeds
        resumed: tuple[ResumedChoice, ...] = ()  # after an n > 1 migration: each fork's
        hidden = first.hidden  # the first group's MTP drafts start from it; a migration's not
        for index, token in enumerate(feeds):
            yield index, token
        while True:
            if req.n == 1:
                # The group starts from `feeds`; the rest of `generated` came before.
                params = _remaining(req.params, len(generated[0]) - 1)
                stream = self._decode_stream(run, feeds, params, generated[0][:-1], (), hidden)
            else:
                stream = self._decode_stream(run, feeds, req.params, [], resumed, hidden)
            try:
                async with contextlib.aclosing(stream) as events:
                    async for index, token in events:
                        if token is not None:
                            generated[index].append(token.token_id)
                        yield index, token
                return
            except GroupFailed as exc:
                if not self._may_migrate(run, generated, exc):
                    raise
                hidden = ()
                await self._leave_failed(run, generated, exc)
                if req.n == 1:
                    feed = await self._migrate(run, generated[0], exc)
                    generated[0].append(feed.token_id)
                    feeds = (feed,)
                    yield 0, feed
                else:
                    feeds, resumed = await self._migrate_choices(run, generated, exc)

    async def prefilled(self, run: Run, first: PrefillResult) -> None:
        """The prefill is done and its KV in place: TTFT ends, the request is decoding."""
        req = run.req
        ttft = time.monotonic() - req.arrival
        self.metrics.observe_ttft(ttft)
        if run.spans.on:
            run.spans.interval(
                "ttft",
                run.span,
                spans.wall_ns(req.arrival),
                time.time_ns(),
                {
                    "tpla.transfer_bytes": first.transfer_bytes,
                    "tpla.cached_tokens": first.cached_tokens,
                },
            )
        await self._record(
            req.request_id,
            RequestState.TRANSFERRING,
            transfer_bytes=first.transfer_bytes,
            transfer_seconds=first.transfer_seconds,
            exposed_transfer_seconds=first.exposed_transfer_seconds,
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
        resumed: tuple[ResumedChoice, ...] = (),
        hidden: tuple[float, ...] = (),
    ) -> AsyncIterator[tuple[int, SampledToken | None]]:
        """Decode.Generate on the current group from each fork's `feeds` token, as
        `tokens` yields it (`earlier`: what an n = 1 request generated before `feeds`
        elsewhere; `resumed`: a migrated n > 1 request's choice and replay per fork; `hidden`:
        the prefill's last hidden state, where MTP drafts start). A group that dies, or sends
        nothing for token_timeout_s, or ends a choice for its own failure raises GroupFailed
        (which may migrate the request); a choice that ends for the request's own failure
        raises RequestFailed."""
        req = run.req
        assert run.decode is not None and run.group is not None
        deadline = req.arrival + self.config.request_timeout_s
        started = time.monotonic()
        last: dict[int, float] = {}  # per choice: the gap between one choice's tokens
        span = run.spans.start(
            "decode", run.span, {"tpla.group": run.group.group_id}, kind=SpanKind.CLIENT
        )
        tokens, error = 0, None
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
            resumed=resumed,
            hidden=hidden,
            trace=spans.metadata(span),
        )
        left = len(feeds)
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    now = time.monotonic()
                    index, reason = event.index, event.finish_reason
                    run.spec_drafted += event.drafted
                    run.spec_accepted += event.accepted
                    if reason is not None:
                        left -= 1
                        run.decode_live = left > 0
                        if index not in run.stopped:  # (a stopped choice ends as "abort")
                            run.reasons[index] = finished(reason, event.failure)
                    if event.token is not None:
                        self.metrics.observe_itl(now - last.get(index, started))
                        last[index] = now
                        tokens += 1
                        yield index, event.token
                    if reason is not None and index not in run.stopped:
                        yield index, None
                    if not left:
                        return
                    if now > deadline:
                        raise DeadlineExceeded(
                            f"request exceeded {self.config.request_timeout_s:g} s"
                        )
            raise GroupFailed(GroupFault.CUT, "the decode stream ended without a finish reason")
        except (TimeoutError, Unavailable) as exc:
            error = self._stream_failure(run, exc)
            if error is exc:
                raise
            raise error from exc
        except BaseException as exc:
            error = exc
            raise
        finally:
            done = {"tpla.tokens": tokens, "tpla.migrations": run.migrations}
            spans.end(span, done, error=error)

    def _stream_failure(self, run: Run, exc: TimeoutError | Unavailable) -> GroupFailed:
        """The group's failure a Generate stream ended with: it sent nothing for
        token_timeout_s, or the call failed (the group is gone or unreachable)."""
        if isinstance(exc, TimeoutError):
            assert run.group is not None
            return GroupFailed(
                GroupFault.STALLED,
                f"decode group {run.group.group_id} sent nothing for "
                f"{self.config.token_timeout_s:g} s",
            )
        return group_failure(exc, GroupFault.UNREACHABLE)

    def _may_migrate(self, run: Run, generated: list[list[int]], failure: GroupFailed) -> bool:
        live = _live(run)
        return (
            self.config.migrate
            and run.migrations < _MAX_MIGRATIONS
            # Failed on one group for this reason already: a third would fail the same.
            and failure.cause not in run.failed_groups.values()
            and bool(live)
            and all(len(generated[i]) < run.req.params.max_tokens for i in live)
            and time.monotonic() < run.req.arrival + self.config.request_timeout_s
        )

    async def _leave_failed(self, run: Run, generated: list[list[int]], cause: GroupFailed) -> None:
        """Leave the failed group (quarantined unless it is the last healthy one, the
        request aborted there), counted and recorded as a migration. Raises `cause` when no
        other group is healthy."""
        req, old = run.req, run.group
        assert old is not None
        self.placement.drop_group(run, cause)
        if not self.placement.healthy_groups_exist(run.failed_groups):
            raise cause
        run.migrations += 1
        self.metrics.migrated()
        spans.event(
            run.span, "migration", {"tpla.from_group": old.group_id, "tpla.tokens": len(generated)}
        )
        log.warning(
            "request %s: decode group %s failed after %d tokens (%s); migrating",
            req.request_id,
            old.group_id,
            sum(len(g) for g in generated),
            cause.message,
        )
        await self._record(
            req.request_id, RequestState.QUEUED, retry_reason=f"migration: {cause.message}"
        )

    async def _arrived(self, run: Run) -> None:
        """The migrated request's KV is in place on its new group: it decodes again."""
        await self._record(
            run.req.request_id,
            RequestState.TRANSFERRING,
            migrated_to=run.group.group_id if run.group else "",
        )
        await self._record(run.req.request_id, RequestState.DECODING)

    async def _migrate(self, run: Run, generated: list[int], cause: GroupFailed) -> SampledToken:
        """Move an n = 1 stream to another decode group: re-prefill prompt + generated
        tokens there and return the next token. Raises `cause` when it cannot."""
        req = run.req
        context = (*req.prompt_ids, *generated)
        params = _remaining(req.params, len(generated))
        try:
            await self.placement.place(run, context, params.max_tokens)
            result = await self.prefilling.prefill(run, context, params, len(generated))
        except TplaError as exc:
            raise cause from exc
        await self._arrived(run)
        return result.first_token

    async def _migrate_choices(
        self, run: Run, generated: list[list[int]], cause: GroupFailed
    ) -> tuple[tuple[SampledToken, ...], tuple[ResumedChoice, ...]]:
        """Move an n > 1 request's live choices to another decode group: the prompt is
        placed and prefilled there once (its first tokens are not used), forked into one
        sequence per live choice, which starts from that choice's own first token and
        replays the rest of its tokens (DecodeStep.start). Returns each fork's first token
        and choice. Raises `cause` when it cannot."""
        req = run.req
        live = _live(run)
        run.resumed = live
        try:
            await self.placement.place(run, req.prompt_ids, req.params.max_tokens)
            await self.prefilling.prefill(run, req.prompt_ids, req.params)
        except TplaError as exc:
            raise cause from exc
        await self._arrived(run)
        feeds = tuple(SampledToken(generated[i][0], 0.0) for i in live)
        return feeds, tuple(ResumedChoice(i, tuple(generated[i][1:])) for i in live)


def _live(run: Run) -> tuple[int, ...]:
    """The choices still generating: none of them ended by the leader or a stop string."""
    return tuple(i for i in range(run.req.n) if i not in run.reasons and i not in run.stopped)


def _remaining(params: SamplingParams, done: int) -> SamplingParams:
    """The request's params for what is left after `done` tokens: its token limits shrink,
    everything else (penalties, grammar) carries on over the tokens sent along."""
    return replace(
        params,
        max_tokens=params.max_tokens - done,
        min_tokens=max(params.min_tokens - done, 0),
    )
