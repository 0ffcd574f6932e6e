"""Everything tpla keeps in Redis: the worker registry and the request records.

Keys (prefix `tpla:`):
    tpla:workers                 set of worker ids
    tpla:worker:{id}             hash, a WorkerRecord; expires unless heartbeats refresh it
    tpla:request:{id}            hash, the request's current state and fields
    tpla:request:{id}:history    list of JSON transitions {state, ts, ...}

Request state machine (DESIGN §2):
    QUEUED -> PREFILLING -> TRANSFERRING -> DECODING -> FINISHED
    any live state -> FAILED | ABORTED
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.retry import Retry

PREFIX = "tpla"
WORKERS = f"{PREFIX}:workers"
REQUEST_TTL_S = 24 * 3600


# A pooled connection Redis closed (a restart, an idle timeout) fails its next command once;
# a retry on a fresh connection is what a caller would do by hand, so the client does it.
RETRIES = 2


def sync_client(url: str) -> redis.Redis:
    """A client whose commands retry on a dropped connection, reconnecting."""
    retry = Retry(ExponentialBackoff(cap=0.5, base=0.05), RETRIES)
    return redis.Redis.from_url(url, retry=retry, retry_on_error=[RedisConnectionError])


def async_client(url: str) -> aioredis.Redis:
    """`sync_client` for asyncio."""
    retry = AsyncRetry(ExponentialBackoff(cap=0.5, base=0.05), RETRIES)
    return aioredis.Redis.from_url(url, retry=retry, retry_on_error=[RedisConnectionError])


def worker_key(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}"


def request_key(request_id: str) -> str:
    return f"{PREFIX}:request:{request_id}"


def history_key(request_id: str) -> str:
    return f"{PREFIX}:request:{request_id}:history"


# -- workers -----------------------------------------------------------------------------------


class WorkerRole(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class WorkerRecord:
    worker_id: str
    role: WorkerRole
    address: str  # gRPC host:port of the service (decode: the leader's)
    rank: int = 0
    pid: int = 0
    group_id: str = ""  # decode: every rank of a group shares it
    healthy: bool = True
    # Told to go (SIGTERM): finishing its live requests, taking no new ones.
    draining: bool = False
    # Still loading its model (not healthy): each rank's progress (common/runtime/load_meter.py).
    loading: str = ""
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_blocks_cached: int = 0  # decode: cached prefix blocks no live request holds
    block_size: int = 0
    # Decode leader: the group's block-hash chain root and its most recently used cached
    # block hashes (hex, comma-separated; bounded), for KV-aware routing.
    prefix_root: str = ""
    prefix_hashes: str = ""
    queued_tokens: int = 0
    tp: int = 1
    latent_groups: int = 1
    parallel: str = ""
    model: str = ""
    updated_at: float = 0.0

    def to_redis(self) -> dict[str, str]:
        raw = dataclasses.asdict(self)
        raw["role"] = self.role.value
        raw["healthy"] = int(self.healthy)
        raw["draining"] = int(self.draining)
        return {k: str(v) for k, v in raw.items()}

    @classmethod
    def from_redis(cls, raw: dict[str, str]) -> WorkerRecord:
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in raw:
                continue
            value = raw[f.name]
            if f.name == "role":
                kwargs[f.name] = WorkerRole(value)
            elif f.type in ("bool", bool):
                kwargs[f.name] = value in ("1", "True", "true")
            elif f.type in ("int", int):
                kwargs[f.name] = int(value)
            elif f.type in ("float", float):
                kwargs[f.name] = float(value)
            else:
                kwargs[f.name] = value
        return cls(**kwargs)


class WorkerRegistry:
    """Publishes worker records with a TTL; a record vanishes when its heartbeats stop."""

    def __init__(self, client: redis.Redis, ttl_s: float = 10.0) -> None:
        self.client = client
        self.ttl_ms = int(ttl_s * 1000)

    def publish(self, record: WorkerRecord) -> None:
        record = dataclasses.replace(record, updated_at=time.time())
        pipe = self.client.pipeline()
        pipe.hset(worker_key(record.worker_id), mapping=record.to_redis())
        pipe.pexpire(worker_key(record.worker_id), self.ttl_ms)
        pipe.sadd(WORKERS, record.worker_id)
        pipe.execute()

    def remove(self, worker_id: str) -> None:
        pipe = self.client.pipeline()
        pipe.delete(worker_key(worker_id))
        pipe.srem(WORKERS, worker_id)
        pipe.execute()

    def list(self, role: WorkerRole | None = None) -> list[WorkerRecord]:
        ids = sorted(self.client.smembers(WORKERS))
        pipe = self.client.pipeline()
        for wid in ids:
            pipe.hgetall(worker_key(_text(wid)))
        records = []
        for wid, raw in zip(ids, pipe.execute(), strict=True):
            if not raw:  # expired: its heartbeats stopped
                self.client.srem(WORKERS, wid)
                continue
            rec = WorkerRecord.from_redis({_text(k): _text(v) for k, v in raw.items()})
            if role is None or rec.role is role:
                records.append(rec)
        return records


class Heartbeat:
    """Background thread publishing `report()`'s records every `interval_s` until stopped."""

    def __init__(
        self,
        registry: WorkerRegistry,
        report: Callable[[], Iterable[WorkerRecord]],
        interval_s: float = 2.0,
    ) -> None:
        self.registry, self.report, self.interval_s = registry, report, interval_s
        self._stop = threading.Event()
        self._published: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._beat()
        self._thread.start()
        return self

    def beat_now(self) -> None:
        """Publish now, not at the next interval (a worker that starts draining)."""
        with contextlib.suppress(redis.RedisError, OSError):
            self._beat()

    def _beat(self) -> None:
        for record in self.report():
            self.registry.publish(record)
            self._published.add(record.worker_id)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except (redis.RedisError, OSError):
                continue  # Redis is down: keep serving; the record reappears when it is back

    def stop(self, deregister: bool = True) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if deregister:
            for wid in self._published:
                with contextlib.suppress(redis.RedisError, OSError):
                    self.registry.remove(wid)


# -- requests ----------------------------------------------------------------------------------


class RequestState(enum.Enum):
    QUEUED = "QUEUED"
    PREFILLING = "PREFILLING"
    TRANSFERRING = "TRANSFERRING"
    DECODING = "DECODING"
    FINISHED = "FINISHED"
    FAILED = "FAILED"
    ABORTED = "ABORTED"

    @property
    def terminal(self) -> bool:
        return self in (RequestState.FINISHED, RequestState.FAILED, RequestState.ABORTED)


_NEXT = {
    RequestState.QUEUED: {RequestState.PREFILLING},
    RequestState.PREFILLING: {RequestState.TRANSFERRING, RequestState.QUEUED},  # QUEUED: retry
    RequestState.TRANSFERRING: {RequestState.DECODING, RequestState.QUEUED},
    RequestState.DECODING: {RequestState.FINISHED, RequestState.QUEUED},  # QUEUED: migration
}


class InvalidTransition(ValueError):
    pass


class RequestLog:
    """Request records in Redis (async: used from the router's event loop)."""

    def __init__(self, client: aioredis.Redis, ttl_s: int = REQUEST_TTL_S) -> None:
        self.client = client
        self.ttl_s = ttl_s

    async def create(self, request_id: str, **fields: Any) -> None:
        await self._write(request_id, RequestState.QUEUED, fields)

    async def transition(self, request_id: str, state: RequestState, **fields: Any) -> None:
        current = await self.client.hget(request_key(request_id), "state")
        if current is None:
            raise InvalidTransition(f"request {request_id} has no record")
        cur = RequestState(_text(current))
        if cur.terminal or not (state.terminal or state in _NEXT.get(cur, set())):
            raise InvalidTransition(f"request {request_id}: {cur.value} -> {state.value}")
        await self._write(request_id, state, fields)

    async def get(self, request_id: str) -> dict[str, Any] | None:
        raw = await self.client.hgetall(request_key(request_id))
        if not raw:
            return None
        record: dict[str, Any] = {_text(k): _text(v) for k, v in raw.items()}
        history = await self.client.lrange(history_key(request_id), 0, -1)
        record["history"] = [json.loads(_text(h)) for h in history]
        return record

    async def _write(self, request_id: str, state: RequestState, fields: dict[str, Any]) -> None:
        now = time.time()
        entry = {"state": state.value, "ts": now, **fields}
        mapping = {
            "state": state.value,
            "updated_at": str(now),
            **{k: str(v) for k, v in fields.items() if v is not None},
        }
        pipe = self.client.pipeline()
        pipe.hset(request_key(request_id), mapping=mapping)
        pipe.rpush(history_key(request_id), json.dumps(entry))
        pipe.expire(request_key(request_id), self.ttl_s)
        pipe.expire(history_key(request_id), self.ttl_s)
        await pipe.execute()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
