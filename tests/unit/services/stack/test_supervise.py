"""`tpla serve`'s restarts: a child that had served is restarted whenever it dies (a fault, a
kill); one that keeps dying before its port opens is given up on after MAX_RESTARTS starts.
The children here are real processes that exit at once; a listening socket stands in for a
service's port."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from services.stack import serve
from services.stack.serve import MAX_RESTARTS, Child, supervise


@pytest.fixture(autouse=True)
def quick_children(monkeypatch: pytest.MonkeyPatch) -> None:
    def start(self: Child, env: dict[str, str]) -> None:
        self.served = False
        self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])

    monkeypatch.setattr(Child, "start", start)
    monkeypatch.setattr(serve.group_files, "remove_files_of", lambda pid: None)


def _dies(child: Child) -> None:
    """Supervise `child` while it runs, then once more after it exits (its restart)."""
    assert child.proc is not None
    while child.proc.poll() is None:
        supervise([child], {})
    child.proc.wait()
    supervise([child], {})


def test_a_child_that_served_is_restarted_whenever_it_dies() -> None:
    with socket.create_server(("127.0.0.1", 0)) as port:
        child = Child("decode-0", [], port.getsockname()[1])
        child.start({})
        for _ in range(MAX_RESTARTS + 2):
            _dies(child)
            assert child.failed_starts == 0
    assert child.proc is not None
    child.proc.wait()


def test_a_child_dying_before_it_serves_is_given_up_on() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))  # bound, never listening: connects are refused
        child = Child("decode-0", [], unused.getsockname()[1])
        child.start({})
        for _ in range(MAX_RESTARTS - 1):
            _dies(child)
        with pytest.raises(RuntimeError, match="decode-0 keeps failing before it serves"):
            _dies(child)
