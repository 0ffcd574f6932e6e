"""`tpla serve`'s port layout: every port the stack binds, listed once, and overlaps refused."""

from __future__ import annotations

import pytest

from common.runtime.settings import load_settings
from services.stack.serve import stack_children, stack_ports


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


def test_prefill_groups_get_rendezvous_ports_of_their_own() -> None:
    s = load_settings(prefill_workers=2, prefill_tp=2, prefill_dist_port=28_000, dist_port=27_000)
    ports = stack_ports(s)
    assert ports.prefill_dist == [28_000, 28_010]
    assert {28_000, 28_010} <= set(ports.used)
    assert 28_000 not in stack_ports(load_settings(prefill_dist_port=28_000)).used  # tp = 1
    [_, *prefill, _] = stack_children(s)
    assert [c.args[-2:] for c in prefill] == [["--dist-port", "28000"], ["--dist-port", "28010"]]
