"""The router's view of the workers: a cached registry snapshot and pooled gRPC clients.

Lifecycle: `WorkerDirectory.start()` loads the registry once and then refreshes the snapshot
every `refresh_s` in a background task, so requests never wait on Redis to route; `stop()`
ends the task and closes every pooled channel. While Redis is unreachable the last snapshot
is kept (workers that were healthy a moment ago most likely still are), and `last_error`
says why the view may be stale.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import redis

from common.rpc.clients import DecodeClient, PrefillClient
from common.runtime.redis_state import WorkerRegistry
from services.router.policy import WorkerSnapshot

log = logging.getLogger(__name__)
# A replaced channel's calls went to a process that is gone: they fail within a transfer or
# token timeout, well before this.
RETIRED_CLOSE_S = 60.0


class WorkerDirectory:
    def __init__(
        self, registry: WorkerRegistry, token: str | None = None, refresh_s: float = 0.5
    ) -> None:
        self._registry = registry
        self._token = token
        self._refresh_s = refresh_s
        self.snapshot = WorkerSnapshot()
        self.last_error: str | None = None
        # Workers and groups this router saw fail: until when (time.monotonic()) and why.
        # The registry may list a dead worker until its record's TTL runs out.
        self._quarantine: dict[str, tuple[float, str]] = {}
        self._decode: dict[str, DecodeClient] = {}
        self._prefill: dict[str, PrefillClient] = {}
        # The processes (worker id, pid) last seen serving at each address.
        self._served_by: dict[str, set[tuple[str, int]]] = {}
        # Channels to processes that are gone, closed once the calls on them surely ended
        # (time.monotonic() when they were replaced).
        self._retired: list[tuple[float, DecodeClient | PrefillClient]] = []
        self._task: asyncio.Task[None] | None = None

    async def refresh(self) -> WorkerSnapshot:
        try:
            # WorkerRegistry speaks synchronous redis; keep it off the event loop, and the
            # parsing too (each decode leader publishes up to thousands of block hashes).
            snapshot = await asyncio.to_thread(
                lambda: WorkerSnapshot.from_records(self._registry.list())
            )
        except (redis.RedisError, OSError) as exc:
            error = f"worker registry unreachable: {exc}"
            if error != self.last_error:  # once per outage, not every refresh
                log.warning(error)
            self.last_error = error
            return self.snapshot
        self.snapshot = snapshot
        self.last_error = None
        await self._renew_channels()
        return self.snapshot

    async def _renew_channels(self) -> None:
        """A worker process new at an address (a restart) gets a new channel. The old one may
        be in gRPC's reconnect backoff after the dead process refused it, failing every call
        with that "connection refused" for up to a second after the new process serves: a
        half-open prefill circuit's one trial then failed, and kept it open."""
        listed: dict[str, set[tuple[str, int]]] = {}
        for record in self.snapshot.records:
            listed.setdefault(record.address, set()).add((record.worker_id, record.pid))
        now = time.monotonic()
        for address, processes in listed.items():
            before = self._served_by.get(address)
            if before is not None and processes - before:
                for clients in (self._decode, self._prefill):
                    if (client := clients.pop(address, None)) is not None:
                        self._retired.append((now, client))
        while self._retired and self._retired[0][0] < now - RETIRED_CLOSE_S:
            await self._retired.pop(0)[1].close()
        # An address that left the registry is remembered while a channel to it is pooled:
        # its worker may come back after its record expired.
        pooled = self._decode.keys() | self._prefill.keys()
        self._served_by = {
            a: p for a, p in self._served_by.items() if a in pooled and a not in listed
        } | listed

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._run(), name="worker-directory")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_s)
            await self.refresh()

    def quarantine(self, worker_id: str, seconds: float, reason: str) -> None:
        """Route nothing to `worker_id` (a prefill worker or decode group) for `seconds`;
        `reason`: why (a GroupFault value), for the metrics and /admin/workers."""
        self._quarantine[worker_id] = (time.monotonic() + seconds, reason)

    def quarantined(self) -> dict[str, str]:
        """The workers and groups quarantined now, each with its reason."""
        now = time.monotonic()
        for wid in [w for w, (until, _) in self._quarantine.items() if until <= now]:
            del self._quarantine[wid]
        return {wid: reason for wid, (_, reason) in self._quarantine.items()}

    def decode_client(self, address: str) -> DecodeClient:
        client = self._decode.get(address)
        if client is None:
            client = self._decode[address] = DecodeClient(address, token=self._token)
        return client

    def prefill_client(self, address: str) -> PrefillClient:
        client = self._prefill.get(address)
        if client is None:
            client = self._prefill[address] = PrefillClient(address, token=self._token)
        return client

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        clients: list[DecodeClient | PrefillClient] = [
            *self._decode.values(),
            *self._prefill.values(),
            *(client for _, client in self._retired),
        ]
        self._decode.clear()
        self._prefill.clear()
        self._retired.clear()
        for client in clients:
            await client.close()
