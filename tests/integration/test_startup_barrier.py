"""A group's start-up barrier waits for its slowest rank's loading as long as TPLA_LOAD_TIMEOUT_S
allows, however short the per-step collective timeout; past it the leader fails naming the rank
that did not arrive. Real processes over gloo."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import NoReturn

import torch

from common.group.setup import init_group, open_comm, startup_barrier
from common.parallel import ParallelConfig
from common.runtime.ports import free_port
from common.runtime.settings import load_settings
from services.decode.config import EngineConfig, engine_config
from services.decode.group.spec import group_spec
from services.prefill.config import prefill_config
from services.prefill.group.spec import group_spec as prefill_group_spec
from tests.rank_exit import leave_group
from tests.spawned_ranks import run_ranks

COLLECTIVE_TIMEOUT_S = 1.0
SLOW_LOAD_S = 3.0


def _rank(cfg_json: str, rank: int, out: mp.Queue) -> NoReturn:
    torch.set_num_threads(1)
    cfg = EngineConfig.from_json(cfg_json)
    spec = group_spec(cfg)
    init_group(spec, rank)
    comm = open_comm(spec, rank, torch.device("cpu"))
    if rank == 1:
        time.sleep(SLOW_LOAD_S)  # loading its share, three collective timeouts long
    try:
        startup_barrier(spec)
    except RuntimeError as exc:
        out.put((rank, f"error: {exc}"))
        leave_group(out)
    t = torch.ones(2)
    comm.sum_(t)  # the group works after it
    out.put((rank, t.tolist()))
    leave_group(out)


def _start(load_timeout_s: float) -> dict[int, object]:
    cfg = EngineConfig(
        model="unused",
        parallel=ParallelConfig(tp=2),
        collectives="dist",
        master_port=free_port(),
        collective_timeout_s=COLLECTIVE_TIMEOUT_S,
        load_timeout_s=load_timeout_s,
    )
    # Past the load timeout only the leader reports (the slow rank is left at the barrier).
    expect = 1 if load_timeout_s < SLOW_LOAD_S else 2
    items, _ = run_ranks(_rank, [(cfg.to_json(), r) for r in range(2)], expect)
    return dict(items)


def test_a_slow_rank_within_the_load_timeout_joins_the_group() -> None:
    assert _start(load_timeout_s=30.0) == {0: [2.0, 2.0], 1: [2.0, 2.0]}


def test_past_the_load_timeout_the_leader_names_the_rank() -> None:
    result = _start(load_timeout_s=1.0)
    assert "error" in str(result[0]) and "Rank 1" in str(result[0]), result


def test_the_setting_reaches_both_kinds_of_group() -> None:
    s = load_settings(model="unused", load_timeout_s=42.0)
    assert group_spec(engine_config(s)).load_timeout_s == 42.0
    assert prefill_group_spec(prefill_config(s).group).load_timeout_s == 42.0
    assert load_settings().load_timeout_s == 1800.0
    assert group_spec(engine_config(s)).collective_timeout_s == 120.0  # unchanged
