"""`tpla serve`: its port layout (every port the stack binds, listed once, and overlaps
refused), and its restarts: a child that had served is restarted whenever it dies (a fault, a
kill); one that keeps dying before its port opens is given up on after MAX_RESTARTS starts.
The supervised children are real processes that exit at once; a listening socket stands in
for a service's port."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from common.runtime.settings import load_settings
from services.stack import serve
from services.stack.serve import MAX_RESTARTS, Child, stack_children, stack_ports, supervise


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


@pytest.fixture
def quick_children(monkeypatch: pytest.MonkeyPatch) -> None:
    def start(self: Child, env: dict[str, str]) -> None:
        self.served = False
        self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])

    monkeypatch.setattr(Child, "start", start)
    monkeypatch.setattr(serve.group_files, "remove_files_of", lambda pid: None)


def _dies(child: Child) -> None:
    """Watch `child`'s port while it runs, then supervise it once after it exited (its
    restart, or the stack giving up)."""
    proc = child.proc
    assert proc is not None
    while proc.poll() is None:
        child.check_served()
    supervise([child], {})
    assert child.proc is not proc  # restarted


@pytest.mark.usefixtures("quick_children")
def test_a_child_that_served_is_restarted_whenever_it_dies() -> None:
    with socket.create_server(("127.0.0.1", 0)) as port:
        child = Child("decode-0", [], port.getsockname()[1])
        child.start({})
        for _ in range(MAX_RESTARTS + 2):
            _dies(child)
            assert child.failed_starts == 0
    assert child.proc is not None
    child.proc.wait()


@pytest.mark.usefixtures("quick_children")
def test_a_child_dying_before_it_serves_is_given_up_on() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))  # bound, never listening: connects are refused
        child = Child("decode-0", [], unused.getsockname()[1])
        child.start({})
        for _ in range(MAX_RESTARTS - 1):
            _dies(child)
        with pytest.raises(RuntimeError, match="decode-0 keeps failing before it serves"):
            _dies(child)
