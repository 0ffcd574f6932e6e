"""What the decode engine hands its callers besides common/messages.py's types: a request's
token stream, or the error a failed group raises.

Shared by the engine, its gRPC servicer and the local driver.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator

from common.messages import TokenEvent


class EngineError(RuntimeError):
    """The decode group failed; pending and future requests get this error."""


class TokenStream:
    """Iterator over a request's TokenEvents, every choice's interleaved; ends after each of
    its `choices` has sent its event with a finish_reason."""

    def __init__(self, choices: int = 1) -> None:
        self._q: queue.Queue[TokenEvent] = queue.Queue()
        self.choices = choices

    def put(self, event: TokenEvent) -> None:
        self._q.put(event)

    def __iter__(self) -> Iterator[TokenEvent]:
        for ready in self.batches():
            yield from ready

    def batches(self) -> Iterator[list[TokenEvent]]:
        """The events in order, as lists of those ready together: it waits for one, then
        takes whatever else is already queued (a speculative step puts its whole run)."""
        left = self.choices
        while left:
            ready, event = [], self._q.get()
            while True:
                ready.append(event)
                left -= event.finish_reason is not None
                if not left:
                    break
                try:
                    event = self._q.get_nowait()
                except queue.Empty:
                    break
            yield ready

    def get(self, timeout: float | None = None) -> TokenEvent:
        return self._q.get(timeout=timeout)
