"""Decode backends (see `interface.py`) and the one place a rank picks its backend."""

from __future__ import annotations

import logging

import torch

from services.decode.config import KERNELS
from services.decode.rank.backends.interface import DecodeBackend
from services.decode.rank.backends.torch_backend import TorchBackend

log = logging.getLogger(__name__)


def _backend_class(name: str) -> type[DecodeBackend]:
    # Imported on demand: the native backend builds C++ libraries on first use, the Triton
    # one imports triton; neither may slow down or break a rank that does not use it.
    if name == "native":
        from services.decode.rank.backends.native_backend import NativeBackend

        return NativeBackend
    if name == "triton":
        from services.decode.rank.backends.triton_backend import TritonBackend

        return TritonBackend
    return TorchBackend


def select_decode_backend(name: str, device: torch.device, dtype: torch.dtype) -> DecodeBackend:
    """The backend of a rank on `device` computing in `dtype` (TPLA_DECODE_KERNEL).

    `auto` takes the native kernels on the CPU (fp32) and Triton on CUDA, each where it can
    run, else the torch reference. A named backend that cannot run here logs why and runs
    the torch backend, so a deployment never fails over a kernel (the placement itself is
    checked before this: asking for a device that does not exist is an error).
    """
    if name not in KERNELS:
        raise ValueError(f"decode kernel {name!r} is not one of {', '.join(KERNELS)}")
    if name == "auto":
        preferred = "native" if device.type == "cpu" else "triton"
        cls = _backend_class(preferred)
        return (cls if cls.unsupported(device, dtype) is None else TorchBackend)()
    cls = _backend_class(name)
    reason = cls.unsupported(device, dtype)
    if reason is not None:
        log.warning("decode kernel %r cannot run here (%s); using the torch kernel", name, reason)
        return TorchBackend()
    return cls()


__all__ = ["DecodeBackend", "TorchBackend", "select_decode_backend"]
