"""A follower rank's process: join the group, then run the leader's plans until it ends.

One the leader spawned runs `python -m services.decode.group.follower RANK LEADER_PID` with
the leader's config as JSON in TPLA_ENGINE_CONFIG (nothing but JSON and tensors crosses a
process boundary); a rank started on its own (`tpla decode --rank K`, or the first rank of a
host, `tpla decode --node K`) builds its config from its settings and calls `follower_main`,
which spawns the rest of its host's ranks the same way. All join the group alike
(common/group/join.py). A spawned one ignores SIGINT / SIGTERM: its leader ends it.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import NoReturn

from common.group.follower import next_plan, run_follower
from common.group.join import FollowerGroup
from common.group.local_ranks import LocalRanks
from common.group.setup import startup_barrier
from common.group.spec import GroupSpec
from services.decode.config import EngineConfig
from services.decode.group.share import expect_share
from services.decode.group.spec import group_spec
from services.decode.rank.runtime import RankRuntime
from services.decode.step_plan import (
    CopyPlan,
    DecodePlan,
    EpochPlan,
    PingPlan,
    PrefillPlan,
    recv_plan,
)

# The leader hands a follower its config in the environment, not on the command line: the
# config holds the internal token, and any local user can read a process's arguments.
CONFIG_ENV = "TPLA_ENGINE_CONFIG"
# Run as `python -m services.decode.group.follower RANK LEADER_PID`.
FOLLOWER_MODULE = "services.decode.group.follower"


def follower_main(cfg: EngineConfig, rank: int, leader: int | None = None) -> NoReturn:
    """A follower rank: join the group, execute the leader's plans until shutdown, then end
    the process with its exit code (common/group/follower.py). `leader`: the pid of the
    leader that spawned this process (None: started on its own)."""
    receiver = None

    def start(group: FollowerGroup) -> RankRuntime:
        nonlocal receiver
        expect_share(cfg, rank)
        runtime = RankRuntime(cfg, rank, group_spec(cfg))
        receiver = runtime.start_kv_receiver()
        group.publish(list(cfg.kv_addresses(rank) if receiver else ("", "")))
        startup_barrier(group.spec)  # the leader waits until every rank has loaded its share
        if leader is None:
            kv = cfg.kv_addresses(rank)[0] if receiver else "none"
            print(
                f"decode rank {rank} of {cfg.parallel.tp} joined the group at "
                f"{group.address} (KV receiver {kv})",
                flush=True,
            )
        return runtime

    def close(_: RankRuntime) -> None:
        if receiver is not None:
            receiver.stop(grace=1)

    spec = group_spec(cfg)
    local = spawned_ranks(cfg, rank) if leader is None else None
    return run_follower(
        spec, rank, cfg.shm_path, leader, start, lambda rt: run_plans(spec, rank, rt), close, local
    )


def spawned_ranks(cfg: EngineConfig, first: int) -> LocalRanks:
    """The ranks the process running rank `first` spawns beside it: the rest of its host's."""
    return LocalRanks(group_spec(cfg), first, ["-m", FOLLOWER_MODULE], {CONFIG_ENV: cfg.to_json()})


def run_plans(spec: GroupSpec, rank: int, runtime: RankRuntime) -> None:
    """Execute the leader's plans until its shutdown plan."""
    while True:
        plan = next_plan(spec, rank, lambda: recv_plan(runtime.comm))
        if plan is None:
            return
        if isinstance(plan, DecodePlan):
            runtime.comm.gather(runtime.step(plan))  # to the leader, which samples
        elif isinstance(plan, PingPlan):
            continue
        elif isinstance(plan, CopyPlan):
            runtime.copy_blocks(plan)
        elif isinstance(plan, EpochPlan):
            runtime.give_blocks(plan)
        elif isinstance(plan, PrefillPlan):
            if (logits := runtime.prefill(plan)) is not None:
                runtime.comm.gather(logits)
        else:
            runtime.receive_write(plan)


if __name__ == "__main__":
    # python -m services.decode.group.follower RANK LEADER_PID
    # A signal to the leader's process group (Ctrl-C, a supervisor's stop) must not break the
    # group under a draining leader: the leader's last plan ends this rank, or its death
    # (exit_with_parent).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    follower_main(
        EngineConfig.from_json(os.environ.pop(CONFIG_ENV)), int(sys.argv[1]), int(sys.argv[2])
    )
