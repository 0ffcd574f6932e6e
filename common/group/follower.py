"""A follower rank's life in any rank group (a decode group's, a prefill group's): join the
leader, build the rank's share, run the leader's plans until its end, then end the process.

Until the start-up barrier a spawned group's file has a name: a follower that fails to
start, or sees its leader gone, removes it, since the group cannot start. A start-up error
of its configuration (a port in use, a config that differs from the leader's) is one line
on stderr, reported to the leader through the group's store, and START_ERROR_EXIT. While the
group runs, a follower waits for each plan in a collective bounded by the collective
timeout; an idle leader pings well inside it, so a wait that times out means the leader
hangs: the follower says so in one line and exits 1 (`next_plan`).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn, TypeVar

import torch.distributed as dist

from common.group.child import START_ERROR_EXIT, end_process, exit_with_parent
from common.group.errors import LeaderSilent
from common.group.join import FollowerGroup
from common.group.local_ranks import LocalRanks
from common.group.setup import init_group
from common.group.spec import GroupSpec
from common.runtime import group_files
from common.runtime.load_meter import metering

Rank = TypeVar("Rank")
Plan = TypeVar("Plan")


def next_plan(spec: GroupSpec, rank: int, receive: Callable[[], Plan]) -> Plan:
    """The leader's next plan (or ping) as `receive` reads it; LeaderSilent when its wait
    broke (`run_follower` tells a leader that hangs from one that is gone)."""
    try:
        return receive()
    except RuntimeError as exc:  # gloo's timeout or closed connection, CollectiveError
        raise LeaderSilent(
            f"{spec.role} rank {rank}: neither a plan nor a ping from the group's leader within "
            f"{spec.collective_timeout_s:g} s (the collective timeout): {exc}"
        ) from exc


def run_follower(
    spec: GroupSpec,
    rank: int,
    shm_path: str | None,
    leader: int | None,
    start: Callable[[FollowerGroup], Rank],
    serve: Callable[[Rank], None],
    close: Callable[[Rank], None],
    local: LocalRanks | None = None,
) -> NoReturn:
    """Follower `rank` of the group `spec` describes, to the end of its process. `leader`: the
    pid of the leader that spawned this process (None: started on its own). `start` builds
    the rank once the process group is up and returns after the group's start-up barrier;
    `serve` runs the leader's plans until its shutdown plan; `close` frees what `start`
    opened. `local`: the ranks this process spawns beside itself, the first of its host (one
    pod per node): started before the join, and a rank of them that fails ends this process
    too (its host's share of the group is gone). Exit code: 0 when the leader ended the
    group, START_ERROR_EXIT after a start-up error it printed, 1 when the leader died under
    a collective or a rank it spawned failed; this rank's own failure raises (its
    traceback)."""
    remove_file = functools.partial(group_files.remove, shm_path)
    if leader is not None:
        exit_with_parent(leader, remove_file)
    ended = threading.Event()
    if local is not None:
        local.start()
        _watch(local, f"{spec.role} rank {rank}", ended)
    group: FollowerGroup | None = None
    try:
        group = FollowerGroup.join(spec, rank, remove_file)
        init_group(spec, rank, group.store)
        with metering(group.loading):  # its reads, published by its beat
            state = start(group)
    except BaseException as exc:
        remove_file()
        if isinstance(exc, ValueError | FileNotFoundError):  # as tools/cli/main.py main
            if group is not None:
                group.report(str(exc))
            print(f"{spec.role} rank {rank}: error: {exc}", file=sys.stderr, flush=True)
            end_process(START_ERROR_EXIT)
        raise
    try:
        serve(state)
    except RuntimeError as exc:  # a collective broke (gloo's closed connection, CollectiveError)
        if group.leader_alive():
            if not isinstance(exc, LeaderSilent):
                raise  # this rank's own failure: its traceback
            group.end()
            print(f"{exc}; exiting", file=sys.stderr, flush=True)
            end_process(1)
        group.end()
        group.leader_gone()
        end_process(1)
    group.end()
    ended.set()
    close(state)
    if local is not None:
        local.stop(grace_s=10.0)
    dist.destroy_process_group()
    end_process(0)


def _watch(local: LocalRanks, name: str, ended: threading.Event) -> None:
    """End this process when a rank it spawned fails, until the group's orderly end."""

    def watch() -> None:
        while not ended.wait(0.5):
            if (failed := local.failed()) is not None:
                rank, code = failed
                print(
                    f"{name}: rank {rank}, spawned beside it, exited with code {code}; exiting",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(1)

    threading.Thread(target=watch, name="local-ranks-watch", daemon=True).start()
