"""Where a process puts its tensors: the one place a device name is read and checked.

`TPLA_DEVICE` is `auto` (CUDA when a GPU is visible, else the CPU), `cpu`, `cuda` or
`cuda:N`; `TPLA_DTYPE` is `auto` (bf16 on CUDA, fp32 on the CPU) or a torch dtype name.
Asking for CUDA where there is none is a `DeviceError` at start-up, never a silent CPU
fallback: a user who asked for a GPU server must not get a CPU one.
"""

from __future__ import annotations

import torch


class DeviceError(ValueError):
    """The requested device (or dtype) does not exist here: a configuration error, reported
    at start-up like every other."""


def resolve_device(name: str) -> str:
    """`auto` -> `cuda` or `cpu`; any other name is checked and returned as given."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise DeviceError(f"unknown device {name!r} (auto, cpu, cuda, cuda:N)") from exc
    if device.type not in ("cpu", "cuda"):
        raise DeviceError(f"device {name!r} is not supported (auto, cpu, cuda, cuda:N)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(
            f"device {name!r} was asked for (TPLA_DEVICE / --device) but this machine has no "
            "visible CUDA device"
        )
    return name


def rank_device(name: str, rank: int) -> torch.device:
    """The device of rank `rank` of a group placed on `name`: the CPU for every rank, or GPU
    `first + rank` where `name` is `cuda:first` (`cuda` = `cuda:0`): one GPU per rank."""
    device = torch.device(resolve_device(name))
    if device.type == "cpu":
        return device
    index = (device.index or 0) + rank
    visible = torch.cuda.device_count()
    if index >= visible:
        raise DeviceError(
            f"decode rank {rank} needs GPU {index} ({name!r} + rank), but only {visible} "
            "CUDA device(s) are visible: a decode group needs one GPU per rank"
        )
    return torch.device("cuda", index)


def use_device(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device (nothing for the CPU).

    CUDA's current device is per thread and starts at GPU 0: a thread on another GPU that
    does not set it makes a context on GPU 0 (~0.5 GB) the first time it touches CUDA, and
    its events and streams default to GPU 0's. Every rank process and every thread that runs
    a rank's CUDA work calls this first."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


DTYPES = ("float32", "bfloat16", "float16")


def resolve_dtype(name: str, device: str) -> str:
    """`auto` -> bf16 on CUDA (what real checkpoints ship in and tensor cores run), fp32 on
    the CPU (where the native kernels and the exact references run); else checked as given."""
    if name == "auto":
        return "bfloat16" if torch.device(device).type == "cuda" else "float32"
    if name not in DTYPES:
        raise DeviceError(f"unknown dtype {name!r} (auto, {', '.join(DTYPES)})")
    return name
