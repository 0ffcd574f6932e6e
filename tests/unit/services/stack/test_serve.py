"""`tpla serve`'s port layout: every port the stack binds, listed once, and overlaps refused."""

from __future__ import annotations

import pytest

from common.runtime.settings import load_settings
from services.stack.serve import stack_ports


def test_the_stack_layout_lists_every_bound_port_and_refuses_overlaps() -> None:
    s = load_settings(
        router_port=20_000,
        decode_port=21_000,
        prefill_port=23_000,
        kv_port_base=26_000,
        dist_port=27_000,
        tp=2,
    )
    ports = stack_ports(s)
    assert len(set(ports.used)) == len(ports.used)
    assert {20_000, 21_000, 22_000, 23_000, 24_000, 26_000, 26_001, 26_100, 26_101, 27_000} <= set(
        ports.used
    )
    with pytest.raises(ValueError, match="more room"):
        stack_ports(load_settings(router_port=21_000, decode_port=21_000))
