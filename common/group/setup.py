"""How a rank opens its group's collectives: the torch.distributed default group, the
shared-memory group file (made by the leader before its followers start), and the `Comm`
over them."""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from common.group.comm import Comm, DistCollectives, ShmCollectives
from common.group.spec import GroupSpec
from common.native import shm_group
from common.native.shm_group import CollectiveError, ShmGroup
from common.runtime import group_files
from common.runtime.device import rank_device, use_device
from common.runtime.load_meter import current_meter

log = logging.getLogger(__name__)


def init_group(spec: GroupSpec, rank: int, store: dist.Store | None = None) -> None:
    """Make the rank's device this thread's current one (every rank, a group of one included:
    its process must not make a context on GPU 0), then join the group's torch.distributed
    default group: gloo, the CPU control group (and point-to-point transfers on the CPU);
    `open_comm` adds NCCL for a GPU group's data. The rendezvous is the group's store
    (common/group/join.py), else a tcp:// one on the leader's port."""
    use_device(rank_device(spec.device, spec.local_index(rank)))
    if spec.size == 1:
        return
    timeout = timedelta(seconds=spec.collective_timeout_s)
    if store is None:
        init = {"init_method": f"tcp://{spec.address}"}
    else:
        init = {"store": dist.PrefixStore("tpla/pg", store)}
    dist.init_process_group("gloo", world_size=spec.size, rank=rank, timeout=timeout, **init)


def startup_barrier(spec: GroupSpec) -> None:
    """Every rank of the group has loaded its share: the one wait on other ranks' loading,
    bounded by the group's load timeout, not the per-step collective timeout (the gloo
    default group's). A rank that does not arrive is named (gloo's monitored barrier). This
    rank's loading meter, if it is metered, says it has loaded."""
    if (meter := current_meter()) is not None:
        meter.finish()
    if spec.size > 1:
        dist.monitored_barrier(timeout=timedelta(seconds=spec.load_timeout_s))


# Each rank's slot in the group file; larger messages (a big batch's logits) go in rounds.
SHM_SLOT_BYTES = 4 * 2**20


def create_shm_group(spec: GroupSpec) -> str | None:
    """Leader, before starting its followers: make the group's shared-memory file, or None
    (one rank, "dist" asked for, or no native library here: torch.distributed it is)."""
    if spec.collectives != "shm" or spec.size == 1:
        return None
    if not shm_group.available():
        return None
    path = group_files.new_path()
    try:
        group = ShmGroup(path, 0, spec.size, SHM_SLOT_BYTES, spec.collective_timeout_s, True)
    except CollectiveError as exc:  # e.g. /dev/shm too small: gloo still works
        group_files.remove(path)  # an attach that failed after the file was made
        log.warning("shared-memory collectives unavailable, using torch.distributed: %s", exc)
        return None
    group.close()
    return path


def open_shm_group(spec: GroupSpec, rank: int) -> ShmGroup | None:
    if spec.shm_path is None or spec.size == 1:
        return None
    return ShmGroup(
        spec.shm_path, rank, spec.size, SHM_SLOT_BYTES, spec.collective_timeout_s, False
    )


def open_comm(spec: GroupSpec, rank: int, device: torch.device) -> Comm:
    """The rank's control group (shared memory, else gloo) and data group (the same on the
    CPU; NCCL, created here by every rank alike, on GPUs)."""
    if spec.size == 1:
        return Comm(1)
    default = DistCollectives()
    shm = open_shm_group(spec, rank)
    control = default if shm is None else ShmCollectives(shm, default)
    if device.type == "cuda":
        return Comm(spec.size, control, DistCollectives(new_data_group(spec, "nccl")))
    return Comm(spec.size, control, control)


def new_data_group(spec: GroupSpec, backend: str) -> dist.ProcessGroup:
    """A group over every rank on `backend` (NCCL for a GPU group's activations), with the
    group's collective timeout: without one NCCL waits its default 10 minutes on a dead
    rank, where the group must fail within `collective_timeout_s`."""
    return dist.new_group(backend=backend, timeout=timedelta(seconds=spec.collective_timeout_s))
