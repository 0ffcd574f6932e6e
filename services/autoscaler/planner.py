"""One decision of the autoscaler from one observation: the forecast load (predictor), the
sizing for it (corrected by what was observed), then the smoothing of each role's step.
The loop (service.py) and the simulation (tools/bench/autoscale.py) both decide through it."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.autoscaler.predictor import ForecastConfig, Holt, load_to_size, update
from services.autoscaler.profile import PerformanceProfile
from services.autoscaler.sizing import Observation, Replicas, Sizing, SizingConfig, size
from services.autoscaler.smoothing import RoleState, SmoothingConfig, smooth

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class PlannerConfig:
    sizing: SizingConfig
    smoothing: SmoothingConfig
    forecast: ForecastConfig = field(default_factory=ForecastConfig)


@dataclass(frozen=True)
class Plan:
    desired: Replicas  # after smoothing
    sizing: Sizing  # what the sizing asked for, and why
    sized_rates: tuple[float, float]  # requests/s each pool was sized for (prefill, decode)


class Planner:
    def __init__(
        self, profile: PerformanceProfile, start: Replicas, now: float, cfg: PlannerConfig
    ) -> None:
        self._profile = profile
        self._cfg = cfg
        self._holt: Holt | None = None
        self.state = {
            "prefill": RoleState(cfg.sizing.prefill.clamp(start.prefill), now),
            "decode": RoleState(cfg.sizing.decode.clamp(start.decode), now),
        }

    @property
    def desired(self) -> Replicas:
        return Replicas(self.state["prefill"].replicas, self.state["decode"].replicas)

    def decide(self, obs: Observation, now: float, current: Replicas) -> Plan:
        """The replicas wanted from `now`, `obs` having been observed under `current`."""
        fc = self._cfg.forecast
        self._holt = update(self._holt, obs.request_rate, now, fc)
        rates = (
            load_to_size(self._holt, obs.request_rate, fc.horizon_prefill_s, fc),
            load_to_size(self._holt, obs.request_rate, fc.horizon_decode_s, fc),
        )
        sizing = size(self._profile, obs, current, self._cfg.sizing, rates)
        target = {"prefill": sizing.replicas.prefill, "decode": sizing.replicas.decode}
        for role in ROLES:
            self.state[role] = smooth(self.state[role], target[role], now, self._cfg.smoothing)
        return Plan(self.desired, sizing, rates)
