"""Router admission: a bounded number of requests run, a bounded number wait, none forever.

    arrive -> a free slot?      yes: run
              waiting < limit?  yes: wait FIFO for a slot, at most `timeout_s`
              otherwise         Overloaded (HTTP 429 + Retry-After)

A request that waited `timeout_s` without a slot is also Overloaded: the client learns to
back off instead of holding a connection open. `room()` is the same wait for room on a decode
group (per-group limit, KV blocks): whoever ends a request calls `released()`, which wakes
every waiter to look again. Memory stays bounded: at most max_inflight + max_waiting
requests exist in the router at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio

from common.runtime.errors import Overloaded

# A waiter also looks again this often without a wake-up: room can appear on a decode
# group through another router's requests ending, which this router is never told about.
_RECHECK_S = 0.25


class Admission:
    def __init__(
        self,
        max_inflight: int,
        max_waiting: int,
        timeout_s: float,
        on_change: Callable[[int, int], None] = lambda running, waiting: None,
    ) -> None:
        self.max_inflight = max_inflight
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self._on_change = on_change  # (running, waiting), e.g. to export gauges
        self._slots = anyio.Semaphore(max_inflight)
        self._room = anyio.Event()
        self.waiting = 0

    @property
    def running(self) -> int:
        return self.max_inflight - self._slots.value

    async def acquire(self) -> None:
        """Take one of the router's in-flight slots, waiting in line if need be; Overloaded
        when the line is full or the wait times out. Pair with `release()`."""
        if self._slots.value == 0 and self.waiting >= self.max_waiting:
            raise Overloaded(
                f"{self.max_inflight} requests in flight and {self.waiting} waiting "
                f"(limits {self.max_inflight} + {self.max_waiting})",
                code="too_many_requests",
            )
        self.waiting += 1
        self._changed()
        try:
            with anyio.fail_after(self.timeout_s):
                await self._slots.acquire()
        except TimeoutError:
            raise Overloaded(
                f"no request slot became free within {self.timeout_s:g} s",
                code="too_many_requests",
            ) from None
        finally:
            self.waiting -= 1
            self._changed()

    def release(self) -> None:
        self._slots.release()
        self._changed()
        self.released()

    def released(self) -> None:
        """Some capacity came back (a request ended or left a group): wake the waiters."""
        self._room.set()
        self._room = anyio.Event()

    async def room(self, deadline: float) -> None:
        """Wait until `released()` or a short re-check interval; Overloaded past `deadline`
        (a time.monotonic() value)."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise Overloaded(
                f"no decode group had room for the request within {self.timeout_s:g} s",
                code="too_many_requests",
            )
        with anyio.move_on_after(min(left, _RECHECK_S)):
            await self._room.wait()

    def _changed(self) -> None:
        self._on_change(self.running, self.waiting)
