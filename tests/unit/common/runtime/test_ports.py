"""Free-port selection for local stacks: every derived port free, none of them a port that
another service of the same stack was already given, and the stack's own layout check."""

from __future__ import annotations

import socket

import pytest

from common.runtime.ports import free_port
from common.runtime.settings import load_settings
from services.stack.serve import stack_ports


def test_a_port_avoids_the_ports_already_handed_out() -> None:
    offsets = (0, 1000)
    # Every base except multiples of 5 would put one of its ports on an avoided one.
    avoid = {p for p in range(10_000, 65_536) if p % 5}
    for _ in range(5):
        base = free_port(offsets, avoid=avoid)
        assert base % 5 == 0 and (base + 1000) % 5 == 0
        for off in offsets:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", base + off))  # free when returned


def test_nothing_free_outside_avoid_is_an_error_not_a_hang() -> None:
    with pytest.raises(RuntimeError, match="no free port"):
        free_port(avoid=range(0, 65_536), attempts=50)


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
