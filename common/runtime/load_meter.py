"""How far a service's ranks are in loading their shares of the checkpoint.

Each rank process has a `LoadMeter`: the checkpoint reader adds the stored bytes of every
slice it reads (common/loading/checkpoint.py), against the share's total, which the rank
estimates from config.json before it reads (common/tpla/share_bytes.py), and the rank marks
itself loaded at its group's start-up barrier. A follower publishes its meter through the
group's store (its beat, common/group/join.py); a leader's meter also reads the others'
(`follow`), so the leader's log, its metrics and its `/ready` reason name a slow rank.

The meter reaches the reader as the *current* meter of the loading thread (`metering`), so
the loaders between a service and its reader (the ranks' model builders) carry no argument
for it: a context variable, which a thread's own context holds, never a shared global.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

GIB = 2**30


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


@dataclass(frozen=True)
class RankLoad:
    """One rank's loading as last seen."""

    rank: int
    read: int = 0  # stored bytes read so far
    total: int = 0  # the share's stored bytes, estimated before reading (0: not known yet)
    done: bool = False  # the rank has loaded its share (it is at the start-up barrier)
    joined: bool = True  # False: the leader still waits for the rank to join its group

    def describe(self) -> str:
        if not self.joined:
            return f"rank {self.rank} not joined yet"
        if self.done:
            return f"rank {self.rank} loaded ({_size(self.read)})"
        if not self.total:
            return f"rank {self.rank} {_size(self.read)}"
        share = min(self.read / self.total, 0.99)
        return f"rank {self.rank} {_size(self.read)} of ~{_size(self.total)} ({share:.0%})"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> RankLoad:
        return cls(**json.loads(text))


class LoadMeter:
    """This process's rank's loading; with `follow`, its group's too. Written by the loading
    thread, read by others (the status endpoint, the beat): plain int updates, which a
    reader sees whole."""

    def __init__(self, rank: int = 0, on_finish: Callable[[RankLoad], None] | None = None) -> None:
        """`on_finish`: told this rank's final count as it finishes (a follower publishes it
        before the start-up barrier, so the leader past the barrier reads every rank's)."""
        self.rank = rank
        self.read = 0
        self.total = 0
        self.done = False
        self._on_finish = on_finish
        self._others: Callable[[], list[RankLoad]] | None = None

    def expect(self, total: int) -> None:
        """The share's stored bytes, before its reads."""
        self.total = total

    def add(self, nbytes: int) -> None:
        self.read += nbytes

    def finish(self) -> None:
        self.done = True
        if self._on_finish is not None:
            self._on_finish(self.own())

    def own(self) -> RankLoad:
        return RankLoad(self.rank, self.read, self.total, self.done)

    def follow(self, others: Callable[[], list[RankLoad]]) -> None:
        """A leader: where the other ranks' loading is read (their reports in the store)."""
        self._others = others

    def ranks(self) -> list[RankLoad]:
        """Every rank's loading known here, this one first."""
        others = self._others() if self._others is not None else []
        return [self.own(), *others]

    @property
    def loaded(self) -> bool:
        return all(r.done for r in self.ranks())

    def summary(self) -> str:
        """One line: each rank's progress."""
        return ", ".join(r.describe() for r in self.ranks())


_CURRENT: contextvars.ContextVar[LoadMeter | None] = contextvars.ContextVar(
    "tpla_load_meter", default=None
)


@contextlib.contextmanager
def metering(meter: LoadMeter) -> Iterator[LoadMeter]:
    """Count this thread's checkpoint reads in `meter` while the block runs."""
    token = _CURRENT.set(meter)
    try:
        yield meter
    finally:
        _CURRENT.reset(token)


def current_meter() -> LoadMeter | None:
    """The meter this thread's reads count in, if any."""
    return _CURRENT.get()
