"""SIGTERM / SIGINT that end a decode process at once, where a Python handler would come too
late: a leader while its group starts, a follower started on its own (whose SIGTERM may wait
out its leader's drain first)."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Iterator

from common.runtime import group_files

_START_UP_DONE = b"\0"  # no signal has number 0
# After its drain, a leader stops its server (2 s grace) and ends its group: a follower told to
# go waits this much longer than the drain for the group's last plan.
FOLLOWER_SHUTDOWN_S = 10.0


@contextlib.contextmanager
def signals_end_at_once(term_grace_s: float | None = None) -> Iterator[None]:
    """Inside, SIGTERM / SIGINT end this process at once, after removing its group's
    shared-memory file (its followers then see it gone and exit): a leader while its group
    starts, a follower started on its own for its whole life. With `term_grace_s`, a first
    SIGTERM ends it only that many seconds later (a follower serving its leader's drain,
    which normally ends the group, and this process with it, before then).

    A Python signal handler would wait for the main thread, which may sit in the group's
    rendezvous or barrier for up to the collective timeout: longer than a pod's grace period,
    after which everything is SIGKILLed (and a pod's pid 1 ignores SIGTERM without a
    handler). The wake-up fd is written by the C-level handler at once; a thread acts on it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    ending = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in ending}
    previous_fd = signal.set_wakeup_fd(write_fd)

    def watch() -> None:
        deadline: float | None = None  # set by a first SIGTERM that waits
        while True:
            wait = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if not select.select([read_fd], [], [], wait)[0]:
                end(signal.SIGTERM)
            byte = os.read(read_fd, 1)
            if byte == _START_UP_DONE:
                return
            if byte[0] == signal.SIGTERM and term_grace_s is not None and deadline is None:
                deadline = time.monotonic() + term_grace_s
            elif byte[0] in ending:
                end(byte[0])

    def end(sig: int) -> None:
        group_files.remove_files_of(os.getpid())
        os._exit(128 + sig)

    watcher = threading.Thread(target=watch, name="start-up-signals", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.write(write_fd, _START_UP_DONE)
        watcher.join()
        os.close(read_fd)
        os.close(write_fd)
