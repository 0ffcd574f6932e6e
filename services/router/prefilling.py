"""A placed request's prefill: by a prefill worker into its reservation (remote), or by its
decode group itself (local), as the disaggregation policy decides (disagg_policy.py; the
request's lifecycle: DESIGN §2).

`prefill` decides the route from the reservation's cached tokens, this router's local
prefill tokens in flight on the group and whether a prefill worker can be used at all
(degraded_mode.py), records it (the request's record, `tpla:prefill_route_total`, the
trace's `prefill` span) and runs it. A remote prefill whose worker is unavailable is tried
once more on another worker, then on the group itself ("remote_failed"), so a request in
remote prefill when its worker dies still completes; every such failure counts toward the
prefill circuit (prefill_circuit.py), whose opening sends every prompt to its group for a
while. A group that does not prefill prompts itself sends its prompt to a worker. A failure
of the group itself (a KV push to it failed, or its own prefill did) drops the group
(placement.py) and the request is placed and prefilled once more elsewhere.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from opentelemetry.trace import Span, SpanKind

from common.messages import PrefillResult
from common.runtime.errors import LocalPrefillOff, TransferFailed, Unavailable
from common.runtime.redis_state import RequestState, WorkerRecord
from common.runtime.spans import annotate, event, metadata
from common.sampling.params import SamplingParams
from services.router.config import PipelineConfig
from services.router.degraded_mode import DegradedMode
from services.router.disagg_policy import (
    DisaggConfig,
    PrefillRoute,
    RouteDecision,
    RouteReason,
    decide,
)
from services.router.faults import GroupFailed, GroupFault, group_failure
from services.router.metrics import RouterMetrics
from services.router.placement import Placement, Record, Run
from services.router.prefill_circuit import CircuitState, PrefillCircuit

log = logging.getLogger(__name__)


class Prefilling:
    def __init__(
        self,
        config: PipelineConfig,
        disagg: DisaggConfig,
        placement: Placement,
        metrics: RouterMetrics,
        record: Record,
    ) -> None:
        self.config, self.disagg = config, disagg
        self.placement, self.metrics = placement, metrics
        self.directory, self.load = placement.directory, placement.load
        self._record = record
        self.circuit = PrefillCircuit(config.prefill_circuit_failures, config.quarantine_s)
        self.degraded = DegradedMode(disagg, self.circuit, metrics.set_degraded)

    async def prefill(
        self,
        run: Run,
        prompt_ids: tuple[int, ...],
        params: SamplingParams,
        num_output_tokens: int = 0,
    ) -> PrefillResult:
        """The request's prompt prefilled into its reservation, wherever it is decided; once
        more on another group if its group fails it. The last `num_output_tokens` of
        `prompt_ids` are the request's own output (a migration)."""
        try:
            return await self._spanned(run, prompt_ids, params, num_output_tokens)
        except GroupFailed as exc:
            self.placement.drop_group(run, exc)
            if not self.placement.healthy_groups_exist(run.failed_groups):
                raise
            log.warning(
                "request %s: %s; placing it on another decode group",
                run.req.request_id,
                exc.message,
            )
            why = "transfer" if exc.fault is GroupFault.TRANSFER else "local prefill"
            await self._record(
                run.req.request_id, RequestState.QUEUED, retry_reason=f"{why}: {exc.message}"
            )
            await self.placement.place(run, prompt_ids, params.max_tokens)
            return await self._spanned(run, prompt_ids, params, num_output_tokens)

    async def _spanned(
        self, run: Run, prompt_ids: tuple[int, ...], params: SamplingParams, outputs: int
    ) -> PrefillResult:
        with run.spans.span("prefill", run.span, kind=SpanKind.CLIENT) as span:
            decision = self.decide(run, prompt_ids)
            if decision.local:
                try:
                    return await self._local(run, prompt_ids, params, outputs, decision, span)
                except LocalPrefillOff as exc:
                    rid = run.req.request_id
                    await self._record(rid, RequestState.QUEUED, retry_reason=exc.message)
                    decision = RouteDecision(PrefillRoute.REMOTE, RouteReason.LOCAL_OFF)
            return await self._remote(run, prompt_ids, params, outputs, decision, span)

    def decide(self, run: Run, prompt_ids: tuple[int, ...]) -> RouteDecision:
        """Where the placed request's prompt goes now (disagg_policy.py)."""
        assert run.group is not None and run.reservation is not None
        uncached = len(prompt_ids) - run.reservation.cached_tokens
        degraded = self.degraded.reason(self.directory.snapshot)
        queued = self.load.local_prefill_tokens(run.group.group_id)
        decision = decide(self.disagg, uncached, queued, degraded)
        if decision.local:
            return decision
        # Half open, the one prefill let through is the trial; only its end frees the next.
        trial = self.circuit.state is CircuitState.HALF_OPEN
        if not self.circuit.try_remote():
            return RouteDecision(PrefillRoute.LOCAL, RouteReason.CIRCUIT_OPEN)
        return replace(decision, trial=trial)

    def _routed(self, decision: RouteDecision, span: Span | None) -> None:
        self.metrics.prefill_routed(decision.route.value, decision.reason.value)
        annotate(
            span,
            {
                "tpla.prefill_route": decision.route.value,
                "tpla.prefill_route_reason": decision.reason.value,
            },
        )

    async def _local(
        self,
        run: Run,
        prompt_ids: tuple[int, ...],
        params: SamplingParams,
        outputs: int,
        decision: RouteDecision,
        span: Span | None,
        attempt: int = 1,
    ) -> PrefillResult:
        """The group prefills the prompt itself. LocalPrefillOff where it does not; a
        failure of the group is its GroupFailed (GroupFault.LOCAL_PREFILL)."""
        req, group, decode = run.req, run.group, run.decode
        assert group is not None and decode is not None and run.reservation is not None
        tokens = len(prompt_ids) - run.reservation.cached_tokens
        self._routed(decision, span)
        event(span, "attempt", {"tpla.prefill_route": "local", "tpla.group": group.group_id})
        self.load.start_local_prefill(group.group_id, tokens)
        try:
            await self._record(
                req.request_id,
                RequestState.PREFILLING,
                prefill_worker="",
                decode_group=group.group_id,
                attempt=attempt,
                prefill_route=decision.route.value,
                prefill_route_reason=decision.reason.value,
            )
            return await decode.prefill(
                req.request_id,
                prompt_ids,
                params,
                timeout=max(self._remaining(run), 1.0),
                num_output_tokens=outputs,
                n=run.forks,
                prompt_logprobs=req.prompt_logprobs if run.migrations == 0 else None,
                trace=metadata(span),
            )
        except LocalPrefillOff:
            raise
        except Unavailable as exc:  # the group died or stopped, mid-prefill or before it
            raise group_failure(exc, GroupFault.LOCAL_PREFILL) from exc
        finally:
            self.load.end_local_prefill(group.group_id, tokens)

    def _remaining(self, run: Run) -> float:
        return run.req.arrival + self.config.request_timeout_s - time.monotonic()

    async def _remote(
        self,
        run: Run,
        prompt_ids: tuple[int, ...],
        params: SamplingParams,
        outputs: int,
        decision: RouteDecision,
        span: Span | None,
    ) -> PrefillResult:
        """Prefill into run's reservation on a chosen worker; if that worker is unavailable,
        once more on another one (the new push overwrites whatever the first one wrote), then
        on the group itself."""
        req, group, reservation = run.req, run.group, run.reservation
        assert group is not None and reservation is not None
        self._routed(decision, span)
        tried: list[str] = []
        inflight = self.load.prefill_tokens()
        try:
            worker = self.placement.policy.choose_prefill(
                self.directory.snapshot, inflight, prompt=prompt_ids
            )
            while True:
                # Counted before the first await: the other requests of a burst choose while
                # this one records its state, and must see the tokens it is about to send.
                sent_to = worker.worker_id
                self.load.start_prefill(sent_to, len(prompt_ids))
                tried.append(sent_to)
                attributes = {"tpla.prefill_worker": sent_to, "tpla.group": group.group_id}
                event(span, "attempt", attributes)
                try:
                    await self._record(
                        req.request_id,
                        RequestState.PREFILLING,
                        prefill_worker=sent_to,
                        decode_group=group.group_id,
                        attempt=len(tried),
                        prefill_route=decision.route.value,
                        prefill_route_reason=decision.reason.value,
                    )
                    client = self.directory.prefill_client(worker.address)
                    result = await client.prefill(
                        req.request_id,
                        list(prompt_ids),
                        params,
                        reservation,
                        transport=self.config.transport,
                        timeout=max(self._remaining(run), 1.0),
                        num_output_tokens=outputs,
                        n=run.forks,
                        # Only the first prefill: a migration's context is not the prompt.
                        prompt_logprobs=req.prompt_logprobs if run.migrations == 0 else None,
                        trace=metadata(span),
                    )
                    self.circuit.succeeded()
                    return result
                except TransferFailed as exc:
                    # The decode group's fault: another prefill worker would fail the same.
                    raise group_failure(exc, GroupFault.TRANSFER) from exc
                except Unavailable as exc:
                    self.circuit.failed()
                    log.warning("request %s: prefill failed (%s)", req.request_id, exc)
                    await self._record(
                        req.request_id, RequestState.QUEUED, retry_reason=exc.message
                    )
                    worker = self._another_worker(tried, prompt_ids, exc)
                finally:
                    self.load.end_prefill(sent_to, len(prompt_ids))
        except Unavailable as exc:
            if isinstance(exc, GroupFailed):
                raise
            return await self._after_workers(run, prompt_ids, params, outputs, exc, span, tried)
        finally:
            if decision.trial:
                self.circuit.ended()

    def _another_worker(
        self, tried: list[str], prompt_ids: tuple[int, ...], exc: Unavailable
    ) -> WorkerRecord:
        """The next worker to try after `tried` failed, or `exc` when none is left to."""
        if len(tried) > 1 or self.circuit.is_open():
            raise exc
        try:
            return self.placement.policy.choose_prefill(
                self.directory.snapshot, self.load.prefill_tokens(), frozenset(tried), prompt_ids
            )
        except Unavailable:
            raise exc from None

    async def _after_workers(
        self,
        run: Run,
        prompt_ids: tuple[int, ...],
        params: SamplingParams,
        outputs: int,
        exc: Unavailable,
        span: Span | None,
        tried: list[str],
    ) -> PrefillResult:
        """No prefill worker could prefill the prompt (`exc`): its group does."""
        reason = RouteReason.REMOTE_FAILED if tried else RouteReason.NO_PREFILL_WORKER
        decision = RouteDecision(PrefillRoute.LOCAL, reason)
        try:
            return await self._local(
                run, prompt_ids, params, outputs, decision, span, attempt=len(tried) + 1
            )
        except LocalPrefillOff:
            raise exc from None
