"""Draining a service that was told to go: new calls turned away, the admitted ones waited for
(up to a grace period), so none of them fails or has to be redone elsewhere."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from common.runtime.errors import Unavailable


class DrainGate:
    """Counts the calls inside; once closed, turns new ones away with Unavailable (the status
    on which a router tries another worker)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._closed = False
        self._inside = 0

    def enter(self) -> None:
        """Admit a call (each `enter` is matched by one `leave`); Unavailable once closed."""
        with self._lock:
            if self._closed:
                raise Unavailable(f"{self.name} is draining", code="draining")
            self._inside += 1

    def leave(self) -> None:
        with self._lock:
            self._inside -= 1

    def close(self) -> int:
        """Turn every later call away; the number of calls still inside."""
        with self._lock:
            self._closed = True
            return self._inside

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def inside(self) -> int:
        return self._inside


def wait_drained(
    idle: Callable[[], bool], grace_s: float, stop: threading.Event, poll_s: float = 0.05
) -> bool:
    """Until `idle()` (True), or until `grace_s` passed or `stop` is set (False: the caller
    ends what is left)."""
    deadline = time.monotonic() + grace_s
    while not idle():
        if time.monotonic() >= deadline or stop.wait(poll_s):
            return False
    return True
