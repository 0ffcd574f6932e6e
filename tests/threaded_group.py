"""A rank group of threads in one process: real collectives (every rank's tensor exchanged
through shared slots, reductions summed in rank order as the shared-memory group does, so
every rank gets bit-identical results), for tests that run several ranks' steps side by side
and look inside them."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch
from torch import Tensor

from common.group.comm import Collectives, Comm, ReduceOp

T = TypeVar("T")


class ThreadGroup:
    """`world` ranks' shared state: one slot per rank and a barrier."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.slots: list[Tensor | None] = [None] * world
        self.barrier = threading.Barrier(world, timeout=60)
        self.mail: dict[tuple[int, int], list[Tensor]] = {}
        self.mail_ready = threading.Condition()

    def comms(self) -> list[Comm]:
        ranks = [ThreadCollectives(self, r) for r in range(self.world)]
        return [Comm(self.world, c, c) for c in ranks]

    def run(self, step: Callable[[int], T]) -> list[T]:
        """`step(rank)` on every rank at once; their results in rank order."""
        with ThreadPoolExecutor(self.world) as pool:
            return list(pool.map(step, range(self.world)))


class ThreadCollectives(Collectives):
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank = group, rank

    def _exchange(self, t: Tensor) -> list[Tensor]:
        g = self.group
        g.slots[self.rank] = t.clone()
        g.barrier.wait()
        every = [s for s in g.slots if s is not None]
        g.barrier.wait()  # nobody writes the next round's slot before all have read
        return every

    def all_reduce_(self, t: Tensor, op: ReduceOp) -> None:
        every = self._exchange(t)
        out = every[0].clone()
        for other in every[1:]:
            out = out + other if op is ReduceOp.SUM else torch.maximum(out, other)
        t.copy_(out)

    def broadcast_(self, t: Tensor, src: int) -> None:
        t.copy_(self._exchange(t)[src])

    def all_gather(self, t: Tensor) -> Tensor:
        return torch.stack(self._exchange(t))

    def gather(self, t: Tensor, dst: int) -> Tensor | None:
        every = torch.stack(self._exchange(t))
        return every if self.rank == dst else None

    def send(self, t: Tensor, dst: int) -> None:
        g = self.group
        with g.mail_ready:
            g.mail.setdefault((self.rank, dst), []).append(t.clone())
            g.mail_ready.notify_all()

    def recv(self, t: Tensor, src: int) -> None:
        g = self.group
        with g.mail_ready:
            g.mail_ready.wait_for(lambda: bool(g.mail.get((src, self.rank))), timeout=60)
            t.copy_(g.mail[(src, self.rank)].pop(0))

    def barrier(self) -> None:
        self.group.barrier.wait()
