"""A prompt's KV pushes to its decode ranks: one round of sends per shipped chunk (one round
for a prompt computed whole), each send a future on the worker's pusher threads.

Lifecycle: empty -> a round added after each chunk's compute, carrying the rows shipped so
far -> failed as soon as any send failed (the worker then computes none of the prompt's
remaining chunks) -> settled when every send of every round finished, which resolves the
request.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

from common.kv.transfer import TransferError


class PromptSends:
    def __init__(self) -> None:
        self.futures: list[Future[int]] = []
        self.rows = 0  # rows of what the decode group lacks that were handed to sends
        self.started: float | None = None  # perf_counter of the first round

    def add(self, futures: list[Future[int]], rows: int, started: float) -> None:
        """A round of sends, begun (cut) at perf_counter `started`, handing off `rows`."""
        if self.started is None:
            self.started = started
        self.futures += futures
        self.rows = rows

    def error(self) -> BaseException | None:
        """The first failed send's error, among the finished ones."""
        for send in self.futures:
            if not send.done():
                continue
            if send.cancelled():
                return TransferError("the prefill worker closed before the KV was pushed")
            if (error := send.exception()) is not None:
                return error
        return None

    def sent_bytes(self) -> int:
        return sum(send.result() for send in self.futures)


def when_all(futures: list[Future[int]], then: Callable[[], None]) -> None:
    """Call `then` once every future finished: on the thread that finished the last one, or
    on this one when none is left running."""
    remaining = len(futures)
    if not remaining:
        then()
        return
    lock = threading.Lock()

    def arrived(_: Future[int]) -> None:
        nonlocal remaining
        with lock:
            remaining -= 1
            if remaining:
                return
        then()

    for future in futures:
        future.add_done_callback(arrived)
