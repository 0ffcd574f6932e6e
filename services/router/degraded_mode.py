"""Degraded mode: this router has no prefill worker it can use (none healthy in the registry, or
the prefill circuit open: services/router/prefill_circuit.py), so its decode groups prefill
every prompt themselves (services/router/disagg_policy.py) and it says so: `/ready` stays
ready with the reason, `tpla:prefill_degraded` reads 1, and one log line marks each entry
into the mode and each way out. A `never` policy uses no prefill worker: it is never
degraded."""

from __future__ import annotations

import logging
from collections.abc import Callable

from services.router.disagg_policy import DisaggConfig, RouteReason
from services.router.policy import WorkerSnapshot
from services.router.prefill_circuit import PrefillCircuit

log = logging.getLogger(__name__)

_WHY = {
    RouteReason.NO_PREFILL_WORKER: "no healthy prefill worker",
    RouteReason.CIRCUIT_OPEN: "remote prefills keep failing (the prefill circuit is open)",
}


class DegradedMode:
    def __init__(
        self,
        config: DisaggConfig,
        circuit: PrefillCircuit,
        on_change: Callable[[bool], None] = lambda _: None,
    ) -> None:
        """`on_change(degraded)`: called on each entry into the mode and each way out (the
        router's gauge)."""
        self.config, self.circuit, self._on_change = config, circuit, on_change
        self._now: RouteReason | None = None

    def reason(self, snapshot: WorkerSnapshot) -> RouteReason | None:
        """Why no prefill worker can be used now (None: one can), noting a change."""
        why = None
        if self.config.uses_workers:
            if not snapshot.healthy_prefill():
                why = RouteReason.NO_PREFILL_WORKER
            elif self.circuit.is_open():
                why = RouteReason.CIRCUIT_OPEN
        if why is not self._now:
            if why is not None:
                log.warning("degraded: %s; the decode groups prefill every prompt", _WHY[why])
            else:
                # A warning as the entry is: an operator reading warnings sees both ends.
                log.warning("no longer degraded: prompts go to prefill workers again")
            self._now = why
            self._on_change(why is not None)
        return why

    def describe(self, snapshot: WorkerSnapshot) -> str | None:
        """`reason` in words, for /ready (None: not degraded)."""
        why = self.reason(snapshot)
        return None if why is None else f"{_WHY[why]}: the decode groups prefill every prompt"
