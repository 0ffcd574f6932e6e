"""The Grafana dashboard of a tpla-serve deployment, built from a list of panels.

`python -m tools.grafana.dashboard` writes it where it ships: docs/grafana/tpla-dashboard.json
and k8s/base/grafana/tpla-dashboard.json (a ConfigMap with the Grafana sidecar's label, made
by k8s/base/kustomization.yaml); the unit tests hold both copies equal to `dashboard()`.

Router metrics carry `model_name` (the `$model` variable); the workers' do not, and a decode
leader's are told apart by their scrape target (`instance`): one target per decode group.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
OUTPUTS = (
    ROOT / "docs" / "grafana" / "tpla-dashboard.json",
    ROOT / "k8s" / "base" / "grafana" / "tpla-dashboard.json",
)
UID = "tpla-serve"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
MODEL = 'model_name=~"$model"'
RATE = "[$__rate_interval]"
WIDTH = 8  # three panels to a row of Grafana's 24 columns
HEIGHT = 8


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    targets: tuple[Target, ...]
    description: str = ""
    kind: str = "timeseries"


def rate(selector: str) -> str:
    return f"rate({selector}{RATE})"


def selector(metric: str, matchers: str = MODEL) -> str:
    return f"{metric}{{{matchers}}}" if matchers else metric


def summed_rate(metric: str, by: str = "", matchers: str = MODEL) -> str:
    """The per-second rate of a counter over every replica, split by `by` labels when given."""
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} ({rate(selector(metric, matchers))})"


def quantiles(histogram: str, what: str, by: str = "", matchers: str = MODEL) -> tuple[Target, ...]:
    """p50 and p99 of a histogram over every replica, split by `by` labels when given."""
    labels = ", ".join(["le", *([by] if by else [])])
    legend_by = f" {{{{{by}}}}}" if by else ""
    buckets = rate(selector(f"{histogram}_bucket", matchers))
    return tuple(
        Target(
            f"histogram_quantile({q}, sum by ({labels}) ({buckets}))",
            f"{what} p{round(q * 100)}{legend_by}",
        )
        for q in (0.5, 0.99)
    )


WORKER_LABELS = "worker_id, role, rank, group_id"


def rows() -> list[tuple[str, list[Panel]]]:
    """The dashboard's sections and their panels, in order."""
    return [
        _latency(),
        _traffic(),
        _queue(),
        _kv_cache(),
        _prefill_and_decode(),
        _failures(),
        _workers(),
    ]


def _latency() -> tuple[str, list[Panel]]:
    return (
        "Latency",
        [
            Panel(
                "Time to first token",
                "s",
                quantiles("tpla:time_to_first_token_seconds", "TTFT"),
            ),
            Panel("Inter-token latency", "s", quantiles("tpla:inter_token_latency_seconds", "ITL")),
            Panel("End-to-end latency", "s", quantiles("tpla:e2e_request_latency_seconds", "e2e")),
            Panel(
                "Exposed KV transfer time",
                "s",
                quantiles("tpla:kv_exposed_transfer_seconds", "exposed", "transport", ""),
                "the part of TTFT the KV transfer adds: from the end of a request's last"
                " prefill chunk to the last rank's ack (earlier chunks ship while later ones"
                " compute)",
            ),
        ],
    )


def _traffic() -> tuple[str, list[Panel]]:
    return (
        "Traffic",
        [
            Panel(
                "Requests per second",
                "reqps",
                (
                    Target(
                        summed_rate("tpla:requests_total", "outcome"),
                        "{{outcome}}",
                    ),
                ),
            ),
            Panel(
                "Tokens per second",
                "short",
                (
                    Target(summed_rate("tpla:prompt_tokens_total"), "prompt"),
                    Target(summed_rate("tpla:generation_tokens_total"), "generated"),
                ),
            ),
            Panel(
                "Request sizes (tokens)",
                "short",
                quantiles("tpla:request_prompt_tokens", "prompt")
                + quantiles("tpla:request_generation_tokens", "output"),
                "finished requests; output counts every choice",
            ),
        ],
    )


def _queue() -> tuple[str, list[Panel]]:
    return (
        "Queue and admission",
        [
            Panel(
                "Requests running and waiting (routers)",
                "short",
                (
                    Target(f"sum (tpla:num_requests_running{{{MODEL}}})", "running"),
                    Target(f"sum (tpla:num_requests_waiting{{{MODEL}}})", "waiting"),
                ),
            ),
            Panel("Queue wait", "s", quantiles("tpla:request_queue_seconds", "wait")),
            Panel(
                "Rejected (429) per second",
                "reqps",
                (
                    Target(
                        summed_rate("tpla:requests_total", matchers=f'{MODEL}, outcome="rejected"'),
                        "rejected",
                    ),
                ),
                "refused at admission: the routers' in-flight and waiting slots were full",
            ),
        ],
    )


def _kv_cache() -> tuple[str, list[Panel]]:
    return (
        "KV cache",
        [
            Panel(
                "KV blocks used and cached per decode group",
                "short",
                (
                    Target("sum by (instance) (tpla:kv_blocks_used)", "used {{instance}}"),
                    Target("sum by (instance) (tpla:kv_blocks_cached)", "cached {{instance}}"),
                    Target("sum by (instance) (tpla:kv_blocks_total)", "total {{instance}}"),
                ),
                "blocks held by live requests, and cached prefix blocks no request holds",
            ),
            Panel(
                "KV cache usage per decode group",
                "percentunit",
                (Target("max by (instance) (tpla:kv_cache_usage_ratio)", "{{instance}}"),),
            ),
            Panel(
                "Prefix-cache hit rate",
                "percentunit",
                (
                    Target(
                        f"{summed_rate('tpla:prefix_cache_hits_total', 'job', '')}"
                        f" / {summed_rate('tpla:prefix_cache_queries_total', 'job', '')}",
                        "{{job}}",
                    ),
                ),
                "prompt tokens found cached over tokens looked up: decode groups (blocks reused"
                " at Reserve) and prefill workers (latents reused)",
            ),
        ],
    )


def _prefill_and_decode() -> tuple[str, list[Panel]]:
    return (
        "Prefill, KV transfer and decode",
        [
            Panel(
                "KV transfer time",
                "s",
                quantiles("tpla:kv_transfer_seconds", "transfer", "transport", ""),
                "from a request's shards leaving its prefill batch to the last rank's ack",
            ),
            Panel(
                "KV transfer bytes per second",
                "Bps",
                (
                    Target(
                        summed_rate("tpla:kv_transfer_bytes_total", "transport", ""),
                        "{{transport}}",
                    ),
                ),
            ),
            Panel(
                "Prefill batch and decode step time",
                "s",
                quantiles("tpla:prefill_seconds", "prefill batch", matchers="")
                + quantiles("tpla:decode_step_seconds", "decode step", matchers=""),
            ),
        ],
    )


def _failures() -> tuple[str, list[Panel]]:
    return (
        "Failures",
        [
            Panel(
                "Migrations per second",
                "reqps",
                (Target(summed_rate("tpla:request_migrations_total"), "migrated"),),
                "streams moved to another decode group after theirs failed",
            ),
            Panel(
                "Errors by type per second",
                "reqps",
                (
                    Target(
                        summed_rate("tpla:request_errors_total", "error_type"),
                        "{{error_type}}",
                    ),
                    Target(
                        summed_rate(
                            "tpla:requests_total",
                            "outcome",
                            f'{MODEL}, outcome=~"aborted|rejected"',
                        ),
                        "{{outcome}}",
                    ),
                ),
                "failed requests by the OpenAI error type; aborted: the client went away",
            ),
        ],
    )


def _workers() -> tuple[str, list[Panel]]:
    worker = WORKER_LABELS
    return (
        "Workers",
        [
            Panel(
                "Worker health",
                "short",
                (Target(f"min by ({worker}) (tpla:worker_healthy)", "{{role}} {{worker_id}}"),),
                "1: registered, healthy and not quarantined by any router",
                kind="state-timeline",
            ),
            Panel(
                "Heartbeat age",
                "s",
                (
                    Target(
                        f"max by ({worker}) (tpla:worker_heartbeat_age_seconds)",
                        "{{role}} {{worker_id}}",
                    ),
                ),
                "seconds since each worker's registry record was refreshed",
            ),
        ],
    )


def _panel(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": panel.unit}
    if panel.kind == "state-timeline":
        defaults["mappings"] = [
            {
                "type": "value",
                "options": {
                    "0": {"text": "unhealthy", "color": "red"},
                    "1": {"text": "healthy", "color": "green"},
                },
            }
        ]
        defaults["color"] = {"mode": "thresholds"}
        defaults["thresholds"] = {
            "mode": "absolute",
            "steps": [{"color": "red", "value": None}, {"color": "green", "value": 1}],
        }
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"x": x, "y": y, "w": WIDTH, "h": HEIGHT},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": DATASOURCE,
                "expr": t.expr,
                "legendFormat": t.legend,
            }
            for i, t in enumerate(panel.targets)
        ],
    }


def _variables() -> list[dict[str, Any]]:
    return [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus"},
        {
            "name": "model",
            "label": "Model",
            "type": "query",
            "datasource": DATASOURCE,
            "query": {"query": "label_values(tpla:requests_total, model_name)", "refId": "model"},
            "definition": "label_values(tpla:requests_total, model_name)",
            "includeAll": True,
            "multi": True,
            # The routers' series only: a decode leader's gauges share names but no model.
            "allValue": ".+",
            "current": {"text": "All", "value": "$__all"},
            "refresh": 2,
            "sort": 1,
        },
    ]


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y = 0
    for title, row in rows():
        panels.append(
            {
                "id": len(panels) + 1,
                "type": "row",
                "title": title,
                "collapsed": False,
                "gridPos": {"x": 0, "y": y, "w": 24, "h": 1},
                "panels": [],
            }
        )
        y += 1
        for i, panel in enumerate(row):
            panels.append(_panel(panel, len(panels) + 1, (i % 3) * WIDTH, y + (i // 3) * HEIGHT))
        y += HEIGHT * ((len(row) + 2) // 3)
    return {
        "uid": UID,
        "title": "tpla-serve",
        "description": "Disaggregated prefill/decode serving: latency, traffic, queue, KV cache,"
        " transfers, failures and workers (docs/deploy.md, Monitoring).",
        "tags": ["tpla-serve"],
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "",
        "templating": {"list": _variables()},
        "annotations": {"list": []},
        "panels": panels,
        "version": 1,
    }


def exprs(board: dict[str, Any]) -> list[str]:
    """Every PromQL expression of the board's panels."""
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])]


def variable_queries(board: dict[str, Any]) -> list[str]:
    """Every query of the board's query variables."""
    return [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main() -> int:
    text = render()
    for path in OUTPUTS:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
