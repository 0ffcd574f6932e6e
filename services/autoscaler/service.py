"""The autoscaler's loop: every interval, observe the load, plan (services/autoscaler/planner.py:
forecast, size, smooth), publish `tpla:autoscaler_desired_replicas{role, mode}` on its own
`/metrics`.

KEDA (k8s overlays) scales the prefill and decode workloads on the series with
mode="act"; under --dry-run the series says mode="dry-run", so the same numbers show on a
dashboard and nothing scales. The pools' sizes the correction compares with come from the
Redis worker registry when one is given (the replicas that really serve); without it, acting,
the loop takes its last published counts (KEDA applies them within its polling interval),
and dry, the sizes it was started with."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
import redis
from prometheus_client import CollectorRegistry, Gauge

from services.autoscaler.planner import ROLES, Planner, PlannerConfig
from services.autoscaler.profile import PerformanceProfile
from services.autoscaler.replica_counts import RegistryCounts
from services.autoscaler.sizing import Observation, Replicas, Sizing, SizingConfig, size
from services.autoscaler.sources import LoadSource

log = logging.getLogger(__name__)

DESIRED = "tpla:autoscaler_desired_replicas"


@dataclass(frozen=True)
class Decision:
    desired: Replicas  # after smoothing
    sizing: Sizing  # what the sizing asked for, and why
    observation: Observation
    current: Replicas  # the sizes the observation was taken under
    sized_rates: tuple[float, float] | None = None  # (prefill, decode) requests/s; None: observed

    def to_dict(self) -> dict[str, Any]:
        return {
            "desired_replicas": dataclasses.asdict(self.desired),
            "sizing": dataclasses.asdict(self.sizing),
            "inputs": {
                "observation": dataclasses.asdict(self.observation),
                "current_replicas": dataclasses.asdict(self.current),
                "sized_request_rates": self.sized_rates,
            },
        }


@dataclass(frozen=True)
class LoopConfig:
    planner: PlannerConfig
    interval_s: float = 15.0
    dry_run: bool = False


def decide_once(
    profile: PerformanceProfile, source: LoadSource, current: Replicas, cfg: SizingConfig
) -> Decision:
    """One observation, one sizing, no smoothing (there is no history to smooth against)."""
    obs = source.observe()
    sizing = size(profile, obs, current, cfg)
    return Decision(sizing.replicas, sizing, obs, current)


class Autoscaler:
    def __init__(
        self,
        profile: PerformanceProfile,
        source: LoadSource,
        start: Replicas,
        cfg: LoopConfig,
        counts: RegistryCounts | None = None,
    ) -> None:
        self._source = source
        self._cfg = cfg
        self._start = start
        self._counts = counts
        self._planner = Planner(profile, start, time.monotonic(), cfg.planner)
        self.registry = CollectorRegistry()
        self._gauge = Gauge(
            DESIRED,
            "Replicas the autoscaler asks for, per role (mode: act, or dry-run: nothing scales)",
            ["role", "mode"],
            registry=self.registry,
        )
        self._publish()
        self._stop = threading.Event()

    @property
    def desired(self) -> Replicas:
        return self._planner.desired

    def _publish(self) -> None:
        mode = "dry-run" if self._cfg.dry_run else "act"
        desired = dataclasses.asdict(self.desired)
        for role in ROLES:
            self._gauge.labels(role, mode).set(desired[role])

    def current(self) -> Replicas:
        """The pools' sizes now: the registry's, else what was last asked for (acting) or
        started with (dry)."""
        if self._counts is not None:
            return self._counts.current()
        return self._start if self._cfg.dry_run else self.desired

    def step(self, now: float) -> Decision:
        current = self.current()
        obs = self._source.observe()
        plan = self._planner.decide(obs, now, current)
        self._publish()
        return Decision(plan.desired, plan.sizing, obs, current, plan.sized_rates)

    def run(self) -> None:
        """Decide every interval until `stop`; a failed observation skips one interval."""
        while not self._stop.is_set():
            try:
                decision = self.step(time.monotonic())
                log.info("autoscaler decision %s", decision.to_dict())
            except (httpx.HTTPError, redis.RedisError, OSError, ValueError) as exc:
                log.warning("autoscaler: no decision this interval: %s", exc)
            self._stop.wait(self._cfg.interval_s)

    def stop(self) -> None:
        self._stop.set()
