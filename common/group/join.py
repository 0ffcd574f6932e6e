"""A rank group's membership: how its ranks meet, agree on what they serve, and see each
other end. Decode and prefill groups both form this way (common/group/spec.py).

Lifecycle: the leader (rank 0) serves a TCPStore on its rendezvous port and publishes the
group's identity (model, layout, ...) -> each follower connects (within the join timeout),
checks that identity against its own and claims its rank -> once every rank has claimed,
all form torch.distributed over the same store (common/group/setup.py) -> each follower
loads its share, its beat publishing its loading progress (`loading`, which the leader reads
for its log, metrics and /ready), and publishes what the leader must know of it (`publish`)
-> the start-up barrier -> while the group lives, each follower beats (a counter in the
store); a follower whose beat fails (the leader's store is gone) exits.

A follower the leader spawned goes through exactly this on 127.0.0.1; a rank started on its
own (`tpla decode|prefill --rank K --group-addr HOST:PORT`, a LeaderWorkerSet worker pod)
reaches the leader over the network. Any failure on the way is written to the store under
the rank's key, so the leader fails with the follower's reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from common.group.errors import GroupError, RankStartError
from common.group.spec import GroupSpec
from common.runtime.load_meter import LoadMeter, RankLoad

_PREFIX = "tpla/group"
_POLL_S = 0.05
# A follower beats this often; the leader reports a rank whose beat has not moved for
# BEAT_STALE_S as not alive (registry records), and a follower gives the leader's store
# BEAT_TIMEOUT_S to answer before it counts the leader gone.
BEAT_S = 0.5
BEAT_STALE_S = 10.0
BEAT_TIMEOUT_S = 10.0
# After a failed beat: time for the leader's last plan (the group's orderly end) to arrive.
_END_GRACE_S = 2.0


def mismatch(spec: GroupSpec, mine: dict[str, str], leader: dict[str, str]) -> list[str]:
    """Each setting on which this rank differs from the leader, named."""
    return [
        f"{spec.setting(k)}: {mine.get(k)} here, {leader.get(k)} on the leader"
        for k in sorted(set(mine) | set(leader))
        if mine.get(k) != leader.get(k)
    ]


def _key(rank: int, what: str) -> str:
    return f"{_PREFIX}/rank{rank}/{what}"


@dataclass(frozen=True)
class Member:
    """A follower as it introduced itself: its process id and the host it advertises."""

    pid: int
    host: str


class LeaderGroup:
    """The leader's side: serves the store, waits for the followers, reads what they
    publish. Methods are called from one thread at a time except `alive` (the heartbeat)."""

    def __init__(self, spec: GroupSpec) -> None:
        self.spec = spec
        self.address = spec.address
        # Every interface: followers on other hosts dial the leader's address.
        self.store = dist.TCPStore(
            spec.addr,
            spec.port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=spec.collective_timeout_s),
        )
        self.store.set(f"{_PREFIX}/identity", json.dumps(spec.identity()))
        self.members: list[Member] = []
        self._beats = {k: (0, time.monotonic()) for k in self.followers}

    @property
    def followers(self) -> range:
        return range(1, self.spec.size)

    def wait_for_followers(self, exit_code: Callable[[int], int | None]) -> None:
        """Until every follower has claimed its rank. RankStartError if one reported an
        error or (`exit_code(rank)`: a spawned one's exit status) ended first; GroupError
        naming the missing ranks after the join timeout."""
        deadline = time.monotonic() + self.spec.join_timeout_s
        role = self.spec.role
        pending = set(self.followers)
        while pending:
            for rank in sorted(pending):
                self.raise_reported(rank)
                if self.store.check([_key(rank, "hello")]):
                    pending.discard(rank)
                elif (code := exit_code(rank)) is not None:
                    self.raise_reported(rank)  # written just before it exited
                    raise RankStartError(f"{role} rank {rank} exited with code {code} at start")
            if pending and time.monotonic() > deadline:
                missing = ", ".join(map(str, sorted(pending)))
                raise GroupError(
                    f"{role} rank(s) {missing} of {self.spec.size} did not join the group "
                    f"at {self.address} within {self.spec.join_timeout_s:g} s "
                    f"(TPLA_GROUP_JOIN_TIMEOUT_S); start each as `{self.spec.join_command}`"
                )
            time.sleep(_POLL_S)
        self.members = [
            Member(**json.loads(self.store.get(_key(k, "hello")))) for k in self.followers
        ]

    def raise_reported(self, rank: int | None = None) -> None:
        """RankStartError with the error a follower (`rank`, or any) wrote, if one did."""
        for k in self.followers if rank is None else (rank,):
            if self.store.check([_key(k, "error")]):
                reason = self.store.get(_key(k, "error")).decode()
                raise RankStartError(f"{self.spec.role} rank {k} could not start: {reason}")

    def published(self) -> list[Any]:
        """What each follower published (`FollowerGroup.publish`: a decode rank's KV
        receiver addresses) before the start-up barrier, so read after it."""
        return [json.loads(self.store.get(_key(k, "published"))) for k in self.followers]

    def loading(self) -> list[RankLoad]:
        """Each follower's loading as it last published it: not joined yet, joined with
        nothing read yet, or its last report."""
        out = []
        for k in self.followers:
            key = _key(k, "loading")
            if self.store.check([key]):
                out.append(RankLoad.from_json(self.store.get(key)))
            else:
                out.append(RankLoad(k, joined=self.store.check([_key(k, "hello")])))
        return out

    def alive(self) -> list[bool]:
        """Per follower: has its beat moved within BEAT_STALE_S."""
        now, out = time.monotonic(), []
        for k in self.followers:
            count = self.store.add(_key(k, "beat"), 0)
            last, seen = self._beats[k]
            if count != last:
                self._beats[k] = (count, now)
                seen = now
            out.append(now - seen < BEAT_STALE_S)
        return out


class FollowerGroup:
    """A follower's side: joins the leader's store and beats until the group ends."""

    def __init__(self, spec: GroupSpec, rank: int, store: dist.TCPStore) -> None:
        self.spec, self.rank, self.store = spec, rank, store
        self.address = spec.address
        self._ended = threading.Event()
        # This rank's loading, which its beat publishes as it changes (and at once when done).
        self.loading = LoadMeter(rank, self._publish_loading)

    @classmethod
    def join(
        cls, spec: GroupSpec, rank: int, on_leader_gone: Callable[[], None] | None = None
    ) -> FollowerGroup:
        """Connect to the leader (within the join timeout), check this rank's config against
        the group's, claim the rank and start beating. GroupError on a mismatch (reported to
        the leader too), a rank claimed twice, or no leader."""
        address = spec.address
        wait = timedelta(seconds=spec.join_timeout_s)
        try:
            store = dist.TCPStore(spec.addr, spec.port, is_master=False, timeout=wait)
            leader = json.loads(store.get(f"{_PREFIX}/identity"))
        except dist.DistError as exc:
            raise GroupError(
                f"no {spec.role} leader answered at {address} within {spec.join_timeout_s:g} s "
                "(TPLA_GROUP_ADDR, TPLA_GROUP_JOIN_TIMEOUT_S)"
            ) from exc
        store.set_timeout(timedelta(seconds=spec.collective_timeout_s))
        group = cls(spec, rank, store)
        try:
            diffs = mismatch(spec, spec.identity(), leader)
            if diffs:
                raise GroupError(f"its config differs from the leader's: {'; '.join(diffs)}")
        except (GroupError, FileNotFoundError) as exc:
            group.report(str(exc))
            raise
        hello = json.dumps({"pid": os.getpid(), "host": spec.advertise_host})
        if store.compare_set(_key(rank, "hello"), "", hello).decode() != hello:
            raise GroupError(
                f"rank {rank} of the group at {address} has joined already (another process "
                f"was started with --rank {rank})"
            )
        group._start_beating(on_leader_gone)
        return group

    def publish(self, value: object) -> None:
        """What the leader must know of this rank (JSON), before the start-up barrier."""
        self.store.set(_key(self.rank, "published"), json.dumps(value))

    def _publish_loading(self, load: RankLoad) -> None:
        self.store.set(_key(self.rank, "loading"), load.to_json())

    def report(self, reason: str) -> None:
        """Tell the leader why this rank cannot start (best effort: it may be gone)."""
        with contextlib.suppress(dist.DistError):
            self.store.set(_key(self.rank, "error"), reason)

    def leader_alive(self) -> bool:
        """Whether the leader's store still answers (a dead process's at once)."""
        try:
            self.store.add(_key(self.rank, "beat"), 0)
        except dist.DistError:
            return False
        return True

    def leader_gone(self) -> None:
        print(
            f"{self.spec.role} rank {self.rank}: the group's leader at {self.address} is gone; "
            "exiting",
            file=sys.stderr,
            flush=True,
        )

    def end(self) -> None:
        """The group ended in order (the leader's last plan): stop beating."""
        self._ended.set()

    def _start_beating(self, on_leader_gone: Callable[[], None] | None) -> None:
        def beat() -> None:
            try:
                # Its own connection: the main thread's may sit in a long store wait.
                store = dist.TCPStore(
                    self.spec.addr,
                    self.spec.port,
                    is_master=False,
                    timeout=timedelta(seconds=BEAT_TIMEOUT_S),
                )
                published = None
                while not self._ended.wait(BEAT_S):
                    store.add(_key(self.rank, "beat"), 1)
                    if (now := self.loading.own()) != published:
                        store.set(_key(self.rank, "loading"), now.to_json())
                        published = now
            except dist.DistError:
                if self._ended.wait(_END_GRACE_S):
                    return
                self.leader_gone()
                if on_leader_gone is not None:
                    on_leader_gone()
                os._exit(1)

        threading.Thread(target=beat, name="group-beat", daemon=True).start()
