"""The host-wait counter sees every read of a tensor's value, and nothing else."""

from __future__ import annotations

import pytest
import torch

from common.runtime.host_syncs import HostSyncCounter, host_side, note_wait
from common.runtime.transfers import to_device, to_host


@pytest.mark.parametrize("inference", [False, True])
def test_each_read_counts_once(inference: bool) -> None:
    x = torch.arange(6.0)
    with torch.inference_mode(inference), HostSyncCounter() as outer:
        y = (x * 2).softmax(0)  # device work: nothing to count
        int(y.argmax())
        x.tolist()
        x[0].item()
        bool(x.sum() > 0)
        x.nonzero()
        x[x > 1]
        x[torch.tensor([1, 2])]  # an index tensor: no read of a value
        with HostSyncCounter() as inner:
            float(x.max())
        with host_side():
            x.tolist()
            int(x[0])
        note_wait()
    assert inner.count == 1
    assert outer.count == 8
    with HostSyncCounter() as after:
        pass
    x.tolist()  # outside any counter
    assert after.count == 0


def test_transfers_count_the_one_wait() -> None:
    cpu = torch.device("cpu")
    with HostSyncCounter() as counter:
        t = to_device([1, 2, 3], cpu, torch.int64)
        host = to_host(t * 2)
    assert counter.count == 1
    assert host.tolist() == [2, 4, 6]


def _mask_assign(x: torch.Tensor) -> None:
    y = x.clone()
    y[x > 1] = 0


# Every op that makes a GPU's host wait, as the step would call it: each counts exactly once.
SYNCING = {
    ".item()": lambda x: x[0].item(),
    "int(t)": lambda x: int(x[0]),
    "float(t)": lambda x: float(x[0]),
    "bool(t)": lambda x: bool(x[0]),
    "if t.any()": lambda x: 1 if x.any() else 0,
    ".tolist()": lambda x: x.tolist(),
    ".numpy()": lambda x: x.numpy(),
    ".cpu()": lambda x: x.cpu(),
    '.to("cpu")': lambda x: x.to("cpu"),
    ".to(device=cpu)": lambda x: x.to(device=torch.device("cpu")),
    ".to(cpu, float64)": lambda x: x.to("cpu", torch.float64),
    "nonzero": lambda x: x.nonzero(),
    "torch.where(c)": lambda x: torch.where(x > 1),
    "argwhere": lambda x: torch.argwhere(x > 1),
    "t[mask]": lambda x: x[x > 1],
    "t[mask] = v": _mask_assign,
    "masked_select": lambda x: x.masked_select(x > 1),
    "torch.unique": lambda x: torch.unique(x),
    "unique(dim)": lambda x: torch.unique(x.view(2, 3), dim=0),
    "unique_consecutive": lambda x: torch.unique_consecutive(x),
    "torch.equal": lambda x: torch.equal(x, x),
    "allclose": lambda x: torch.allclose(x, x),
    "repeat_interleave(tensor)": lambda x: torch.repeat_interleave(x.long()),
    "t.repeat_interleave(repeats)": lambda x: x.repeat_interleave(x.long()),
    "bincount": lambda x: torch.bincount(x.long()),
    "masked_fill(tensor value)": lambda x: x.masked_fill(x > 1, x[0]),
}
# What looks alike and does not wait: device work, or copies the host awaits later.
NOT_SYNCING = {
    "index_select": lambda x: x.index_select(0, torch.tensor([1, 2])),
    "integer index": lambda x: x[torch.tensor([1, 2])],
    "nonzero_static": lambda x: torch.nonzero_static(x, size=6),
    "repeat_interleave(output_size)": lambda x: torch.repeat_interleave(x.long(), output_size=15),
    "repeat_interleave(int)": lambda x: x.repeat_interleave(2),
    "masked_fill(scalar)": lambda x: x.masked_fill(x > 1, 0.0),
    "torch.where(c, a, b)": lambda x: torch.where(x > 1, x, 0.0),
    ".to(non_blocking)": lambda x: x.to("cpu", non_blocking=True),
    ".to(float64)": lambda x: x.to(torch.float64),
    "copy_": lambda x: torch.empty(6).copy_(x),
    "sort, topk, cumsum": lambda x: (x.sort(), x.topk(2), x.cumsum(0)),
}


@pytest.mark.parametrize("inference", [False, True])
@pytest.mark.parametrize("name", list(SYNCING) + list(NOT_SYNCING))
def test_every_op_that_waits_counts_once_and_nothing_else(name: str, inference: bool) -> None:
    x = torch.arange(6.0)
    op = SYNCING.get(name) or NOT_SYNCING[name]
    with torch.inference_mode(inference), HostSyncCounter() as counter:
        op(x)
    assert counter.count == (1 if name in SYNCING else 0), name
    with host_side(), HostSyncCounter() as quiet:
        op(x)
    assert quiet.count == 0
