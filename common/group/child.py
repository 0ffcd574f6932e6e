"""A spawned rank's tie to the leader process that started it: it exits as soon as the
leader is gone, and a start-up error of its configuration has its own exit code."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

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
