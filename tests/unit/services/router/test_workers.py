"""The router's pooled channels: a worker restarted at its address gets a new one (the old one
may sit in gRPC's reconnect backoff, failing calls with the dead process's refusal)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from common.runtime.redis_state import WorkerRecord, WorkerRole
from services.router.workers import WorkerDirectory

ADDRESS = "127.0.0.1:1"


@dataclass
class Listing:
    """What the registry lists at each refresh (the directory only calls `list`)."""

    records: list[WorkerRecord] = field(default_factory=list)

    def list(self) -> list[WorkerRecord]:
        return self.records


def prefill(pid: int, worker_id: str = "prefill-a") -> WorkerRecord:
    return WorkerRecord(worker_id, WorkerRole.PREFILL, ADDRESS, pid=pid)


def test_a_new_process_at_an_address_gets_a_new_channel() -> None:
    async def run() -> None:
        listing = Listing([prefill(10)])
        directory = WorkerDirectory(listing)  # type: ignore[arg-type]
        await directory.refresh()
        first = directory.prefill_client(ADDRESS)
        await directory.refresh()
        assert directory.prefill_client(ADDRESS) is first  # the same process: kept
        listing.records = [prefill(10), prefill(11, "prefill-b")]  # the dead one not expired
        await directory.refresh()
        second = directory.prefill_client(ADDRESS)
        assert second is not first
        listing.records = [prefill(11, "prefill-b")]  # the dead one's record expired
        await directory.refresh()
        listing.records = []  # down longer than its record lives, then back
        await directory.refresh()
        assert directory.prefill_client(ADDRESS) is second
        listing.records = [prefill(12, "prefill-c")]
        await directory.refresh()
        assert directory.prefill_client(ADDRESS) is not second
        await directory.stop()

    asyncio.run(run())
