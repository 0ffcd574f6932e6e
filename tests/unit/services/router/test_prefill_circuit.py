"""The prefill circuit on a hand-driven clock: failures in a row open it, it half opens after
open_s with one trial, whose outcome closes or reopens it (or, without one, frees the trial)."""

from __future__ import annotations

import pytest

from services.router.prefill_circuit import CircuitState, PrefillCircuit


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_open_half_open_closed() -> None:
    clock = Clock()
    circuit = PrefillCircuit(3, 10.0, clock)
    circuit.failed()
    circuit.failed()
    circuit.succeeded()  # a success breaks the row
    circuit.failed()
    circuit.failed()
    assert circuit.try_remote() and circuit.state is CircuitState.CLOSED
    circuit.failed()
    assert circuit.state is CircuitState.OPEN and circuit.is_open()
    assert not circuit.try_remote()
    clock.now = 10.0
    assert circuit.state is CircuitState.HALF_OPEN and not circuit.is_open()
    assert circuit.try_remote()  # the trial
    assert circuit.is_open() and not circuit.try_remote()  # the others wait for it
    circuit.ended()  # it ended without a verdict: the next one may try
    assert circuit.try_remote()
    circuit.failed()  # one failure in half open reopens it
    assert circuit.state is CircuitState.OPEN
    clock.now = 20.0
    assert circuit.try_remote()
    circuit.succeeded()
    assert circuit.state is CircuitState.CLOSED and not circuit.is_open()


def test_bad_settings() -> None:
    with pytest.raises(ValueError):
        PrefillCircuit(0, 1.0)
