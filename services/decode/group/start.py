"""The leader's start-up of its decode group.

Open the group's rendezvous, spawn ranks 1..tp-1 here or wait for them to join from
elsewhere, bounded (common/group/processes.py), load this rank's share, meet every
rank at a barrier, and learn where each rank's KV receiver is. A start that fails stops
what it started and names a follower's own start-up error as the cause.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch.distributed as dist

from common.group.processes import GroupProcesses
from common.group.setup import create_shm_group, init_group, startup_barrier
from common.runtime import group_files
from common.runtime.device import rank_device
from common.runtime.load_meter import current_meter
from common.runtime.ports import free_port
from services.decode.config import EngineConfig, Launch
from services.decode.group.follower import spawned_ranks
from services.decode.group.share import expect_share
from services.decode.group.spec import group_spec
from services.decode.rank.runtime import RankRuntime

if TYPE_CHECKING:
    import grpc


@dataclass
class RunningGroup:
    """A started group as its leader holds it."""

    cfg: EngineConfig  # as started: its rendezvous port and group file filled in
    processes: GroupProcesses
    runtime: RankRuntime  # rank 0, in this process
    receiver: grpc.Server | None  # rank 0's KV receiver
    kv_endpoints: list[tuple[str, str]]  # per rank: where it receives its KV shards

    def stop(self) -> None:
        """Stop rank 0's KV receiver and the followers (after the loop's last plan)."""
        if self.receiver is not None:
            self.receiver.stop(grace=1)
        self.processes.stop()


def start_group(cfg: EngineConfig) -> RunningGroup:
    """Start the group `cfg` describes with this process as rank 0; blocks until every rank
    has loaded its share (or raises the reason the group cannot start)."""
    # Every device of this host's ranks exists (one GPU per rank), checked before anything
    # starts.
    spawn = cfg.launch is Launch.SPAWN
    rank_device(cfg.device, cfg.per_host - 1)
    if cfg.parallel.tp > 1 and cfg.master_port == 0:
        cfg = replace(cfg, master_port=free_port())
    shm_path = create_shm_group(group_spec(cfg)) if spawn else None
    cfg = replace(cfg, shm_path=shm_path)
    spec = group_spec(cfg)
    processes = GroupProcesses(spec, spawned_ranks(cfg, 0))
    receiver: grpc.Server | None = None
    try:
        if (meter := current_meter()) is not None:  # the service's: the group's progress
            meter.follow(processes.loading)
        processes.start()
        init_group(spec, 0, processes.store)
        expect_share(cfg, 0)
        runtime = RankRuntime(cfg, 0, group_spec(cfg))
        receiver = runtime.start_kv_receiver()
        startup_barrier(spec)
        # Where each rank receives its KV shards: its own receiver, wherever it runs.
        own = cfg.kv_addresses(0) if receiver is not None else ("", "")
        endpoints = [own, *((str(e[0]), str(e[1])) for e in processes.published())]
    except BaseException as exc:
        _abort_start(processes, receiver, exc)
        raise
    finally:
        # Every rank has mapped the group file by the barrier (or failed): its name can go.
        group_files.remove(shm_path)
    return RunningGroup(cfg, processes, runtime, receiver, endpoints)


def _abort_start(
    processes: GroupProcesses, receiver: grpc.Server | None, exc: BaseException
) -> None:
    """The group failed to start: stop the followers (a follower's own start-up error has
    ended it already), and raise a follower's reported error as the cause."""
    if receiver is not None:
        receiver.stop(grace=0)
    processes.stop(grace_s=1.0)
    if dist.is_initialized():  # a later engine in this process starts a group again
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    processes.raise_start_error(exc)
