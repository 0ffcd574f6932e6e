"""Where a request runs: a decode group with room, and leaving the group.

`place` reserves KV on a decode group (waiting for room when every group is full),
`leave_group` / `drop_group` end the request's stay on a group; its prefill into that
reservation is prefilling.py's. A group is quarantined only for its own failure
(services/router/faults.py), and never when it is the last healthy one: one request's
failure must not take the fleet down. Each step's retries and waits, and how a request's
lifecycle strings them together (a migration is a second place + prefill), are in DESIGN §2.
Every count of this router's load goes through `RouterLoad`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field

import anyio
from opentelemetry.trace import Span

from common.messages import Reservation
from common.rpc.clients import DecodeClient
from common.runtime.errors import (
    DeadlineExceeded,
    Overloaded,
    TplaError,
    Unavailable,
)
from common.runtime.redis_state import RequestState
from common.runtime.spans import Spans, annotate, event, metadata
from services.router.config import PipelineConfig
from services.router.faults import GroupFailed, GroupFault
from services.router.load import RouterLoad
from services.router.policy import DecodeGroup, RoutingPolicy
from services.router.request import GenerationRequest
from services.router.workers import WorkerDirectory

log = logging.getLogger(__name__)

_RESERVE_TIMEOUT_S = 10.0
# A request waiting for room also looks again this often without a wake-up: room can appear
# on a decode group through another router's requests ending, which this router is never
# told about.
_RECHECK_S = 0.25

# Records a request's state transition (best effort): Pipeline._record.
Record = Callable[..., Awaitable[None]]


@dataclass
class Run:
    """One request's bookkeeping, shared by the lifecycle steps and the cleanup."""

    req: GenerationRequest
    group: DecodeGroup | None = None  # the decode group holding the request now
    decode: DecodeClient | None = None
    reservation: Reservation | None = None
    decode_live: bool = False  # the leader holds blocks for us that Abort must free
    reasons: dict[int, str] = field(default_factory=dict)  # the leader's, per choice
    stopped: set[int] = field(default_factory=set)  # choices ended here by a stop string
    finished: bool = False
    migrations: int = 0
    # The groups that failed the request, and why (GroupFailed.cause): it is not placed on
    # them again, and not moved on after a second failure for the same reason.
    failed_groups: dict[str, tuple[GroupFault, str]] = field(default_factory=dict)
    # Drafts the decode groups' speculative steps fed the request's choices, and kept.
    spec_drafted: int = 0
    spec_accepted: int = 0
    # A migrated n > 1 request's live choices, one fork each on its current group (empty:
    # one fork per choice of the request).
    resumed: tuple[int, ...] = ()
    spans: Spans = field(default_factory=Spans)  # the router's (off unless tracing is on)
    span: Span | None = None  # the request's own span, the parent of its steps' spans

    @property
    def forks(self) -> int:
        """The sequences the request holds on its decode group: what it reserves and
        prefills for."""
        return len(self.resumed) or self.req.n


class Placement:
    def __init__(
        self,
        config: PipelineConfig,
        directory: WorkerDirectory,
        policy: RoutingPolicy,
        load: RouterLoad,
        record: Record,
    ) -> None:
        self.config = config
        self.directory = directory
        self.policy = policy
        self.load = load
        self._record = record
        self._room = anyio.Event()  # set (and replaced) when room may have come back
        self._background: set[asyncio.Task[None]] = set()

    async def place(self, run: Run, prompt_ids: tuple[int, ...], max_tokens: int) -> None:
        """Reserve KV on a decode group with room; wait for room up to queue_timeout_s.

        Full groups (this router's per-group limit, or their KV pool) are skipped; a group
        that fails Reserve is quarantined and the next one tried. Unavailable only when no
        healthy group exists at all.
        """
        with run.spans.span("placement", run.span, {"tpla.prompt_tokens": len(prompt_ids)}) as span:
            await self._place(run, prompt_ids, max_tokens, span)

    async def _place(
        self, run: Run, prompt_ids: tuple[int, ...], max_tokens: int, span: Span | None
    ) -> None:
        rid = run.req.request_id
        deadline = time.monotonic() + self.config.queue_timeout_s
        while True:
            skip = {*self.directory.quarantined(), *self.load.full_groups(), *run.failed_groups}
            while True:
                snapshot = self.directory.snapshot
                try:
                    group = self.policy.choose_decode(
                        snapshot, self.load.sent_since(snapshot), frozenset(skip), prompt_ids
                    )
                except Unavailable:
                    if not self.healthy_groups_exist(run.failed_groups):
                        raise
                    break  # every healthy group is full: wait for room
                self.load.send_to_group(snapshot, group.group_id)
                client = self.directory.decode_client(group.address)
                try:
                    run.reservation = await client.reserve(
                        rid,
                        len(prompt_ids),
                        max_tokens,
                        timeout=_RESERVE_TIMEOUT_S,
                        prompt_ids=prompt_ids,
                        n=run.forks,
                        trace=metadata(span),
                    )
                except Overloaded:  # its KV pool is full right now
                    event(span, "retry", {"tpla.group": group.group_id, "tpla.reason": "full"})
                    skip.add(group.group_id)
                    continue
                except (Unavailable, DeadlineExceeded) as exc:
                    log.warning(
                        "request %s: decode group %s failed Reserve: %s",
                        rid,
                        group.group_id,
                        exc.message,
                    )
                    if not self.quarantine(group.group_id, GroupFault.RESERVE):
                        raise GroupFailed(GroupFault.RESERVE, exc.message) from exc
                    skip.add(group.group_id)
                    event(span, "retry", {"tpla.group": group.group_id, "tpla.reason": exc.message})
                    # The record says why the request waited and where it did not go.
                    await self._record(
                        rid,
                        RequestState.QUEUED,
                        retry_reason=f"reserve on {group.group_id}: {exc.message}",
                    )
                    continue
                run.group, run.decode, run.decode_live = group, client, True
                self.load.join_group(group.group_id)
                cached = run.reservation.cached_tokens
                annotate(span, {"tpla.group": group.group_id, "tpla.cached_tokens": cached})
                return
            event(span, "wait_for_room")
            await self._wait_for_room(deadline)

    async def _wait_for_room(self, deadline: float) -> None:
        """Until `room_freed()` or a short re-check interval; Overloaded past `deadline`
        (a time.monotonic() value)."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise Overloaded(
                f"no decode group had room for the request within "
                f"{self.config.queue_timeout_s:g} s",
                code="too_many_requests",
            )
        with anyio.move_on_after(min(left, _RECHECK_S)):
            await self._room.wait()

    def room_freed(self) -> None:
        """Some capacity came back (a request ended or left a group): every request waiting
        for room looks again."""
        self._room.set()
        self._room = anyio.Event()

    def healthy_groups_exist(self, excluding: Collection[str] = ()) -> bool:
        """Whether a healthy decode group that is not quarantined exists, besides `excluding`."""
        bad = {*self.directory.quarantined(), *excluding}
        return any(g.group_id not in bad for g in self.directory.snapshot.healthy_groups())

    def quarantine(self, group_id: str, fault: GroupFault) -> bool:
        """Route nothing to a group that failed (its own fault) for quarantine_s; unless it
        is the last healthy group: then it stays, and the caller fails the one request
        instead. Whether it was quarantined."""
        if not self.healthy_groups_exist(excluding=(group_id,)):
            log.warning(
                "decode group %s failed (%s) but is the last healthy group: not quarantined",
                group_id,
                fault.value,
            )
            return False
        self.directory.quarantine(group_id, self.config.quarantine_s, fault.value)
        return True

    def leave_group(self, run: Run) -> None:
        if run.group is not None:
            self.load.leave_group(run.group.group_id)
            run.group = None
            self.room_freed()

    def drop_group(self, run: Run, failure: GroupFailed) -> None:
        """Leave a decode group that failed us: quarantine it (`quarantine`'s rule), never
        place the request there again, and abort it there in the background (a stalled
        leader answers only once its step ends; nobody waits)."""
        assert run.group is not None and run.decode is not None
        run.failed_groups[run.group.group_id] = failure.cause
        self.quarantine(run.group.group_id, failure.fault)
        if run.decode_live:
            run.decode_live = False
            task = asyncio.create_task(abort(run.decode, run.req.request_id))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        self.leave_group(run)


# An Abort must end on its own gRPC deadline, well inside the pipeline's cleanup bound: a
# grpc.aio call that an anyio cancel scope cancels raises CancelledError out of the scope
# instead of being absorbed by it (seen with a leader whose loop waits on a stopped rank),
# and the client then gets a 500 instead of its error.
ABORT_TIMEOUT_S = 2.0


async def abort(decode: DecodeClient, request_id: str, choices: tuple[int, ...] = ()) -> None:
    try:
        await decode.abort(request_id, timeout=ABORT_TIMEOUT_S, choices=choices)
    except TplaError as exc:  # the lease frees the blocks if the leader is unreachable
        log.warning("request %s: abort failed: %s", request_id, exc.message)
