"""Small host <-> device copies that never make a GPU's host wait more than once a step.

`to_device` moves a host list (per-row sampling parameters, indices), `to_device_tensor` a
host tensor (a plan's words), through pinned memory with a non-blocking copy: from pageable
memory the copy would wait for the device's queue. `to_host` is a step's one awaited
transfer: its results, copied into pinned memory and awaited on an event (counted by
`common.runtime.host_syncs`). On the CPU both are plain tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from common.runtime.host_syncs import note_wait


def to_device(
    values: Sequence[float] | Sequence[int], device: torch.device, dtype: torch.dtype | None = None
) -> Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)` without waiting for the device."""
    return to_device_tensor(torch.tensor(values, dtype=dtype), device)


def to_device_tensor(host: Tensor, device: torch.device) -> Tensor:
    """A host tensor on `device` without waiting for the device's queue (on the CPU: itself)."""
    if device.type == "cpu":
        return host
    if device.type != "cuda":
        return host.to(device)
    # The caching host allocator keeps the pinned block until the copy that reads it is done.
    return host.pin_memory().to(device, non_blocking=True)


def to_host(t: Tensor) -> Tensor:
    """`t` on the host once every queued kernel that writes it has run: the one wait."""
    note_wait()
    if t.device.type == "cpu":
        return t
    if t.device.type != "cuda":
        return t.to("cpu")
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(t.device))
    done.synchronize()
    return host
