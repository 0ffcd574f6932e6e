"""Decode backends (see `interface.py`) and the one place a rank picks its backend."""

from __future__ import annotations

from functools import partial

import torch

from common.runtime.kernel_choice import KernelChoice, choose_kernel
from services.decode.rank.backends.interface import DecodeBackend
from services.decode.rank.backends.torch_backend import TorchBackend


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


_NAMES = ("torch", "native", "triton")


def _unsupported(name: str, device: torch.device, dtype: torch.dtype) -> str | None:
    return _backend_class(name).unsupported(device, dtype)


def select_decode_kernel(asked: str, device: torch.device, dtype: torch.dtype) -> KernelChoice:
    """The backend of a rank on `device` computing in `dtype` (TPLA_DECODE_KERNEL: auto |
    torch | native | triton), by the kernel-choice rule: `auto` tries the native kernels on
    the CPU, Triton on CUDA, then the torch reference (the placement itself is checked
    before this: asking for a device that does not exist is an error)."""
    checks = {name: partial(_unsupported, name, device, dtype) for name in _NAMES}
    auto = ("native" if device.type == "cpu" else "triton", "torch")
    return choose_kernel("decode_attention", asked, checks, auto)


def decode_backend(kernel: str) -> DecodeBackend:
    """The backend of a chosen kernel (`select_decode_kernel`): torch | native | triton."""
    return _backend_class(kernel)()


__all__ = ["DecodeBackend", "TorchBackend", "decode_backend", "select_decode_kernel"]
