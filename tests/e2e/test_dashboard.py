"""The Grafana dashboard against a running stack: every metric its PromQL reads is one the
services export, as scraped from the router's `/metrics` and each worker's metrics endpoint."""

from __future__ import annotations

import httpx
import openai

from common.runtime.ports import METRICS_PORT_OFFSET
from tests.stack import MODEL_NAME
from tools.grafana.dashboard import dashboard, exprs, variable_queries
from tools.grafana.promql import exported_series, unknown_names, variable_metric_names
from tools.local_stack import LocalStack


def metrics_urls(stack: LocalStack) -> dict[str, str]:
    """Each scrape target: the router, every prefill worker and every decode leader."""
    urls = {"router": f"{stack.url}/metrics"}
    for w in stack.workers():
        if w["role"] == "prefill" or w["rank"] == 0:
            host, port = w["address"].rsplit(":", 1)
            urls[w["worker_id"]] = f"http://{host}:{int(port) + METRICS_PORT_OFFSET}/metrics"
    return urls


def test_dashboard_reads_only_exported_metrics(stack: LocalStack) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    urls = metrics_urls(stack)
    roles = {w["role"] for w in stack.workers()}
    assert roles == {"prefill", "decode"} and len(urls) >= 3, urls
    series: dict[str, str] = {}
    for url in urls.values():
        series |= exported_series(httpx.get(url, timeout=10).text)
    board = dashboard()
    assert unknown_names(exprs(board), series) == {}
    for query in variable_queries(board):
        assert variable_metric_names(query) <= series.keys(), query
