"""Free-port selection for local stacks: every derived port free, none of them a port that
another service of the same stack was already given."""

from __future__ import annotations

import socket

import pytest

from common.runtime.ports import (
    SERVICE_PORT_OFFSETS,
    free_port,
    kv_port_offsets,
    kv_receiver_ports,
)


def test_a_port_avoids_the_ports_already_handed_out() -> None:
    offsets = SERVICE_PORT_OFFSETS
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


def test_a_second_call_never_hands_out_a_port_of_the_first() -> None:
    """A port is handed out before its service binds it: a later call of the same process
    (the next service of a test) must not get it, or a port derived from it, again."""
    offsets = kv_port_offsets(2)
    first = {free_port(offsets) + off for _ in range(200) for off in offsets}
    assert len(first) == 200 * len(offsets)  # some would overlap if drawn independently


def test_the_kv_offsets_are_the_ports_a_group_binds() -> None:
    uses = [u.port for rank in range(3) for u in kv_receiver_ports(5_000, rank)]
    assert sorted(uses) == sorted(5_000 + off for off in kv_port_offsets(3))
