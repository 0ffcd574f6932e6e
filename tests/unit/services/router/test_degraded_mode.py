"""Degraded mode from a registry snapshot and the circuit: why, in words, and one call of its
callback (the gauge) and one log line per way in and out."""

from __future__ import annotations

import logging

import pytest

from common.runtime.redis_state import WorkerRecord, WorkerRole
from services.router.degraded_mode import DegradedMode
from services.router.disagg_policy import DisaggConfig, DisaggPolicy, RouteReason
from services.router.policy import WorkerSnapshot
from services.router.prefill_circuit import PrefillCircuit

WORKER = WorkerRecord("p0", WorkerRole.PREFILL, "p0:1")


def test_reasons_changes_and_never(caplog: pytest.LogCaptureFixture) -> None:
    circuit = PrefillCircuit(1, 60.0)
    changes: list[bool] = []
    mode = DegradedMode(DisaggConfig(), circuit, changes.append)
    none, one = WorkerSnapshot(), WorkerSnapshot.from_records([WORKER])
    with caplog.at_level(logging.INFO):
        assert mode.reason(none) is RouteReason.NO_PREFILL_WORKER
        assert mode.reason(none) is RouteReason.NO_PREFILL_WORKER  # logged once
        assert mode.describe(one) is None
        circuit.failed()
        assert "circuit is open" in (mode.describe(one) or "")
    assert changes == [True, False, True]
    assert [r.levelname for r in caplog.records] == ["WARNING", "WARNING", "WARNING"]
    never = DegradedMode(DisaggConfig(DisaggPolicy.NEVER), circuit)
    assert never.reason(none) is None
