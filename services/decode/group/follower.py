"""A follower rank's process: join the group, then run the leader's plans until it ends.

One the leader spawned runs `python -m services.decode.group.follower RANK LEADER_PID` with
the leader's config as JSON in TPLA_ENGINE_CONFIG (nothing but JSON and tensors crosses a
process boundary); a rank started on its own (`tpla decode --rank K`) builds its config from
its settings and calls `follower_main`. Both join the group the same way
(common/group/join.py). A spawned one ignores SIGINT / SIGTERM: its leader ends it.
"""

from __future__ import annotations

import functools
import os
import signal
import sys

import torch.distributed as dist

from common.group.child import START_ERROR_EXIT, exit_with_parent
from common.group.join import FollowerGroup
from common.group.setup import init_group
from common.runtime import group_files
from services.decode.config import EngineConfig
from services.decode.group.spec import group_spec
from services.decode.group.step_plan import CopyPlan, DecodePlan, PingPlan, recv_plan
from services.decode.rank.runtime import RankRuntime

# The leader hands a follower its config in the environment, not on the command line: the
# config holds the internal token, and any local user can read a process's arguments.
CONFIG_ENV = "TPLA_ENGINE_CONFIG"
# Run as `python -m services.decode.group.follower RANK LEADER_PID`.
FOLLOWER_MODULE = "services.decode.group.follower"


def follower_main(cfg: EngineConfig, rank: int, leader: int | None = None) -> int:
    """A follower rank: join the group, execute the leader's plans until shutdown; the exit
    code. `leader`: the pid of the leader that spawned this process (None: started on its own).

    Until the start-up barrier a spawned group's file has a name: a follower that fails to
    start, or sees its leader gone, removes it, since the group cannot start. A start-up
    error of its configuration (a port in use, a config that differs from the leader's) is
    one line on stderr, reported to the leader through the group's store, and
    START_ERROR_EXIT."""
    remove_file = functools.partial(group_files.remove, cfg.shm_path)
    if leader is not None:
        exit_with_parent(leader, remove_file)
    group: FollowerGroup | None = None
    try:
        spec = group_spec(cfg)
        group = FollowerGroup.join(spec, rank, remove_file)
        init_group(spec, rank, group.store)
        runtime = RankRuntime(cfg, rank)
        receiver = runtime.start_kv_receiver()
        group.publish(list(cfg.kv_addresses(rank) if receiver else ("", "")))
        runtime.comm.barrier()  # the leader waits until every rank has loaded its share
        if leader is None:
            kv = cfg.kv_addresses(rank)[0] if receiver else "none"
            print(
                f"decode rank {rank} of {cfg.parallel.tp} joined the group at "
                f"{group.address} (KV receiver {kv})",
                flush=True,
            )
    except BaseException as exc:
        remove_file()
        if isinstance(exc, ValueError | FileNotFoundError):  # as tools/cli/main.py main
            if group is not None:
                group.report(str(exc))
            print(f"decode rank {rank}: error: {exc}", file=sys.stderr, flush=True)
            return START_ERROR_EXIT
        raise
    try:
        run_plans(runtime)
    except RuntimeError:  # a collective broke (gloo's closed connection, CollectiveError)
        if group.leader_alive():
            raise  # this rank's own failure: its traceback
        group.end()
        group.leader_gone()
        return 1
    group.end()
    if receiver is not None:
        receiver.stop(grace=1)
    dist.destroy_process_group()
    return 0


def run_plans(runtime: RankRuntime) -> None:
    """Execute the leader's plans until its shutdown plan."""
    while True:
        plan = recv_plan(runtime.comm)
        if plan is None:
            return
        if isinstance(plan, DecodePlan):
            runtime.comm.gather(runtime.step(plan))  # to the leader, which samples
        elif isinstance(plan, PingPlan):
            continue
        elif isinstance(plan, CopyPlan):
            runtime.copy_blocks(plan)
        else:
            runtime.receive_write(plan)


if __name__ == "__main__":
    # python -m services.decode.group.follower RANK LEADER_PID
    # A signal to the leader's process group (Ctrl-C, a supervisor's stop) must not break the
    # group under a draining leader: the leader's last plan ends this rank, or its death
    # (exit_with_parent).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    sys.exit(
        follower_main(
            EngineConfig.from_json(os.environ.pop(CONFIG_ENV)), int(sys.argv[1]), int(sys.argv[2])
        )
    )
