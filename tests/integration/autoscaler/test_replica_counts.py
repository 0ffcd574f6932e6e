"""The pools' sizes read from a real Redis worker registry: prefill workers counted once each,
decode groups once per group whatever their ranks, a stopped worker gone once its record
expires."""

from __future__ import annotations

import time

import redis

from common.runtime.redis_state import WorkerRecord, WorkerRegistry, WorkerRole
from services.autoscaler.replica_counts import RegistryCounts
from services.autoscaler.sizing import Replicas


def decode_group(registry: WorkerRegistry, group: str, ranks: int) -> None:
    for rank in range(ranks):
        registry.publish(
            WorkerRecord(f"{group}/rank{rank}", WorkerRole.DECODE, "h:1", rank, group_id=group)
        )


def test_counts_workers_and_groups(redis_url: str) -> None:
    registry = WorkerRegistry(redis.Redis.from_url(redis_url))
    counts = RegistryCounts(redis_url)
    try:
        assert counts.current() == Replicas(0, 0)
        for i in range(3):
            registry.publish(WorkerRecord(f"prefill-{i}", WorkerRole.PREFILL, f"h:{i}"))
        decode_group(registry, "g0", 4)
        decode_group(registry, "g1", 2)
        assert counts.current() == Replicas(3, 2)
        registry.remove("prefill-1")
        for rank in range(2):
            registry.remove(f"g1/rank{rank}")
        assert counts.current() == Replicas(2, 1)
    finally:
        counts.close()
        registry.client.close()


def test_a_stopped_worker_expires(redis_url: str) -> None:
    registry = WorkerRegistry(redis.Redis.from_url(redis_url), ttl_s=0.3)
    counts = RegistryCounts(redis_url)
    try:
        registry.publish(WorkerRecord("prefill-0", WorkerRole.PREFILL, "h:0"))
        decode_group(registry, "g0", 2)
        assert counts.current() == Replicas(1, 1)
        time.sleep(0.6)  # no heartbeat refreshed them
        assert counts.current() == Replicas(0, 0)
    finally:
        counts.close()
        registry.client.close()
