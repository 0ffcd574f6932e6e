"""Routing policy: which decode group and which prefill worker serve a request (pure logic).

The router keeps a `WorkerSnapshot` built from the Redis registry (refreshed in the
background) and asks a `RoutingPolicy` for one decode group and one prefill worker per
request. A policy never does I/O; "no healthy worker" raises `Unavailable` (HTTP 503). A
draining worker (told to go, finishing its requests) counts as none: it gets no new work.
"""

from __future__ import annotations

import abc
import itertools
import types
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from common.kv.prefix_cache import PublishedPrefixes
from common.runtime.errors import Unavailable
from common.runtime.redis_state import WorkerRecord, WorkerRole


@dataclass(frozen=True)
class DecodeGroup:
    """One decode group as the router sees it: its leader's address and its KV pool."""

    group_id: str
    address: str
    kv_blocks_used: int
    kv_blocks_total: int
    healthy: bool
    block_size: int = 0
    # The cached blocks it published.
    prefix: PublishedPrefixes = field(default_factory=PublishedPrefixes)
    draining: bool = False  # healthy, finishing its requests, admitting none

    @property
    def free_blocks(self) -> int:
        return max(self.kv_blocks_total - self.kv_blocks_used, 0)


@dataclass(frozen=True)
class WorkerSnapshot:
    """The registry at one moment, split into decode groups and prefill workers."""

    decode_groups: tuple[DecodeGroup, ...] = ()
    prefill: tuple[WorkerRecord, ...] = ()
    records: tuple[WorkerRecord, ...] = ()
    # Each prefill worker's published latent-cache blocks, by worker id.
    prefill_prefixes: Mapping[str, PublishedPrefixes] = field(
        default_factory=lambda: types.MappingProxyType({})
    )

    @classmethod
    def from_records(cls, records: Iterable[WorkerRecord]) -> WorkerSnapshot:
        records = tuple(records)
        decode = [r for r in records if r.role is WorkerRole.DECODE]
        # A group is usable only if every rank that reports in is healthy: one dead follower
        # stalls the whole group's collectives.
        sick = {r.group_id or r.worker_id for r in decode if not r.healthy}
        groups = tuple(
            DecodeGroup(
                group_id=r.group_id or r.worker_id,
                address=r.address,
                kv_blocks_used=r.kv_blocks_used,
                kv_blocks_total=r.kv_blocks_total,
                healthy=r.healthy and (r.group_id or r.worker_id) not in sick,
                block_size=r.block_size,
                prefix=PublishedPrefixes.parse(r.prefix_root, r.block_size, r.prefix_hashes),
                draining=r.draining,
            )
            for r in decode
            if r.rank == 0
        )
        prefill = tuple(r for r in records if r.role is WorkerRole.PREFILL)
        prefixes = {
            r.worker_id: PublishedPrefixes.parse(r.prefix_root, r.block_size, r.prefix_hashes)
            for r in prefill
            if r.prefix_hashes
        }
        return cls(groups, prefill, records, types.MappingProxyType(prefixes))

    def healthy_groups(self) -> list[DecodeGroup]:
        """The groups that take new requests: healthy, not draining."""
        return [g for g in self.decode_groups if g.healthy and not g.draining]

    def healthy_prefill(self, exclude: frozenset[str] = frozenset()) -> list[WorkerRecord]:
        """The prefill workers that take new prompts: healthy, not draining."""
        return [
            w for w in self.prefill if w.healthy and not w.draining and w.worker_id not in exclude
        ]

    def not_ready_reason(self) -> str | None:
        """Why no request could be served right now, or None when it could: a decode group
        serves requests without a prefill worker too, prefilling them itself (degraded,
        services/router/degraded_mode.py)."""
        if self.healthy_groups():
            return None
        if not self.healthy_prefill():
            loading = self._loading(WorkerRole.DECODE, WorkerRole.PREFILL)
            return "no healthy decode group or prefill worker is registered" + loading
        return "no healthy decode group is registered" + self._loading(WorkerRole.DECODE)

    def _loading(self, *roles: WorkerRole) -> str:
        """The workers of `roles` still loading, with their ranks' progress, in brackets."""
        loading = [
            f"{r.group_id or r.worker_id} loading: {r.loading}"
            for r in self.records
            if r.role in roles and r.loading
        ]
        return f" ({'; '.join(loading)})" if loading else ""


class RoutingPolicy(abc.ABC):
    """Chooses workers from a snapshot. `pending` is this router's own view of work the
    snapshot may not show yet: for decode groups, the requests sent since the snapshot was
    taken; for prefill workers, the prompt tokens sent and not yet finished. Bursts between
    registry refreshes still spread out."""

    name: str

    @abc.abstractmethod
    def pick_decode(
        self, groups: Sequence[DecodeGroup], pending: Mapping[str, int], prompt: Sequence[int] = ()
    ) -> DecodeGroup:
        """`prompt`: the request's token ids (for policies that weigh cached prefixes)."""

    @abc.abstractmethod
    def pick_prefill(
        self,
        workers: Sequence[WorkerRecord],
        pending: Mapping[str, int],
        prompt: Sequence[int] = (),
        prefixes: Mapping[str, PublishedPrefixes] = types.MappingProxyType({}),
    ) -> WorkerRecord:
        """`prompt` and `prefixes` (each worker's published cache) for policies that weigh
        cached prefixes."""

    def choose_decode(
        self,
        snapshot: WorkerSnapshot,
        pending: Mapping[str, int],
        exclude: frozenset[str] = frozenset(),
        prompt: Sequence[int] = (),
    ) -> DecodeGroup:
        groups = [g for g in snapshot.healthy_groups() if g.group_id not in exclude]
        if not groups:
            raise Unavailable("no healthy decode group is available", code="no_decode_worker")
        return self.pick_decode(groups, pending, prompt)

    def choose_prefill(
        self,
        snapshot: WorkerSnapshot,
        pending: Mapping[str, int],
        exclude: frozenset[str] = frozenset(),
        prompt: Sequence[int] = (),
    ) -> WorkerRecord:
        workers = snapshot.healthy_prefill(exclude)
        if not workers:
            raise Unavailable("no healthy prefill worker is available", code="no_prefill_worker")
        return self.pick_prefill(workers, pending, prompt, snapshot.prefill_prefixes)


class LeastLoadedPolicy(RoutingPolicy):
    """Decode group with the most free KV blocks; prefill worker with the fewest queued tokens
    (the larger of its last report and this router's tokens in flight there: the report
    covers other routers' work, the in-flight count is current). Ties between decode groups go
    to the one this router has loaded least; any remaining tie to the lowest id (stable)."""

    name = "least-loaded"

    def pick_decode(
        self, groups: Sequence[DecodeGroup], pending: Mapping[str, int], prompt: Sequence[int] = ()
    ) -> DecodeGroup:
        return min(groups, key=lambda g: (-g.free_blocks, pending.get(g.group_id, 0), g.group_id))

    def pick_prefill(
        self,
        workers: Sequence[WorkerRecord],
        pending: Mapping[str, int],
        prompt: Sequence[int] = (),
        prefixes: Mapping[str, PublishedPrefixes] = types.MappingProxyType({}),
    ) -> WorkerRecord:
        return min(
            workers,
            key=lambda w: (max(w.queued_tokens, pending.get(w.worker_id, 0)), w.worker_id),
        )


class KvAwarePolicy(LeastLoadedPolicy):
    """Workers by prefix overlap against load, in the manner of Dynamo's KV router:

        decode group  cost = overlap_weight * (prompt blocks it must receive)
                             + (blocks its live requests hold)
                             + (requests sent since the snapshot) * (prompt blocks)
        prefill       cost = (tokens queued there, as `LeastLoadedPolicy` counts them)
                             + overlap_weight * (prompt tokens it must compute)

    A worker that holds a prompt's prefix (from its published hashes) is cheaper by the work
    it need not do; a loaded one costs its load. The lowest cost wins, then the least pending,
    then the lowest id. The published hashes may lag by a heartbeat: a wrong guess costs only
    a miss, since the worker reuses only what it really holds."""

    name = "kv-aware"

    def __init__(self, overlap_weight: float = 1.0) -> None:
        if overlap_weight < 0:
            raise ValueError("overlap_weight must be >= 0")
        self.overlap_weight = overlap_weight

    def pick_decode(
        self, groups: Sequence[DecodeGroup], pending: Mapping[str, int], prompt: Sequence[int] = ()
    ) -> DecodeGroup:
        chains: dict[tuple[int, int], list[int]] = {}  # workers of one model share a chain

        def cost(g: DecodeGroup) -> tuple[float, int, str]:
            bs = g.block_size or 16
            prompt_blocks = -(-len(prompt) // bs)
            cached = g.prefix.cached_tokens(prompt, chains) // bs
            waiting = pending.get(g.group_id, 0)
            load = g.kv_blocks_used + waiting * prompt_blocks
            return (self.overlap_weight * (prompt_blocks - cached) + load, waiting, g.group_id)

        return min(groups, key=cost)

    def pick_prefill(
        self,
        workers: Sequence[WorkerRecord],
        pending: Mapping[str, int],
        prompt: Sequence[int] = (),
        prefixes: Mapping[str, PublishedPrefixes] = types.MappingProxyType({}),
    ) -> WorkerRecord:
        chains: dict[tuple[int, int], list[int]] = {}
        empty = PublishedPrefixes()

        def cost(w: WorkerRecord) -> tuple[float, str]:
            cached = prefixes.get(w.worker_id, empty).cached_tokens(prompt, chains)
            queued = max(w.queued_tokens, pending.get(w.worker_id, 0))
            return (queued + self.overlap_weight * (len(prompt) - cached), w.worker_id)

        return min(workers, key=cost)


class RoundRobinPolicy(RoutingPolicy):
    """Cycles through the healthy candidates in id order, ignoring load."""

    name = "round-robin"

    def __init__(self) -> None:
        self._decode_turn = itertools.count()
        self._prefill_turn = itertools.count()

    def pick_decode(
        self, groups: Sequence[DecodeGroup], pending: Mapping[str, int], prompt: Sequence[int] = ()
    ) -> DecodeGroup:
        ordered = sorted(groups, key=lambda g: g.group_id)
        return ordered[next(self._decode_turn) % len(ordered)]

    def pick_prefill(
        self,
        workers: Sequence[WorkerRecord],
        pending: Mapping[str, int],
        prompt: Sequence[int] = (),
        prefixes: Mapping[str, PublishedPrefixes] = types.MappingProxyType({}),
    ) -> WorkerRecord:
        ordered = sorted(workers, key=lambda w: w.worker_id)
        return ordered[next(self._prefill_turn) % len(ordered)]


POLICIES: Mapping[str, type[RoutingPolicy]] = types.MappingProxyType(
    {
        LeastLoadedPolicy.name: LeastLoadedPolicy,
        KvAwarePolicy.name: KvAwarePolicy,
        RoundRobinPolicy.name: RoundRobinPolicy,
    }
)


def make_policy(name: str, overlap_weight: float = 1.0) -> RoutingPolicy:
    if name == KvAwarePolicy.name:
        return KvAwarePolicy(overlap_weight)
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown routing policy {name!r}; choose from {sorted(POLICIES)}"
        ) from None
