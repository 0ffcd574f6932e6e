"""How a rank process ends: at once when the leader that spawned it is gone, with its own exit
code after a start-up error of its configuration, and past the interpreter's teardown."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn

# A follower's exit code after printing a configuration error (`tpla`'s, tools/cli/main.py).
START_ERROR_EXIT = 2


def exit_with_parent(parent: int | None = None, on_exit: Callable[[], None] | None = None) -> None:
    """A child process (a follower rank, a bench receiver) whose parent died must not linger
    in a collective or on its ports until a timeout: exit as soon as the parent is gone.

    `parent`: the pid that started this process (default: the parent now). A follower passes
    its leader's, which may have died while the follower was still importing. `on_exit` runs
    first (a follower removes its group's file: a leader killed with SIGKILL cannot)."""
    parent = os.getppid() if parent is None else parent

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        if on_exit is not None:
            on_exit()
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def end_process(code: int) -> NoReturn:
    """End a rank process whose work is done, skipping the interpreter's teardown.

    Why: gloo's worker thread frees a finished collective's work after the caller has seen it
    complete, and freeing a work that holds a Python-owned tensor takes the GIL. When the
    main thread reaches the interpreter's teardown first, that thread meets a finalizing
    interpreter in `take_gil`, which ends the thread by unwinding through a `noexcept`
    destructor: `terminate called without an active exception`, SIGABRT (`~AsyncBarrierWork`
    -> tensor decref -> `PyThread_exit_thread`), so a clean end would become a crash its
    supervisor reports. Nothing is left to clean up here: the rank has ended its group,
    closed its senders and flushed its output."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
