"""The planner: on a rising load it asks for the prefill workers the load will need one
start-up ahead, before any queue forms, where sizing for the observed load lags; on a flat,
noisy load its replicas do not move; the forecast sizes but the correction compares with the
load as observed."""

from __future__ import annotations

import itertools
import random

from services.autoscaler.planner import Planner, PlannerConfig
from services.autoscaler.predictor import ForecastConfig
from services.autoscaler.sizing import Observation, Replicas, RoleBounds, SizingConfig, size
from services.autoscaler.smoothing import SmoothingConfig
from tests.unit.services.autoscaler.test_profile import small

SIZING = SizingConfig(1.0, 0.05, RoleBounds(1, 32), RoleBounds(1, 32))
SMOOTHING = SmoothingConfig(cooldown_s=180.0, max_step_up=4, max_step_down=1)
AHEAD = ForecastConfig(horizon_prefill_s=90.0, horizon_decode_s=150.0)
STEP_S = 30.0


def obs(rate: float) -> Observation:
    # No queue, no latencies: the planner can only be ahead by forecasting.
    return Observation(STEP_S, rate, 500.0, 100.0, None, None, 0.0, 0.0)


def run(rates: list[float], forecast: ForecastConfig) -> list[Replicas]:
    planner = Planner(small(), Replicas(1, 1), 0.0, PlannerConfig(SIZING, SMOOTHING, forecast))
    out = []
    for i, rate in enumerate(rates):
        out.append(planner.decide(obs(rate), STEP_S * (i + 1), planner.desired).desired)
    return out


def test_a_rising_load_is_sized_ahead() -> None:
    rates = [1.0 + 0.5 * i for i in range(16)]
    ahead = run(rates, AHEAD)
    behind = run(rates, ForecastConfig())
    # What the load three intervals later (the horizon) needs, asked for now.
    for i in range(2, len(rates) - 3):
        need_then = size(small(), obs(rates[i + 3]), Replicas(1, 1), SIZING).replicas.prefill
        assert ahead[i].prefill >= need_then, i
    assert all(a.prefill >= b.prefill for a, b in zip(ahead, behind, strict=True))
    assert sum(a.prefill for a in ahead) > sum(b.prefill for b in behind)


def changes(history: list[Replicas], role: str) -> int:
    counts = [getattr(r, role) for r in history[1:]]
    return sum(a != b for a, b in itertools.pairwise(counts))


def test_a_flat_noisy_load_does_not_flap() -> None:
    # 5.5 requests/s, 5 sigma below the 7.0 at which the profile needs a third prefill worker.
    rng = random.Random(0)
    rates = [rng.gauss(5.5, 0.3) for _ in range(120)]  # an hour of 30 s windows
    assert changes(run(rates, AHEAD), "prefill") == 0
    assert changes(run(rates, AHEAD), "decode") <= changes(run(rates, ForecastConfig()), "decode")
    # A trend that follows each window's noise would (why beta is small).
    raw = ForecastConfig(alpha=1.0, beta=1.0, horizon_prefill_s=90.0, horizon_decode_s=150.0)
    assert changes(run(rates, raw), "prefill") >= 2


def test_the_correction_compares_with_the_load_as_observed() -> None:
    planner = Planner(small(), Replicas(2, 1), 0.0, PlannerConfig(SIZING, SMOOTHING, AHEAD))
    seen = Observation(STEP_S, 2.0, 500.0, 100.0, 0.5, None, 0.0, 0.0)
    planner.decide(obs(1.0), STEP_S, Replicas(2, 1))
    plan = planner.decide(seen, 2 * STEP_S, Replicas(2, 1))
    assert plan.sized_rates[0] > 2.0  # sized for the forecast
    assert plan.sizing == size(small(), seen, Replicas(2, 1), SIZING, plan.sized_rates)
    reactive = size(small(), seen, Replicas(2, 1), SIZING)
    assert plan.sizing.prefill_correction == reactive.prefill_correction
