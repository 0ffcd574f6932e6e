"""One order of NCCL launches per device, across the communicators a process uses there.

A decode rank's GPU carries two kinds of NCCL communicator: its group's data group (created
at start by every rank alike; the step's all-reduces and gathers) and the KV pairs (one per
prefill rank that ships to it, created when the pair connects; common/kv/pair.py). NCCL asks
that operations of different communicators on one device be launched in one order, never
interleaved by two threads at once. So every launch of either kind (a data-group collective
through `Comm`, a pair's send or receive) is made holding this device's
lock: the host launch order is total per device. The lock is held only while launching,
never while waiting (waits poll events; a pair's creation, which waits for its peer, is
ordered by its one thread instead; docs/design.md §5).
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch


@functools.cache
def _lock(device: str) -> threading.RLock:
    return threading.RLock()


def launch_order(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Hold while launching NCCL work on `device` (a CUDA device); nothing on the CPU."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _lock(f"cuda:{index}")
