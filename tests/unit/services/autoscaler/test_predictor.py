"""The load forecast: exact on a linear series (against the line itself), never below zero,
never below the observed load when sized for, and headroom scales what is sized for."""

from __future__ import annotations

import pytest

from services.autoscaler.predictor import ForecastConfig, Holt, load_to_size, update

CFG = ForecastConfig(alpha=0.6, beta=0.3, horizon_prefill_s=90.0, horizon_decode_s=150.0)


def fold(rates: list[float], step_s: float, cfg: ForecastConfig = CFG) -> Holt:
    state = None
    for i, rate in enumerate(rates):
        state = update(state, rate, i * step_s, cfg)
    assert state is not None
    return state


@pytest.mark.parametrize("slope", [0.0, 0.02, -0.01])
def test_a_linear_series_is_forecast_exactly(slope: float) -> None:
    def line(t: float) -> float:
        return 5.0 + slope * t

    state = fold([line(30.0 * i) for i in range(8)], 30.0)
    last = 30.0 * 7
    for horizon in (0.0, 30.0, 90.0):
        assert state.forecast(horizon) == pytest.approx(line(last + horizon))


def test_the_forecast_is_never_negative() -> None:
    state = fold([8.0, 6.0, 4.0, 2.0], 30.0)
    assert state.trend < 0
    assert state.forecast(600.0) == 0.0


def test_sized_for_no_less_than_observed_and_headroom_on_top() -> None:
    falling = fold([8.0, 6.0, 4.0], 30.0)
    assert load_to_size(falling, 4.0, 90.0, CFG) == 4.0
    rising = fold([2.0, 4.0, 6.0], 30.0)
    assert load_to_size(rising, 6.0, 90.0, CFG) == pytest.approx(12.0)
    spare = ForecastConfig(headroom=0.25)
    assert load_to_size(rising, 6.0, 0.0, spare) == pytest.approx(7.5)  # no horizon: observed


def test_an_observation_at_the_same_time_changes_nothing() -> None:
    state = fold([2.0, 3.0], 30.0)
    assert update(state, 50.0, 30.0, CFG) == state


def test_bad_configs_are_refused() -> None:
    for kw in ({"alpha": 0.0}, {"beta": 1.5}, {"headroom": -0.1}, {"horizon_decode_s": -1.0}):
        with pytest.raises(ValueError):
            ForecastConfig(**kw)  # type: ignore[arg-type]
