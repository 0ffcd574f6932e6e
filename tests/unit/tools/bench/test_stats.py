"""The serve bench's statistics: inter-token gaps are pooled over the completed requests."""

from __future__ import annotations

import math

import pytest

from tools.bench.stats import RequestTiming, gaps, summarize


def test_itl_pools_the_gaps_of_completed_requests() -> None:
    ok = RequestTiming(0.01, 0.05, 3, 3, itl_s=gaps([0.01, 0.02, 0.05]))
    stalled = RequestTiming(0.01, 0.5, 3, 3, itl_s=gaps([0.01, 0.45, 0.5]))
    failed = RequestTiming(0.01, 0.9, 1, 3, error="boom", itl_s=(0.8,))
    s = summarize([ok, stalled, failed], 1.0)
    assert s.completed == 2
    assert s.itl_max_ms == pytest.approx(440.0)  # the stall at full length, not the failure's
    assert s.itl_p50_ms == pytest.approx((30.0 + 50.0) / 2)
    assert s.tpot_p99_ms < s.itl_max_ms  # TPOT spreads the stall over the request's tokens
    no_tokens = summarize([RequestTiming(0.01, 0.05, 3, 3)], 1.0)  # e.g. no per-token clock
    assert math.isnan(no_tokens.itl_p99_ms) and math.isnan(no_tokens.itl_max_ms)
