"""The sizing math: idle gives the minimum; the chosen sizes are the fewest that meet the
SLOs (checked against every smaller size); long prompts raise prefill, long outputs decode;
the observed/expected correction scales the model and is clamped; bounds hold."""

from __future__ import annotations

import math

import pytest

from services.autoscaler.queueing import mean_wait_s, wait_quantile_s
from services.autoscaler.sizing import (
    Observation,
    Replicas,
    RoleBounds,
    SizingConfig,
    decode_context,
    decode_correction,
    group_capacity,
    prefill_correction,
    size,
)
from tests.unit.services.autoscaler.test_profile import small

CFG = SizingConfig(
    slo_ttft_s=1.0, slo_itl_s=0.03, prefill=RoleBounds(1, 32), decode=RoleBounds(1, 32)
)


def load(rate: float, prompt: float = 500, output: float = 100, **kw: float | None) -> Observation:
    fields: dict = dict(ttft_mean_s=None, itl_mean_s=None, queued=0.0, running=0.0)
    fields.update(kw)
    return Observation(30.0, rate, prompt, output, **fields)


def test_idle_gives_the_minimum() -> None:
    cfg = SizingConfig(1.0, 0.03, RoleBounds(2, 9), RoleBounds(1, 9))
    s = size(small(), load(0.0), Replicas(5, 5), cfg)
    assert s.replicas == Replicas(2, 1)
    assert s.gpus == 2 * 1 + 1 * 2
    assert s.prefill_correction == s.decode_correction == 1.0


@pytest.mark.parametrize("rate", [0.5, 3.0, 12.0, 40.0])
def test_prefill_is_the_fewest_workers_meeting_the_ttft_slo(rate: float) -> None:
    profile = small()
    s = size(profile, load(rate), Replicas(1, 1), CFG)
    service = profile.prefill.service_s(500)

    def ttft(n: int) -> float:
        return service + wait_quantile_s(n, rate, service, CFG.ttft_quantile)

    n = s.replicas.prefill
    assert ttft(n) <= CFG.slo_ttft_s and s.ttft_attainable
    assert n == 1 or ttft(n - 1) > CFG.slo_ttft_s
    assert s.predicted_ttft_s == pytest.approx(ttft(n))


def test_group_capacity_is_the_best_batch_within_the_itl_slo() -> None:
    profile, context = small(), 600.0
    batch, tok_s = group_capacity(profile, context, 1.0, 0.03)
    # Reference: scan every batch.
    ok = [b for b in range(1, 9) if profile.decode.itl(b, context) <= 0.03]
    best = max(ok, key=lambda b: b / profile.decode.itl(b, context))
    assert (batch, tok_s) == (best, pytest.approx(best / profile.decode.itl(best, context)))
    assert group_capacity(profile, context, 1.0, 0.001) == (0, 0.0)


@pytest.mark.parametrize("rate", [0.5, 3.0, 10.0])
def test_decode_is_the_fewest_groups_for_the_output_demand(rate: float) -> None:
    profile = small()
    obs = load(rate)
    s = size(profile, obs, Replicas(1, 1), CFG)
    _, per_group = group_capacity(profile, decode_context(obs), 1.0, CFG.slo_itl_s)
    groups = s.replicas.decode
    demand = rate * obs.output_tokens
    assert groups * per_group >= demand and (groups - 1) * per_group < demand
    assert s.predicted_itl_s <= CFG.slo_itl_s and s.itl_attainable
    # The batch the pool runs is the fixed point of Little's law.
    itl = profile.decode.itl(s.decode_batch, decode_context(obs))
    assert s.decode_batch == pytest.approx(max(demand * itl / groups, 1.0), rel=1e-6)


def test_long_prompts_raise_prefill_and_long_outputs_decode() -> None:
    base = size(small(), load(4.0, prompt=200, output=50), Replicas(1, 1), CFG).replicas
    long_prompts = size(small(), load(4.0, prompt=2000, output=50), Replicas(1, 1), CFG).replicas
    long_outputs = size(small(), load(4.0, prompt=200, output=500), Replicas(1, 1), CFG).replicas
    assert long_prompts.prefill > base.prefill
    assert long_outputs.decode > base.decode and long_outputs.prefill == base.prefill


def test_a_queue_adds_to_the_prefill_demand() -> None:
    cfg = SizingConfig(1.0, 0.03, RoleBounds(1, 32), RoleBounds(1, 32), backlog_s=10.0)
    calm = size(small(), load(6.0), Replicas(1, 1), cfg).replicas.prefill
    queued = size(small(), load(6.0, queued=60.0), Replicas(1, 1), cfg).replicas.prefill
    assert queued > calm


def test_the_correction_is_observed_over_expected_and_clamped() -> None:
    profile = small()
    service = profile.prefill.service_s(500)
    expected = service + mean_wait_s(2, 3.0, service)
    obs = load(3.0, ttft_mean_s=2 * expected)
    assert prefill_correction(profile, obs, 2, CFG) == pytest.approx(2.0)
    assert prefill_correction(profile, load(3.0, ttft_mean_s=100.0), 2, CFG) == 4.0
    assert prefill_correction(profile, load(3.0, ttft_mean_s=1e-6), 2, CFG) == 0.5
    # Little's law: sequences decoding = 3 req/s x 100 tokens x 0.02 s = 6, 3 per group.
    itl = profile.decode.itl(3.0, decode_context(obs))
    obs = load(3.0, itl_mean_s=0.02)
    assert decode_correction(profile, obs, 2, CFG) == pytest.approx(0.02 / itl)
    assert decode_correction(profile, load(0.0, itl_mean_s=0.02), 2, CFG) == 1.0


def test_a_slower_system_than_profiled_gets_more_replicas() -> None:
    plain = size(small(), load(2.0), Replicas(2, 2), CFG)
    service = small().prefill.service_s(500)
    slow_ttft = 1.8 * (service + mean_wait_s(2, 2.0, service))
    slow = size(small(), load(2.0, ttft_mean_s=slow_ttft, itl_mean_s=0.028), Replicas(2, 2), CFG)
    assert slow.prefill_correction == pytest.approx(1.8)
    assert slow.decode_correction > 1.0
    assert slow.replicas.prefill > plain.replicas.prefill
    assert slow.replicas.decode > plain.replicas.decode


def test_bounds_hold_and_an_unmeetable_slo_says_so() -> None:
    cfg = SizingConfig(0.05, 0.005, RoleBounds(1, 3), RoleBounds(1, 3))
    s = size(small(), load(50.0), Replicas(1, 1), cfg)
    assert s.replicas == Replicas(3, 3)
    assert not s.ttft_attainable and not s.itl_attainable
    busy = size(small(), load(500.0), Replicas(1, 1), CFG)
    assert busy.replicas == Replicas(32, 32) and not busy.ttft_attainable
    assert math.isinf(busy.predicted_ttft_s) or busy.predicted_ttft_s > CFG.slo_ttft_s


def test_bounds_are_validated() -> None:
    with pytest.raises(ValueError):
        RoleBounds(3, 2)
    with pytest.raises(ValueError):
        SizingConfig(0.0, 0.03, RoleBounds(1, 2), RoleBounds(1, 2))
