"""The metric names read out of PromQL, and the series names a registry's exposition defines."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tools.grafana.promql import exported_series, metric_names, unknown_names, variable_metric_names


def test_names_are_read_past_functions_matchers_ranges_and_grouping() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, model_name) (rate(a:x_bucket{model_name=~"$m",'
        ' le!="b:not_a_name"}[$__rate_interval]))) / on (job) group_left (instance)'
        " sum without (pod) (increase(b_total[5m:30s] offset 1h30m)) > bool 1e3"
        " unless c and ignoring (x) d @ start()"
    )
    assert metric_names(expr) == {"a:x_bucket", "b_total", "c", "d"}
    assert metric_names("sum(rate(x_total[1m])) by (le) * 0x1f - .5") == {"x_total"}
    assert metric_names("vector(1)") == set()


def test_variable_queries() -> None:
    assert variable_metric_names("label_values(tpla:requests_total, model_name)") == {
        "tpla:requests_total"
    }
    assert variable_metric_names('label_values(up{job="x"}, instance)') == {"up"}
    assert variable_metric_names("label_values(model_name)") == set()
    assert variable_metric_names("sum(rate(y_total[5m]))") == {"y_total"}


def test_each_type_exports_only_its_own_suffixes() -> None:
    registry = CollectorRegistry()
    Counter("t:c", "c", ["l"], registry=registry)  # no child: the family is still exported
    Histogram("t:h", "h", registry=registry)
    Gauge("t:g", "g", registry=registry)
    series = exported_series(generate_latest(registry).decode())
    assert {"t:c_total", "t:h_bucket", "t:h_count", "t:h_sum", "t:g"} <= series.keys()
    for wrong in ("t:c", "t:c_bucket", "t:h", "t:h_total", "t:g_total", "t:g_bucket"):
        assert wrong not in series
    assert series["t:c_total"] == "t:c" and series["t:h_bucket"] == "t:h"
    exprs = ["rate(t:c_total[1m])", "t:g_total", "rate(t:c_bucket[1m]) + t:h_sum"]
    assert unknown_names(exprs, series) == {
        "t:g_total": {"t:g_total"},
        "rate(t:c_bucket[1m]) + t:h_sum": {"t:c_bucket"},
    }
