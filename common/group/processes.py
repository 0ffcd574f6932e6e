"""The leader's hold on its group's other ranks as processes.

Start-up: open the group's rendezvous store (common/group/join.py) on the configured port,
spawn the rest of this host's ranks here (common/group/local_ranks.py: ranks 1..N-1 of a
spawned group), let the other hosts' ranks join from elsewhere, and wait (bounded) until each
has claimed its rank. While the group runs: whether each follower is alive (its beat through
the store, and a spawned one's exit status). On a failed start or at shutdown: stop the
spawned followers, and name a follower's own start-up error as the cause. A group of one
rank has no followers and every call here is a no-op.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch.distributed as dist

from common.group.errors import RankStartError
from common.group.join import LeaderGroup
from common.group.local_ranks import LocalRanks
from common.group.spec import GroupSpec
from common.runtime.load_meter import RankLoad
from common.runtime.ports import PortUse, check_ports


class GroupProcesses:
    """`local`: the rest of this host's ranks (rank 0's), which `start` spawns."""

    def __init__(self, spec: GroupSpec, local: LocalRanks) -> None:
        self.spec, self._local = spec, local
        self.group: LeaderGroup | None = None

    def start(self) -> None:
        """Open the rendezvous, spawn this host's other ranks and wait for every rank to
        join."""
        if self.spec.size <= 1:
            return
        self.group = self._open_group()
        self._local.start()
        self.group.wait_for_followers(self._local.exit_code)

    @property
    def store(self) -> dist.Store | None:
        return self.group.store if self.group is not None else None

    def published(self) -> list[Any]:
        """What ranks 1..N-1 each published at start-up (common/group/join.py)."""
        return self.group.published() if self.group is not None else []

    def alive(self) -> list[bool]:
        """Whether each follower (ranks 1..N-1) is running: a spawned one's status, and
        for every follower a beat through the group's store within the last seconds (ranks
        on other hosts have no other sign of life until a collective)."""
        if self.group is None:
            return []
        try:
            beats = self.group.alive()
        except dist.DistError:  # the store went with a shut-down group
            beats = [False] * len(self.group.followers)
        return [
            b and self._local.running(k) for k, b in zip(self.group.followers, beats, strict=True)
        ]

    def loading(self) -> list[RankLoad]:
        """Each follower's loading as it last published it (its beat), from when `start`
        opened the rendezvous (followers not joined yet say so)."""
        if self.group is None:
            return [RankLoad(k, joined=False) for k in range(1, self.spec.size)]
        try:
            return self.group.loading()
        except dist.DistError:  # the store went with a failed start
            return []

    @property
    def pids(self) -> list[int]:
        """Each follower's pid, as it introduced itself (on its own host)."""
        return [m.pid for m in self.group.members] if self.group is not None else []

    def check(self) -> None:
        """A spawned follower that died fails the group now, not at the next collective:
        an idle group would otherwise accept reservations it can never serve."""
        self._local.check()

    def raise_start_error(self, exc: BaseException) -> None:
        """After a failed start (the followers stopped): raise RankStartError if a follower
        reported an error (a port in use, a config that differs): that error, not the
        collective that broke, is the cause."""
        if not isinstance(exc, Exception):
            return
        if self.group is not None:
            with contextlib.suppress(dist.DistError):
                self.group.raise_reported()
        if (rank := self._local.failed_to_start()) is not None:
            raise RankStartError(
                f"{self.spec.role} rank {rank} could not start (its error is above)"
            )

    def stop(self, grace_s: float = 10.0) -> None:
        """Wait up to `grace_s` for each spawned follower to end (the group's last plan ends
        it), then kill it."""
        self._local.stop(grace_s)

    def _open_group(self) -> LeaderGroup:
        """The group's store on the rendezvous port (PortInUse if taken, named with its
        setting, not an error in c10d's words)."""
        setting = self.spec.port_setting if self.spec.spawned else "TPLA_GROUP_ADDR"
        use = PortUse(self.spec.port, f"{self.spec.role} rendezvous", setting)
        check_ports(self.spec.host, [use])
        try:
            return LeaderGroup(self.spec)
        except dist.DistNetworkError:
            check_ports(self.spec.host, [use])
            raise
