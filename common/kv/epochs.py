"""Reservation epochs on a decode rank: which reservation may still write each block.

The leader numbers its reservations (the epoch, which every KV push of a reservation carries:
`KvTargetInfo.epoch`) and tells every rank, before the reservation's targets leave, that its
blocks now belong to that epoch (`give`). A push lands a segment only while its epoch is the
live one of every block the segment writes (`hold`): a push that is still in flight after
its request was aborted or its lease expired, and its blocks given to another request, is
dropped from then on, and counted (`dropped`). So the late rows of an old reservation never
land in a new one's blocks.

Epochs only grow, and a push proves its epoch was given out: one newer than the rank has
heard of (its push overtook the leader's word) becomes the blocks' live epoch at once.
Rows that land before a rank learns a newer epoch land in blocks nobody reads yet: their
new owner writes them (its push, its decode steps) only after the rank has learned it.
`hold` and `give` take one lock, so a segment's check and its write are one step for any
`give`. A write queued on a GPU stream runs later: `give` first waits for the writes queued
under the epochs it replaces (`queued`). Thread-safe: receivers' threads and the rank's plan
loop share it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from common.kv.wire import TransferError

log = logging.getLogger(__name__)


class BlockEpochs:
    """The live epoch of each of a rank's `num_blocks` blocks (0: never given with one)."""

    def __init__(self, num_blocks: int) -> None:
        self._live = torch.zeros(num_blocks, dtype=torch.int64)
        self._lock = threading.RLock()  # `queued` is called inside `hold`
        self._queued: list[torch.cuda.Event] = []
        self.dropped = 0  # pushes a stale epoch cut short (a metric)

    def give(self, blocks: Tensor, epoch: int) -> None:
        """`blocks` (host int64 [N]) belong to `epoch` from now on."""
        with self._lock:
            queued, self._queued = self._queued, []
            self._live[blocks] = torch.clamp(self._live[blocks], min=epoch)
        for event in queued:  # writes of the epochs replaced: done before the new owner's
            event.synchronize()

    def live(self, blocks: Tensor, epoch: int) -> bool:
        """Whether `epoch` may write `blocks` now (a check, without holding it)."""
        with self.hold(blocks, epoch) as ok:
            return ok

    @contextmanager
    def hold(self, blocks: Tensor, epoch: int) -> Iterator[bool]:
        """Yields whether `epoch` is the live epoch of every one of `blocks`, and keeps it so
        until the block exits: write inside it. A newer epoch becomes the live one."""
        with self._lock:
            live = self._live[blocks]
            ok = bool((live <= epoch).all())
            if ok:
                self._live[blocks] = epoch
            yield ok

    def queued(self, stream: torch.cuda.Stream) -> None:
        """A write was queued on `stream` (a GPU cache) under `hold`: the next `give` waits
        for it."""
        event = torch.cuda.Event()
        event.record(stream)
        with self._lock:
            self._queued = [e for e in self._queued if not e.query()]
            self._queued.append(event)

    def count_drop(self) -> None:
        """A push was dropped (logged: only a leader rank exports the count)."""
        with self._lock:
            self.dropped += 1
        log.warning("dropped a KV push of an old reservation (%d so far)", self.dropped)


class StaleEpoch(TransferError):
    """A push whose reservation's blocks were given out again: dropped, not an error of the
    transport (a torch pair stays matched)."""
