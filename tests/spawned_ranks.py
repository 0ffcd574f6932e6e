"""A test's group of rank processes, spawned and run to their results (each ends with
tests/rank_exit.py's `leave_group`)."""

from __future__ import annotations

import multiprocessing as mp
import queue
from collections.abc import Callable, Sequence
from typing import Any

import pytest


def run_ranks(
    target: Callable[..., object],
    args: Sequence[tuple[Any, ...]],
    results: int | None = None,
    timeout_s: float = 60.0,
) -> tuple[list[Any], list[int | None]]:
    """One spawned process per entry of `args`, each running `target(*args, out)`: the
    `results` items they put on `out` (one per process by default; the test fails when one
    does not come within `timeout_s`), and each process's exit code (one still running 30 s
    later is killed)."""
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, out)) for a in args]
    for p in procs:
        p.start()
    try:
        items = [
            out.get(timeout=timeout_s) for _ in range(len(procs) if results is None else results)
        ]
    except queue.Empty:
        pytest.fail("a rank did not finish")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return items, [p.exitcode for p in procs]
