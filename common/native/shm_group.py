"""Shared-memory collectives for the ranks of one group, decode or prefill (shm_collectives.cpp).

A drop-in for the few torch.distributed collectives a decode step makes (all-reduce sum /
max, broadcast, all-gather) between processes on one host, at memcpy speed instead of
gloo's ~1 ms TCP round trips. The leader creates the group's file before it starts its
followers; each rank attaches; the leader unlinks the file once all are attached (the
mappings live on, and nothing is left behind if a rank crashes later).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os

import torch
from torch import Tensor

from common.native.library import NativeUnavailable, load

_STATUS = {1: "timed out", 2: "a peer rank died", 3: "bad arguments"}
_SUM, _MAX = 0, 1


class CollectiveError(RuntimeError):
    """A shared-memory collective failed: a peer died or it did not arrive in time."""


@functools.cache
def _library() -> ctypes.CDLL:
    lib = load("shm_collectives")
    lib.tpla_shm_attach.restype = ctypes.c_void_p
    lib.tpla_shm_attach.argtypes = [
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_uint64,
        ctypes.c_int,
    ]
    lib.tpla_shm_detach.argtypes = [ctypes.c_void_p]
    lib.tpla_shm_all_reduce.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_double,
    ]
    lib.tpla_shm_broadcast.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_double,
    ]
    lib.tpla_shm_all_gather.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_double,
    ]
    for fn in (lib.tpla_shm_all_reduce, lib.tpla_shm_broadcast, lib.tpla_shm_all_gather):
        fn.restype = ctypes.c_int
    return lib


def available() -> bool:
    try:
        _library()
    except NativeUnavailable:
        return False
    return os.path.isdir("/dev/shm")


class ShmGroup:
    """One rank's handle on its group. Every rank must make the same sequence of calls."""

    def __init__(
        self, path: str, rank: int, world: int, slot_bytes: int, timeout_s: float, create: bool
    ) -> None:
        lib = _library()
        handle = lib.tpla_shm_attach(path.encode(), rank, world, slot_bytes, int(create))
        if not handle:
            err = ctypes.get_errno()
            raise CollectiveError(f"cannot attach the group file {path}: {os.strerror(err)}")
        self._lib, self._handle = lib, handle
        self.path, self.rank, self.world, self.timeout_s = path, rank, world, timeout_s

    def close(self) -> None:
        if self._handle:
            self._lib.tpla_shm_detach(self._handle)
            self._handle = None

    def unlink(self) -> None:
        """Remove the file's name (the leader, once every rank is attached)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    @staticmethod
    def _cpu(t: Tensor) -> None:
        if not t.is_cpu:
            raise CollectiveError("shared-memory collectives take CPU tensors")

    def _check(self, status: int, what: str) -> None:
        if status:
            raise CollectiveError(f"{what} across the rank group: {_STATUS.get(status, status)}")

    def all_reduce_(self, t: Tensor, op: str = "sum") -> None:
        """In place; fp32 directly, other dtypes through an fp32 copy."""
        self._cpu(t)
        work = t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()
        code = _SUM if op == "sum" else _MAX
        status = self._lib.tpla_shm_all_reduce(
            self._handle, work.data_ptr(), work.numel(), code, self.timeout_s
        )
        self._check(status, "all-reduce")
        if work is not t:
            t.copy_(work)

    def broadcast_(self, t: Tensor, src: int = 0) -> None:
        self._cpu(t)
        work = t if t.is_contiguous() else t.contiguous()
        nbytes = work.numel() * work.element_size()
        status = self._lib.tpla_shm_broadcast(
            self._handle, work.data_ptr(), nbytes, src, self.timeout_s
        )
        self._check(status, "broadcast")
        if work is not t:
            t.copy_(work)

    def all_gather(self, t: Tensor) -> Tensor:
        """[world, *t.shape]: every rank's tensor, in rank order."""
        out = self._gather(t, root=-1)
        assert out is not None
        return out

    def gather(self, t: Tensor, dst: int = 0) -> Tensor | None:
        """[world, *t.shape] on rank `dst`, None on the others (which copy nothing out)."""
        return self._gather(t, root=dst)

    def _gather(self, t: Tensor, root: int) -> Tensor | None:
        self._cpu(t)
        work = t.contiguous()
        keep = root < 0 or root == self.rank
        out = torch.empty((self.world, *work.shape), dtype=work.dtype) if keep else None
        nbytes = work.numel() * work.element_size()
        status = self._lib.tpla_shm_all_gather(
            self._handle,
            work.data_ptr(),
            nbytes,
            out.data_ptr() if out is not None else None,
            root,
            self.timeout_s,
        )
        self._check(status, "gather")
        return out
