"""A rank group's communication: a control group for plans, a data group for activations.

Decode groups and prefill groups both run over it.

The leader's step plans and other small integers are CPU tensors and travel over the
*control* group; the step's activations (all-reduces of the hidden state, the SP merge, the
logits gathered to the leader, KV shards the leader forwards) live on the ranks' device and
travel over the *data* group. On the CPU both are one group: shared memory when the ranks
share a host and the native library is built (~4 us a collective, where gloo's TCP loopback
took ~1 ms, most of a small model's step), else torch.distributed's gloo. On GPUs the data
group is NCCL and the control group stays on the CPU (shared memory or gloo), so a plan
never waits behind a device queue. Every point-to-point and collective of the engine goes
through `Comm`; its launches on a GPU hold the device's launch order
(common/runtime/launch_order.py), which the KV pairs' launches share.
"""

from __future__ import annotations

import abc
import enum

import torch
import torch.distributed as dist
from torch import Tensor

from common.native.shm_group import ShmGroup
from common.runtime.launch_order import launch_order


class ReduceOp(enum.Enum):
    SUM = "sum"
    MAX = "max"


class Collectives(abc.ABC):
    """One process group's operations, for tensors on the group's device."""

    @abc.abstractmethod
    def all_reduce_(self, t: Tensor, op: ReduceOp) -> None:
        """In place, over every rank."""

    @abc.abstractmethod
    def broadcast_(self, t: Tensor, src: int) -> None:
        """In place: every rank ends with rank `src`'s tensor."""

    @abc.abstractmethod
    def all_gather(self, t: Tensor) -> Tensor:
        """[world, *t.shape]: every rank's tensor, in rank order."""

    @abc.abstractmethod
    def gather(self, t: Tensor, dst: int) -> Tensor | None:
        """[world, *t.shape] on rank `dst`, None on the others."""

    @abc.abstractmethod
    def send(self, t: Tensor, dst: int) -> None: ...

    @abc.abstractmethod
    def recv(self, t: Tensor, src: int) -> None:
        """Into `t`, which has the sent tensor's shape and dtype."""

    @abc.abstractmethod
    def barrier(self) -> None: ...


class DistCollectives(Collectives):
    """torch.distributed on `group` (None: the default group): gloo for CPU tensors, NCCL
    for CUDA tensors."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def all_reduce_(self, t: Tensor, op: ReduceOp) -> None:
        reduce = dist.ReduceOp.SUM if op is ReduceOp.SUM else dist.ReduceOp.MAX
        dist.all_reduce(t, op=reduce, group=self.group)

    def broadcast_(self, t: Tensor, src: int) -> None:
        dist.broadcast(t, src=src, group=self.group)

    def all_gather(self, t: Tensor) -> Tensor:
        if t.is_cuda:
            out = t.new_empty((self.world, *t.shape))
            dist.all_gather_into_tensor(out, t.contiguous(), group=self.group)
            return out
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.stack(parts)

    def gather(self, t: Tensor, dst: int) -> Tensor | None:
        # NCCL and gloo both gather (NCCL as sends to dst): only dst receives the others'
        # tensors, where an all-gather would put every rank's logits on every rank.
        out = t.new_empty((self.world, *t.shape)) if self.rank == dst else None
        parts = list(out.unbind()) if out is not None else None
        dist.gather(t.contiguous(), parts, dst=dst, group=self.group)
        return out

    def send(self, t: Tensor, dst: int) -> None:
        dist.send(t.contiguous(), dst=dst, group=self.group)

    def recv(self, t: Tensor, src: int) -> None:
        dist.recv(t, src=src, group=self.group)

    def barrier(self) -> None:
        dist.barrier(group=self.group)


class ShmCollectives(Collectives):
    """Shared-memory collectives between the processes of one host (CPU tensors).

    Point-to-point transfers and the barrier are rare (a KV shard the leader forwards, the
    start-up barrier) and go through `p2p`, torch.distributed's default group.
    """

    def __init__(self, group: ShmGroup, p2p: DistCollectives) -> None:
        self.group, self.p2p = group, p2p

    def all_reduce_(self, t: Tensor, op: ReduceOp) -> None:
        self.group.all_reduce_(t, op.value)

    def broadcast_(self, t: Tensor, src: int) -> None:
        self.group.broadcast_(t, src)

    def all_gather(self, t: Tensor) -> Tensor:
        return self.group.all_gather(t)

    def gather(self, t: Tensor, dst: int) -> Tensor | None:
        return self.group.gather(t, dst)

    def send(self, t: Tensor, dst: int) -> None:
        self.p2p.send(t, dst)

    def recv(self, t: Tensor, src: int) -> None:
        self.p2p.recv(t, src)

    def barrier(self) -> None:
        self.p2p.barrier()


class Comm:
    """What a decode rank's step and the leader's plans use; a no-op group of one at tp = 1.

    `control` carries plans (CPU tensors), `data` the activations on the rank's device.
    """

    def __init__(
        self, tp: int, control: Collectives | None = None, data: Collectives | None = None
    ) -> None:
        if tp > 1 and (control is None or data is None):
            raise ValueError("a group of several ranks needs its control and data groups")
        self.tp = tp
        self.control = control
        self.data = data if data is not None else control
        self.bytes = 0  # activation payload this rank put into collectives (`tpla bench`)

    @property
    def _data(self) -> Collectives:
        assert self.data is not None  # tp > 1 (checked in __init__)
        return self.data

    @property
    def _control(self) -> Collectives:
        assert self.control is not None
        return self.control

    def sum_(self, t: Tensor) -> None:
        self._all_reduce(t, ReduceOp.SUM)

    def max_(self, t: Tensor) -> None:
        self._all_reduce(t, ReduceOp.MAX)

    def _all_reduce(self, t: Tensor, op: ReduceOp) -> None:
        if self.tp == 1:
            return
        self.bytes += t.numel() * t.element_size()
        with launch_order(t.device):
            self._data.all_reduce_(t, op)

    def broadcast_plan_(self, t: Tensor) -> None:
        """The leader's plan words (CPU int64) to every rank, in place."""
        if self.tp > 1:
            self._control.broadcast_(t, 0)

    def all_gather(self, t: Tensor) -> Tensor:
        """[tp, *t.shape]: every rank's tensor, in rank order."""
        if self.tp == 1:
            return t[None]
        self.bytes += t.numel() * t.element_size()
        with launch_order(t.device):
            return self._data.all_gather(t)

    def gather(self, t: Tensor) -> Tensor | None:
        """[tp, *t.shape] on rank 0 (the leader), None on the others: the step's logits,
        which only the leader samples from (large for a real vocabulary)."""
        if self.tp == 1:
            return t[None]
        self.bytes += t.numel() * t.element_size()
        with launch_order(t.device):
            return self._data.gather(t, 0)

    def gather_heads(self, t: Tensor) -> Tensor:
        """Concatenate every rank's head group along dim 1 (rank order = head order)."""
        if self.tp == 1:
            return t
        return torch.cat(list(self.all_gather(t)), dim=1)

    def send(self, t: Tensor, dst: int) -> None:
        """A device tensor to one rank (a KV shard the leader received for it)."""
        with launch_order(t.device):
            self._data.send(t, dst)

    def recv(self, t: Tensor, src: int) -> None:
        with launch_order(t.device):
            self._data.recv(t, src)

    def barrier(self) -> None:
        if self.tp > 1:
            self._control.barrier()
