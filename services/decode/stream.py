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
        # One item per `put`: a choice's events of one step travel together, so no reader
        # that wakes between two of them can send a step's run split over two messages.
        self._q: queue.Queue[tuple[TokenEvent, ...]] = queue.Queue()
        self.choices = choices

    def put(self, *events: TokenEvent) -> None:
        """One choice's events of one step, in order; a finish_reason only on the last."""
        if events:
            self._q.put(events)

    def __iter__(self) -> Iterator[TokenEvent]:
        for ready in self.batches():
            yield from ready

    def batches(self) -> Iterator[list[TokenEvent]]:
        """The events in order, as lists of those ready together: it waits for one step's,
        then takes whatever else is already queued (other choices', later steps')."""
        ended: set[int] = set()  # each choice counted once, whatever a bug sends twice
        while len(ended) < self.choices:
            ready, events = [], self._q.get()
            while True:
                ready += events
                ended.update(e.index for e in events if e.finish_reason is not None)
                if len(ended) >= self.choices:
                    break
                try:
                    events = self._q.get_nowait()
                except queue.Empty:
                    break
            yield ready
