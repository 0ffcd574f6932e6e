"""The dashboard: its shipped copies are what the generator builds, its panels tile the grid,
and every expression reads at least one `tpla:` metric (tests/e2e/test_dashboard.py holds the
names against a running stack's registries)."""

from __future__ import annotations

import json

from tools.grafana.dashboard import OUTPUTS, dashboard, exprs, render, variable_queries
from tools.grafana.promql import metric_names, variable_metric_names


def test_shipped_copies_are_the_generated_dashboard() -> None:
    for path in OUTPUTS:
        assert path.read_text() == render(), f"{path}: run `python -m tools.grafana.dashboard`"
    assert json.loads(render()) == dashboard()


def test_panels_tile_the_grid_with_unique_ids() -> None:
    panels = dashboard()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        area = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & area, p["title"]
        cells |= area
        targets = p.get("targets", [])
        assert (p["type"] == "row") == (not targets), p["title"]
        assert len({t["refId"] for t in targets}) == len(targets)


def test_every_query_reads_a_tpla_metric() -> None:
    board = dashboard()
    for expr in exprs(board):
        names = metric_names(expr)
        assert names and all(n.startswith("tpla:") for n in names), expr
    for query in variable_queries(board):
        assert variable_metric_names(query) == {"tpla:requests_total"}


def test_the_issue_s_panels_are_there() -> None:
    titles = " | ".join(p["title"] for p in dashboard()["panels"]).lower()
    for words in (
        "time to first token",
        "inter-token latency",
        "exposed kv transfer time",
        "requests per second",
        "tokens per second",
        "queue wait",
        "rejected",
        "kv blocks used and cached per decode group",
        "prefix-cache hit rate",
        "kv transfer time",
        "kv transfer bytes",
        "migrations",
        "errors by type",
        "worker health",
    ):
        assert words in titles, words
    p99 = [e for e in exprs(dashboard()) if "histogram_quantile(0.99" in e]
    assert any("time_to_first_token" in e for e in p99) and any("inter_token" in e for e in p99)
    assert any("kv_exposed_transfer" in e for e in p99)
