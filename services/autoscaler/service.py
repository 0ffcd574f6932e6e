"""The autoscaler's loop: every interval, observe the load, size the pools, smooth the step,
publish `tpla:autoscaler_desired_replicas{role, mode}` on its own `/metrics`.

KEDA (k8s overlays) scales the prefill and decode workloads on the series with
mode="act"; under --dry-run the series says mode="dry-run", so the same numbers show on a
dashboard and nothing scales. Acting, the loop takes its last published counts as the pools'
sizes when it corrects the profile (KEDA applies them within its polling interval); dry, the
sizes stay those it was started with."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Gauge

from services.autoscaler.profile import PerformanceProfile
from services.autoscaler.sizing import Observation, Replicas, Sizing, SizingConfig, size
from services.autoscaler.smoothing import RoleState, SmoothingConfig, smooth
from services.autoscaler.sources import LoadSource

log = logging.getLogger(__name__)

DESIRED = "tpla:autoscaler_desired_replicas"
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class Decision:
    desired: Replicas  # after smoothing
    sizing: Sizing  # what the sizing asked for, and why
    observation: Observation
    current: Replicas  # the sizes the observation was taken under

    def to_dict(self) -> dict[str, Any]:
        return {
            "desired_replicas": dataclasses.asdict(self.desired),
            "sizing": dataclasses.asdict(self.sizing),
            "inputs": {
                "observation": dataclasses.asdict(self.observation),
                "current_replicas": dataclasses.asdict(self.current),
            },
        }


@dataclass(frozen=True)
class LoopConfig:
    sizing: SizingConfig
    smoothing: SmoothingConfig
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
        self, profile: PerformanceProfile, source: LoadSource, start: Replicas, cfg: LoopConfig
    ) -> None:
        self._profile = profile
        self._source = source
        self._cfg = cfg
        self._start = start
        now = time.monotonic()
        self._state = {
            "prefill": RoleState(cfg.sizing.prefill.clamp(start.prefill), now),
            "decode": RoleState(cfg.sizing.decode.clamp(start.decode), now),
        }
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
        return Replicas(self._state["prefill"].replicas, self._state["decode"].replicas)

    def _publish(self) -> None:
        mode = "dry-run" if self._cfg.dry_run else "act"
        for role in ROLES:
            self._gauge.labels(role, mode).set(self._state[role].replicas)

    def step(self, now: float) -> Decision:
        current = self._start if self._cfg.dry_run else self.desired
        obs = self._source.observe()
        sizing = size(self._profile, obs, current, self._cfg.sizing)
        target = {"prefill": sizing.replicas.prefill, "decode": sizing.replicas.decode}
        for role in ROLES:
            self._state[role] = smooth(self._state[role], target[role], now, self._cfg.smoothing)
        self._publish()
        return Decision(self.desired, sizing, obs, current)

    def run(self) -> None:
        """Decide every interval until `stop`; a failed observation skips one interval."""
        while not self._stop.is_set():
            try:
                decision = self.step(time.monotonic())
                log.info("autoscaler decision %s", decision.to_dict())
            except (httpx.HTTPError, OSError, ValueError) as exc:
                log.warning("autoscaler: no decision this interval: %s", exc)
            self._stop.wait(self._cfg.interval_s)

    def stop(self) -> None:
        self._stop.set()
