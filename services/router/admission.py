"""Router admission: a bounded number of requests run, a bounded number wait, none forever.

    arrive -> a free slot?      yes: run
              waiting < limit?  yes: wait FIFO for a slot, at most `timeout_s`
              otherwise         Overloaded (HTTP 429 + Retry-After)

A request that waited `timeout_s` without a slot is also Overloaded: the client learns to
back off instead of holding a connection open. A slot given back while requests wait goes to
the first in line, so a newcomer never overtakes them. The counts are `RouterLoad`'s; memory
stays bounded: at most max_inflight + max_waiting requests exist in the router at once.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import anyio

from common.runtime.errors import Overloaded
from services.router.load import RouterLoad


class Admission:
    def __init__(
        self,
        load: RouterLoad,
        timeout_s: float,
        on_change: Callable[[int, int], None] = lambda running, waiting: None,
        on_admit: Callable[[float], None] = lambda waited_s: None,
    ) -> None:
        self._load = load
        self.timeout_s = timeout_s
        self._on_change = on_change  # (running, waiting), e.g. to export gauges
        self._on_admit = on_admit  # seconds a request waited for its slot (0: none)
        # The waiters in arrival order; an event is set when a slot is handed to its waiter.
        self._line: deque[anyio.Event] = deque()

    async def acquire(self) -> None:
        """Take one of the router's request slots, waiting in line if need be; Overloaded
        when the line is full or the wait times out. Pair with `release()`."""
        load = self._load
        if load.take_slot():
            self._changed()
            self._on_admit(0.0)
            return
        if load.line_full():
            raise Overloaded(
                f"{load.max_inflight} requests in flight and {load.waiting} waiting "
                f"(limits {load.max_inflight} + {load.max_waiting})",
                code="too_many_requests",
            )
        turn = anyio.Event()
        self._line.append(turn)
        load.start_waiting()
        self._changed()
        started = time.monotonic()
        try:
            with anyio.fail_after(self.timeout_s):
                await self._wait(turn)
            self._on_admit(time.monotonic() - started)
        except TimeoutError:
            raise Overloaded(
                f"no request slot became free within {self.timeout_s:g} s",
                code="too_many_requests",
            ) from None
        finally:
            load.stop_waiting()
            self._changed()

    def release(self) -> None:
        """Give a slot back: to the first request in line, or free."""
        self._hand_on()
        self._changed()

    async def _wait(self, turn: anyio.Event) -> None:
        try:
            await turn.wait()
        except BaseException:
            if turn.is_set():  # the slot came as the wait was cancelled: the next one gets it
                self._hand_on()
            else:
                self._line.remove(turn)
            raise

    def _hand_on(self) -> None:
        if self._line:
            self._line.popleft().set()  # the slot stays taken, by the waiter
        else:
            self._load.free_slot()

    def _changed(self) -> None:
        self._on_change(self._load.running, self._load.waiting)
