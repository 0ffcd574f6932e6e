"""`tpla serve`'s GPU assignment: decode groups on disjoint GPUs, prefill workers after them."""

from __future__ import annotations

import pytest

from common.runtime.settings import load_settings
from services.stack.devices import StackDevices, stack_devices
from services.stack.serve import stack_children


def test_each_decode_group_takes_its_own_tp_gpus() -> None:
    got = stack_devices("cuda", decode_groups=2, tp=4, prefill_workers=0, visible_gpus=8)
    assert got.decode == ("cuda:0", "cuda:4")  # group 1's ranks: GPUs 4..7


def test_prefill_workers_take_the_gpus_after_the_groups_then_share() -> None:
    got = stack_devices("cuda", decode_groups=1, tp=2, prefill_workers=3, visible_gpus=4)
    assert got == StackDevices(("cuda:0",), ("cuda:2", "cuda:3", "cuda:0"))


def test_a_first_gpu_offsets_every_group() -> None:
    got = stack_devices("cuda:2", decode_groups=2, tp=2, prefill_workers=1, visible_gpus=8)
    assert got == StackDevices(("cuda:2", "cuda:4"), ("cuda:6",))


def test_too_few_gpus_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"2 decode group\(s\) of tp=4 need 8 GPUs.*shows 6"):
        stack_devices("cuda", decode_groups=2, tp=4, prefill_workers=1, visible_gpus=6)
    with pytest.raises(ValueError, match="from GPU 1"):
        stack_devices("cuda:1", decode_groups=1, tp=2, prefill_workers=0, visible_gpus=2)


def test_cpu_places_everything_on_the_cpu() -> None:
    got = stack_devices("cpu", decode_groups=3, tp=2, prefill_workers=2, visible_gpus=0)
    assert got == StackDevices(("cpu",) * 3, ("cpu",) * 2)


def test_serve_starts_each_child_on_its_device() -> None:
    s = load_settings(decode_groups=2, tp=2, prefill_workers=1)
    devices = stack_devices("cuda", 2, 2, 1, visible_gpus=5)
    env = {c.name: c.env.get("TPLA_DEVICE") for c in stack_children(s, devices)}
    assert env == {
        "decode-0": "cuda:0",
        "decode-1": "cuda:2",
        "prefill-0": "cuda:4",
        "router": None,
    }


def test_a_prefill_group_takes_gpus_of_its_own_after_the_decode_groups() -> None:
    got = stack_devices("cuda", 1, 2, prefill_workers=2, visible_gpus=6, prefill_tp=2)
    assert got == StackDevices(("cuda:0",), ("cuda:2", "cuda:4"))
    with pytest.raises(ValueError, match="TPLA_PREFILL_TP=2"):
        stack_devices("cuda", 1, 2, prefill_workers=2, visible_gpus=5, prefill_tp=2)
