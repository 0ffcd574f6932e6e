"""The drain's gate and its bounded wait."""

from __future__ import annotations

import threading
import time

import pytest

from common.rpc.drain import DrainGate, wait_drained
from common.runtime.errors import Unavailable


def test_a_closed_gate_turns_new_calls_away_and_counts_the_admitted() -> None:
    gate = DrainGate("the worker")
    gate.enter()
    gate.enter()
    gate.leave()
    assert gate.close() == 1 and gate.closed
    with pytest.raises(Unavailable, match="the worker is draining") as err:
        gate.enter()
    assert err.value.code == "draining"
    assert gate.inside == 1  # the refused call left no count behind
    gate.leave()
    assert gate.inside == 0


def test_wait_drained_until_idle_grace_or_stop() -> None:
    stop = threading.Event()
    calls = iter([False, False, True])
    assert wait_drained(lambda: next(calls), 5.0, stop, poll_s=0.001)
    started = time.monotonic()
    assert not wait_drained(lambda: False, 0.05, stop, poll_s=0.01)
    assert 0.05 <= time.monotonic() - started < 1.0
    stop.set()
    started = time.monotonic()
    assert not wait_drained(lambda: False, 60.0, stop)
    assert time.monotonic() - started < 1.0
