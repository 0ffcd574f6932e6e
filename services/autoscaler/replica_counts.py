"""The pools' sizes as they run, read from the Redis worker registry the workers heartbeat
into (common/runtime/redis_state.py): prefill workers are the prefill records, decode groups
the distinct group ids of the decode leaders' (rank 0) records. A record expires a few
seconds after its worker stops, so these are the replicas that serve, not the ones asked for."""

from __future__ import annotations

import redis

from common.runtime.redis_state import WorkerRegistry, WorkerRole
from services.autoscaler.sizing import Replicas


class RegistryCounts:
    def __init__(self, redis_url: str) -> None:
        self._registry = WorkerRegistry(redis.Redis.from_url(redis_url))

    def current(self) -> Replicas:
        records = self._registry.list()
        prefill = sum(r.role is WorkerRole.PREFILL and r.rank == 0 for r in records)
        groups = {
            r.group_id or r.worker_id
            for r in records
            if r.role is WorkerRole.DECODE and r.rank == 0
        }
        return Replicas(prefill, len(groups))

    def close(self) -> None:
        self._registry.client.close()
