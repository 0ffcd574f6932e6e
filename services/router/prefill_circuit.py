"""The prefill circuit breaker: remote prefills that keep failing stop being tried for a while,
and the decode groups prefill every prompt meanwhile (degraded mode,
services/router/disagg_policy.py). Pure logic; the clock is given.

States:
    CLOSED     remote prefills go ahead; `failures` in a row (any worker) open it
    OPEN       none is tried until `open_s` after it opened
    HALF_OPEN  one remote prefill is let through (`try_remote`); its success closes the
               circuit, its failure opens it again for `open_s`, and one that ends without
               either (`ended`) lets the next one through
A failure is the prefill workers' (one unavailable, dead or too slow), never a request's own
or its decode group's (a failed KV push).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable


class CircuitState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class PrefillCircuit:
    def __init__(
        self, failures: int, open_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if failures < 1 or open_s < 0:
            raise ValueError("failures must be >= 1 and open_s >= 0")
        self.failures, self.open_s, self.clock = failures, open_s, clock
        self._state = CircuitState.CLOSED
        self._in_row = 0
        self._until = 0.0
        self._trial = False  # the half-open circuit's one remote prefill is under way

    @property
    def state(self) -> CircuitState:
        if self._state is CircuitState.OPEN and self.clock() >= self._until:
            self._state, self._trial = CircuitState.HALF_OPEN, False
        return self._state

    def is_open(self) -> bool:
        """Whether no remote prefill may be tried now (open, or half open with its one
        trial under way)."""
        state = self.state
        return state is CircuitState.OPEN or (state is CircuitState.HALF_OPEN and self._trial)

    def try_remote(self) -> bool:
        """Whether a remote prefill may go ahead now; in the half-open state the first caller
        is its trial and every other one is refused until it ends."""
        if self.is_open():
            return False
        if self._state is CircuitState.HALF_OPEN:
            self._trial = True
        return True

    def ended(self) -> None:
        """The half-open circuit's trial ended, with or without a verdict on the workers (its
        request's own error, its decode group's, its caller gone): the next one may try. Only
        the trial calls it: a remote prefill let through while the circuit was closed, ending
        now, must not free a second trial beside the running one."""
        self._trial = False

    def succeeded(self) -> None:
        self._state, self._in_row, self._trial = CircuitState.CLOSED, 0, False

    def failed(self) -> None:
        self._in_row += 1
        if self._state is CircuitState.HALF_OPEN or self._in_row >= self.failures:
            self._state, self._until, self._trial = (
                CircuitState.OPEN,
                self.clock() + self.open_s,
                False,
            )
