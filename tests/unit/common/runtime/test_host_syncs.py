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
