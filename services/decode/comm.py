"""The collectives of one decode group's step, over shared memory or torch.distributed."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from common.native.shm_group import ShmGroup


class Comm:
    """The collectives of a decode group; a no-op group of one when tp = 1.

    With a `ShmGroup` (ranks on one host, the native library built) every collective goes
    through shared memory, ~4 us instead of gloo's ~1 ms TCP round trip, which is most of a
    small model's step; otherwise through torch.distributed (gloo, or NCCL on GPUs).
    """

    def __init__(self, tp: int, shm: ShmGroup | None = None) -> None:
        self.tp = tp
        self.shm = shm
        self.bytes = 0  # payload this rank put into collectives (for `tpla bench`)

    def sum_(self, t: Tensor) -> None:
        self._all_reduce(t, "sum")

    def max_(self, t: Tensor) -> None:
        self._all_reduce(t, "max")

    def _all_reduce(self, t: Tensor, op: str) -> None:
        if self.tp == 1:
            return
        self.bytes += t.numel() * t.element_size()
        if self.shm is not None:
            self.shm.all_reduce_(t, op)
        else:
            dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)

    def broadcast_(self, t: Tensor, src: int = 0) -> None:
        if self.tp == 1:
            return
        if self.shm is not None:
            self.shm.broadcast_(t, src)
        else:
            dist.broadcast(t, src=src)

    def all_gather(self, t: Tensor) -> Tensor:
        """[tp, *t.shape]: every rank's tensor, in rank order."""
        if self.tp == 1:
            return t[None]
        self.bytes += t.numel() * t.element_size()
        if self.shm is not None:
            return self.shm.all_gather(t)
        parts = [torch.empty_like(t) for _ in range(self.tp)]
        dist.all_gather(parts, t.contiguous())
        return torch.stack(parts)

    def gather(self, t: Tensor) -> Tensor | None:
        """[tp, *t.shape] on rank 0 (the leader), None on the others: the step's logits,
        which only the leader samples from (large for a real vocabulary)."""
        if self.tp == 1:
            return t[None]
        self.bytes += t.numel() * t.element_size()
        if self.shm is not None:
            return self.shm.gather(t, 0)
        leader = dist.get_rank() == 0
        parts = [torch.empty_like(t) for _ in range(self.tp)] if leader else None
        dist.gather(t.contiguous(), parts, dst=0)
        return torch.stack(parts) if parts is not None else None

    def gather_heads(self, t: Tensor) -> Tensor:
        """Concatenate every rank's head group along dim 1 (rank order = head order)."""
        if self.tp == 1:
            return t
        return torch.cat(list(self.all_gather(t)), dim=1)
