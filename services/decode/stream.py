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
        left = self.choices
        while True:
            event = self._q.get()
            yield event
            if event.finish_reason is not None:
                left -= 1
                if not left:
                    return

    def get(self, timeout: float | None = None) -> TokenEvent:
        return self._q.get(timeout=timeout)
