"""A decode group's data group carries the group's collective timeout (a group of one on
gloo here; NCCL takes the same call on GPUs), so a dead rank fails it in that time, not in
NCCL's default 10 minutes."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from common.group.setup import new_data_group
from common.parallel import ParallelConfig
from services.decode.config import EngineConfig
from services.decode.group.spec import group_spec


def test_the_data_group_has_the_collective_timeout() -> None:
    cfg = EngineConfig(model="unused", parallel=ParallelConfig(tp=2), collective_timeout_s=7.5)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = new_data_group(group_spec(cfg), "gloo")
        backend = group._get_backend(torch.device("cpu"))
        assert backend.options._timeout == timedelta(seconds=7.5)
    finally:
        dist.destroy_process_group()
