"""The load to size for: a forecast of the request rate at the time new capacity would serve.

A replica asked for now serves a start-up later (weights loaded, registered), and the decision
stands for one interval, so sizing for the load just observed is one start-up and one interval
late on a rising load. Holt's linear (double exponential) smoothing of the observed rates
(level and trend, per second) read `horizon_s` ahead gives the load to size for; the planner
takes the larger of it and the observed rate (a falling forecast does not remove capacity
before the load falls: scale-in stays with the observed load and the cooldown), times
1 + `headroom`. On an exactly linear series the forecast is exact (tested against the line)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ForecastConfig:
    # A window already averages its arrivals, so the level follows the newest window; the
    # trend is smoothed over about ten windows, so one noisy window barely moves it.
    alpha: float = 1.0  # the level's weight on the newest observation
    beta: float = 0.1  # the trend's weight on the newest level change
    horizon_prefill_s: float = 0.0  # how far ahead the prefill pool is sized (0: no forecast)
    horizon_decode_s: float = 0.0
    headroom: float = 0.0  # spare capacity, a fraction of the load sized for

    def __post_init__(self) -> None:
        if not (0 < self.alpha <= 1 and 0 <= self.beta <= 1):
            raise ValueError("alpha in (0, 1], beta in [0, 1]")
        if self.horizon_prefill_s < 0 or self.horizon_decode_s < 0 or self.headroom < 0:
            raise ValueError("horizons and headroom are >= 0")


@dataclass(frozen=True)
class Holt:
    level: float  # requests/s
    trend: float  # requests/s per second
    at: float  # seconds, the caller's clock
    seen: int  # observations folded in (the trend starts from the second)

    def forecast(self, horizon_s: float) -> float:
        """The rate `horizon_s` after the last observation (never below zero)."""
        return max(self.level + self.trend * horizon_s, 0.0)


def update(state: Holt | None, rate: float, now: float, cfg: ForecastConfig) -> Holt:
    """`state` with the rate observed at `now` folded in. The first observation sets the
    level; the second sets the trend to the change between them; later ones smooth both."""
    if state is None:
        return Holt(rate, 0.0, now, 1)
    dt = now - state.at
    if dt <= 0:
        return state
    if state.seen == 1:
        return Holt(rate, (rate - state.level) / dt, now, 2)
    level = cfg.alpha * rate + (1 - cfg.alpha) * (state.level + state.trend * dt)
    trend = cfg.beta * (level - state.level) / dt + (1 - cfg.beta) * state.trend
    return Holt(level, trend, now, state.seen + 1)


def load_to_size(state: Holt, observed: float, horizon_s: float, cfg: ForecastConfig) -> float:
    """The request rate a pool whose new replicas serve `horizon_s` from now is sized for."""
    ahead = state.forecast(horizon_s) if horizon_s > 0 else observed
    return max(observed, ahead) * (1 + cfg.headroom)
