"""A decode group's Comm and step plans between real processes (gloo, shared memory)."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
from typing import NoReturn

import pytest
import torch

from common.group.comm import Comm, ShmCollectives
from common.group.setup import create_shm_group, init_group, open_comm
from common.native import shm_group
from common.parallel import ParallelConfig
from common.runtime.ports import free_port
from services.decode.config import EngineConfig
from services.decode.group.spec import group_spec
from services.decode.step_plan import (
    DecodePlan,
    PingPlan,
    TableEdits,
    WritePlan,
    recv_plan,
    send_plan,
)
from tests.rank_exit import leave_group
from tests.spawned_ranks import run_ranks

WORLD = 2


def _rank(cfg_json: str, rank: int, out: mp.Queue) -> NoReturn:
    torch.set_num_threads(1)
    cfg = EngineConfig.from_json(cfg_json)
    init_group(group_spec(cfg), rank)
    comm = open_comm(group_spec(cfg), rank, torch.device("cpu"))
    results: dict[str, object] = {"shm": isinstance(comm.data, ShmCollectives)}
    t = torch.arange(6, dtype=torch.float32) * (rank + 1)
    comm.sum_(t)
    results["sum"] = t.tolist()
    m = torch.tensor([float(rank), -float(rank)])
    comm.max_(m)
    results["max"] = m.tolist()
    results["all_gather"] = comm.all_gather(torch.full((2, 3), float(rank))).tolist()
    gathered = comm.gather(torch.full((4,), float(rank) + 0.5))
    results["gather"] = None if gathered is None else gathered.tolist()
    results["heads"] = comm.gather_heads(torch.full((1, 2, 3), float(rank))).shape
    # A KV shard the leader forwards: point to point, after its write plan.
    if rank == 0:
        send_plan(WritePlan(1, torch.tensor([3, 9, 4])), comm)
        comm.send(torch.arange(12, dtype=torch.float32).view(3, 4), 1)
        plans = [
            DecodePlan(
                torch.tensor([5, 6]),
                torch.tensor([10, 0]),
                torch.tensor([1, 0]),
                3,
                TableEdits.whole(torch.arange(6).view(1, 2, 3)),
            ),
            PingPlan(),
            None,
        ]
        for plan in plans:
            send_plan(plan, comm)
    else:
        write = recv_plan(comm)
        assert isinstance(write, WritePlan)
        shard = torch.empty(3, 4)
        comm.recv(shard, 0)
        results["write"] = (write.target, write.slots.tolist(), shard.flatten().tolist())
        decode = recv_plan(comm)
        assert isinstance(decode, DecodePlan)
        results["decode"] = [decode.tokens.tolist(), decode.positions.tolist()]
        results["tables"] = [decode.slots.tolist(), decode.width, decode.edits.blocks.tolist()]
        results["runs"] = decode.edits.runs.tolist()
        results["ping"] = isinstance(recv_plan(comm), PingPlan)
        results["shutdown"] = recv_plan(comm) is None
    comm.barrier()
    results["bytes"] = comm.bytes
    out.put((rank, results))
    leave_group(out)


@pytest.mark.parametrize("collectives", ["shm", "dist"])
def test_comm_and_plans_between_two_ranks(collectives: str) -> None:
    if collectives == "shm" and not shm_group.available():
        pytest.skip("native library unavailable")
    cfg = EngineConfig(
        model="unused",
        parallel=ParallelConfig(tp=WORLD),
        collectives=collectives,
        master_port=free_port(),
        collective_timeout_s=30,
    )
    cfg = dataclasses.replace(cfg, shm_path=create_shm_group(group_spec(cfg)))
    try:
        items, codes = run_ranks(_rank, [(cfg.to_json(), r) for r in range(WORLD)])
    finally:
        if cfg.shm_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(cfg.shm_path)
    results = dict(items)
    assert codes == [0, 0]
    for rank in range(WORLD):
        r = results[rank]
        assert r["shm"] == (collectives == "shm")
        assert r["sum"] == [3.0 * i for i in range(6)]
        assert r["max"] == [1.0, 0.0]
        assert r["all_gather"] == [[[0.0] * 3] * 2, [[1.0] * 3] * 2]
        assert r["heads"] == (1, 4, 3)
        # Activations only: the plans and the forwarded shard are not counted.
        assert r["bytes"] == 4 * (6 + 2 + 6 + 4 + 6)
    assert results[0]["gather"] == [[0.5] * 4, [1.5] * 4]
    assert results[1]["gather"] is None
    assert results[1]["write"] == (1, [3, 9, 4], [float(i) for i in range(12)])
    assert results[1]["decode"] == [[5, 6], [10, 0]]
    assert results[1]["tables"] == [[1, 0], 3, [0, 1, 2, 3, 4, 5]]
    assert results[1]["runs"] == [[0, 0], [0, 1], [0, 0], [3, 3]]
    assert results[1]["ping"] and results[1]["shutdown"]


def test_a_group_of_one_needs_no_groups_and_a_larger_one_does() -> None:
    comm = Comm(1)
    t = torch.ones(3)
    comm.sum_(t)
    comm.barrier()
    assert t.tolist() == [1.0, 1.0, 1.0] and comm.gather(t).shape == (1, 3)
    assert comm.bytes == 0
    with pytest.raises(ValueError, match="control and data"):
        Comm(2)
