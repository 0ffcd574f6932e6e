"""Per-worker health as this router sees it, exported at scrape time from its worker directory.

One series per registered worker (decode: per rank), labelled by worker id, role, rank and
decode group: `tpla:worker_healthy` is 1 while the worker reports itself healthy and the
router has not quarantined it (or its group), 0 otherwise, and its `reason` label says why
not ("" when healthy, "unhealthy" as the worker reports itself, else the fault the router
quarantined its group for: services/router/faults.py); `tpla:worker_heartbeat_age_seconds`
is how old its registry record is. A worker whose record expired has no series.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.router.workers import WorkerDirectory

_LABELS = ["worker_id", "role", "rank", "group_id"]
UNHEALTHY = "unhealthy"  # the `reason` of a worker that reports itself unhealthy


class WorkerHealth(Collector):
    def __init__(self, directory: WorkerDirectory, clock: Callable[[], float] = time.time) -> None:
        self._directory = directory
        self._clock = clock  # the registry's `updated_at` is wall-clock time

    def collect(self) -> Iterator[GaugeMetricFamily]:
        healthy = GaugeMetricFamily(
            "tpla:worker_healthy",
            "1 while a registered worker is healthy and not quarantined by this router "
            "(reason: why not)",
            labels=[*_LABELS, "reason"],
        )
        age = GaugeMetricFamily(
            "tpla:worker_heartbeat_age_seconds",
            "seconds since a registered worker's last heartbeat",
            labels=_LABELS,
        )
        quarantined = self._directory.quarantined()
        now = self._clock()
        for record in self._directory.snapshot.records:
            unit = record.group_id or record.worker_id
            labels = [record.worker_id, record.role.value, str(record.rank), record.group_id]
            reason = quarantined.get(unit, "" if record.healthy else UNHEALTHY)
            healthy.add_metric([*labels, reason], float(not reason))
            age.add_metric(labels, max(0.0, now - record.updated_at))
        yield healthy
        yield age
