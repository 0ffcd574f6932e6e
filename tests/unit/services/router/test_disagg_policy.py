"""The disaggregation policy's decisions: `always`, `never`, `auto`'s two bounds, and degraded
mode over every policy but `never`."""

from __future__ import annotations

import pytest

from services.router.disagg_policy import (
    ROUTES,
    DisaggConfig,
    DisaggPolicy,
    PrefillRoute,
    RouteReason,
    decide,
)

LOCAL, REMOTE = PrefillRoute.LOCAL, PrefillRoute.REMOTE
AUTO = DisaggConfig(DisaggPolicy.AUTO, local_max_tokens=100, local_queue_tokens=300)


def _decide(config: DisaggConfig, uncached: int, queued: int = 0, degraded=None):
    d = decide(config, uncached, queued, degraded)
    return d.route, d.reason


def test_each_policy() -> None:
    assert _decide(DisaggConfig(), 5) == (REMOTE, RouteReason.POLICY)
    assert _decide(DisaggConfig(DisaggPolicy.NEVER), 5000) == (LOCAL, RouteReason.POLICY)
    assert _decide(AUTO, 100) == (LOCAL, RouteReason.SHORT)
    assert _decide(AUTO, 101) == (REMOTE, RouteReason.LONG)
    assert _decide(AUTO, 100, queued=200) == (LOCAL, RouteReason.SHORT)
    assert _decide(AUTO, 100, queued=201) == (REMOTE, RouteReason.GROUP_BUSY)


@pytest.mark.parametrize("why", [RouteReason.NO_PREFILL_WORKER, RouteReason.CIRCUIT_OPEN])
def test_degraded_prefills_every_prompt_locally(why: RouteReason) -> None:
    for config in (DisaggConfig(), AUTO):
        assert _decide(config, 5000, queued=10**6, degraded=why) == (LOCAL, why)
        assert config.uses_workers
    never = DisaggConfig(DisaggPolicy.NEVER)
    assert _decide(never, 5, degraded=why) == (LOCAL, RouteReason.POLICY)
    assert not never.uses_workers


def test_parse_and_the_metrics_series() -> None:
    assert DisaggConfig.parse("auto", 7, 9) == DisaggConfig(DisaggPolicy.AUTO, 7, 9)
    with pytest.raises(ValueError, match="always, auto, never"):
        DisaggConfig.parse("sometimes", 1, 1)
    assert len(set(ROUTES)) == len(ROUTES)
    assert {reason for _, reason in ROUTES} == set(RouteReason)
