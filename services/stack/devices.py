"""Which GPUs the processes of one node's stack take (`tpla serve`): pure, torch-free.

Decode group i of tp ranks takes GPUs first + i * tp .. first + i * tp + tp - 1 (its rank k
runs on its group's first GPU + k, `common.runtime.device.rank_device`), so groups never share a
GPU. Prefill worker j takes the next GPU after the decode groups' when the node has one;
past the last GPU the workers wrap around and share the decode groups' GPUs (prefill is
bursty compute beside decode's steady memory traffic, and a shared GPU still serves; the
torch transport then moves that pair's shards through host memory, NCCL needing two GPUs).
A prefill worker of several ranks (`prefill_tp`) takes that many GPUs of its own after
the decode groups', its rank k on its first GPU + k: those never wrap.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StackDevices:
    """The device name each child is started with (TPLA_DEVICE)."""

    decode: tuple[str, ...]  # per decode group: its rank 0's device
    prefill: tuple[str, ...]  # per prefill worker


def stack_devices(
    device: str,
    decode_groups: int,
    tp: int,
    prefill_workers: int,
    visible_gpus: int,
    prefill_tp: int = 1,
) -> StackDevices:
    """Devices for the stack placed on `device` (resolved: `cpu`, `cuda` or `cuda:N`).

    ValueError, naming what is missing, when the decode groups need more GPUs than the
    node shows."""
    if not device.startswith("cuda"):
        return StackDevices((device,) * decode_groups, (device,) * prefill_workers)
    first = int(device.split(":", 1)[1]) if ":" in device else 0
    needed = first + decode_groups * tp
    if needed > visible_gpus:
        raise ValueError(
            f"{decode_groups} decode group(s) of tp={tp} need {decode_groups * tp} GPUs"
            + (f" from GPU {first}" if first else "")
            + f" (one per rank, GPUs {first}..{needed - 1}), but this node shows "
            f"{visible_gpus}: lower TPLA_DECODE_GROUPS or TPLA_TP, or add GPUs"
        )
    decode = tuple(f"cuda:{first + i * tp}" for i in range(decode_groups))
    if prefill_tp > 1:
        total = needed + prefill_workers * prefill_tp
        if total > visible_gpus:
            raise ValueError(
                f"{prefill_workers} prefill worker(s) of TPLA_PREFILL_TP={prefill_tp} need "
                f"GPUs {needed}..{total - 1} after the decode groups', but this node shows "
                f"{visible_gpus}: lower TPLA_PREFILL_WORKERS or TPLA_PREFILL_TP, or add GPUs"
            )
        prefill_groups = range(prefill_workers)
        return StackDevices(
            decode, tuple(f"cuda:{needed + j * prefill_tp}" for j in prefill_groups)
        )
    spare = visible_gpus - first
    prefill = tuple(
        f"cuda:{first + (decode_groups * tp + j) % spare}" for j in range(prefill_workers)
    )
    return StackDevices(decode, prefill)
