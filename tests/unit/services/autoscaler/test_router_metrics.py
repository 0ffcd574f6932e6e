"""Reading the router's metrics: the router's own registry rendered, scraped twice, gives the
window's rate, means and percentiles; a scrape without a metric names it."""

from __future__ import annotations

import pytest

from services.autoscaler.router_metrics import (
    MissingMetric,
    histogram_quantile,
    observe,
    parse_scrape,
)
from services.router.metrics import Outcome, RouterMetrics


def test_two_scrapes_give_the_windows_load() -> None:
    m = RouterMetrics("demo")
    m.finished(Outcome.FINISHED, 1000, 10)
    m.observe_ttft(9.0)
    first = parse_scrape(m.render().decode(), at=0.0)
    for _ in range(4):
        m.finished(Outcome.FINISHED, 200, 50)
        m.observe_ttft(0.2)
        m.observe_itl(0.02)
    m.set_load(running=3, waiting=2)
    obs = observe([parse_scrape(m.render().decode(), at=2.0)], [first])
    assert obs.window_s == 2.0 and obs.request_rate == 2.0
    assert obs.prompt_tokens == 200 and obs.output_tokens == 50
    assert obs.ttft_mean_s == pytest.approx(0.2) and obs.itl_mean_s == pytest.approx(0.02)
    assert (obs.queued, obs.running) == (2, 3)
    assert obs.ttft_p99_s is not None and 0.1 < obs.ttft_p99_s <= 0.25  # its bucket


def test_routers_add_up_and_a_restart_counts_from_zero() -> None:
    a, b = RouterMetrics("demo"), RouterMetrics("demo")
    a.finished(Outcome.FINISHED, 100, 10)
    for _ in range(3):
        b.finished(Outcome.FINISHED, 100, 10)
    before = [parse_scrape(m.render().decode(), 0.0) for m in (a, b)]
    a.finished(Outcome.FAILED, 300, 30)
    restarted = RouterMetrics("demo")  # b restarted: its counters start again below
    restarted.finished(Outcome.FINISHED, 100, 10)
    after = [parse_scrape(m.render().decode(), 1.0) for m in (a, restarted)]
    obs = observe(after, before)
    assert obs.request_rate == 2.0 and obs.prompt_tokens == 200 and obs.output_tokens == 20
    assert obs.ttft_mean_s is None  # no first token in the window


def test_a_missing_metric_is_named() -> None:
    text = RouterMetrics("demo").render().decode()
    text = "\n".join(line for line in text.splitlines() if "num_requests_waiting" not in line)
    with pytest.raises(MissingMetric, match="tpla:num_requests_waiting") as info:
        parse_scrape(text + "\n", 0.0, "router http://x")
    assert "router http://x" in str(info.value)


def test_histogram_quantile_matches_prometheus() -> None:
    buckets = ((0.1, 10.0), (0.5, 30.0), (float("inf"), 40.0))
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * 10 / 20)
    assert histogram_quantile(0.99, buckets) == 0.5  # in +Inf: the highest finite bound
    assert histogram_quantile(0.5, ((1.0, 0.0),)) is None
