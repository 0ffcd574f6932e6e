"""Where the autoscaler reads the load: the routers' own `/metrics` (scraped a window apart),
or Prometheus's HTTP API (rates over a window, summed over every router it scrapes). Both
answer an Observation; a metric neither exports raises MissingMetric naming it."""

from __future__ import annotations

import abc
import time

import httpx

from services.autoscaler.router_metrics import (
    ITL,
    OUTPUT_TOKENS,
    PROMPT_TOKENS,
    REQUESTS,
    REQUIRED,
    RUNNING,
    TTFT,
    WAITING,
    MissingMetric,
    Scrape,
    observe,
    parse_scrape,
)
from services.autoscaler.sizing import Observation

HTTP_TIMEOUT_S = 10.0


class LoadSource(abc.ABC):
    @abc.abstractmethod
    def observe(self) -> Observation:
        """The load over the last window (the first call may wait one window)."""


class RouterSource(LoadSource):
    """One or more routers' `/metrics`; the first observation waits `window_s` between its
    two scrapes, each later one compares with the scrape before it."""

    def __init__(self, urls: list[str], window_s: float) -> None:
        self._urls = [u.rstrip("/") for u in urls]
        self._window_s = window_s
        self._last: list[Scrape] | None = None

    def _scrape(self) -> list[Scrape]:
        out = []
        with httpx.Client(timeout=HTTP_TIMEOUT_S) as client:
            for url in self._urls:
                resp = client.get(f"{url}/metrics")
                resp.raise_for_status()
                out.append(parse_scrape(resp.text, time.monotonic(), f"router {url}"))
        return out

    def observe(self) -> Observation:
        if self._last is None:
            self._last = self._scrape()
            time.sleep(self._window_s)
        first, self._last = self._last, self._scrape()
        return observe(self._last, first)


def _rate(name: str, window: str) -> str:
    return f"sum(rate({name}[{window}]))"


def _quantile(hist: str, window: str) -> str:
    return f"histogram_quantile(0.99, sum by (le) (rate({hist}_bucket[{window}])))"


class PrometheusSource(LoadSource):
    """Prometheus's instant queries over `window_s` (at least four scrape intervals, for
    rate() to see enough samples)."""

    def __init__(self, url: str, window_s: float) -> None:
        self._url = url.rstrip("/")
        self._window = f"{max(int(window_s), 1)}s"

    def _query(self, client: httpx.Client, promql: str) -> float | None:
        resp = client.get(f"{self._url}/api/v1/query", params={"query": promql})
        resp.raise_for_status()
        body = resp.json()
        if body.get("status") != "success":
            raise ValueError(f"Prometheus refused {promql!r}: {body.get('error')}")
        result = body["data"]["result"]
        if not result:
            return None
        value = float(result[0]["value"][1])
        return None if value != value else value  # NaN: 0/0, no traffic

    def observe(self) -> Observation:
        w = self._window
        with httpx.Client(timeout=HTTP_TIMEOUT_S) as client:
            for name in REQUIRED:
                if self._query(client, f'count({{__name__="{name}"}})') is None:
                    raise MissingMetric(name, f"Prometheus at {self._url}")
            q = {
                "rate": _rate(REQUESTS, w),
                "prompt": f"{_rate(PROMPT_TOKENS, w)} / {_rate(REQUESTS, w)}",
                "output": f"{_rate(OUTPUT_TOKENS, w)} / {_rate(REQUESTS, w)}",
                "ttft": f"{_rate(f'{TTFT}_sum', w)} / {_rate(f'{TTFT}_count', w)}",
                "itl": f"{_rate(f'{ITL}_sum', w)} / {_rate(f'{ITL}_count', w)}",
                "ttft_p99": _quantile(TTFT, w),
                "itl_p99": _quantile(ITL, w),
                "queued": f"sum({WAITING})",
                "running": f"sum({RUNNING})",
            }
            v = {key: self._query(client, promql) for key, promql in q.items()}
        return Observation(
            window_s=float(w[:-1]),
            request_rate=v["rate"] or 0.0,
            prompt_tokens=v["prompt"] or 0.0,
            output_tokens=v["output"] or 0.0,
            ttft_mean_s=v["ttft"],
            itl_mean_s=v["itl"],
            queued=v["queued"] or 0.0,
            running=v["running"] or 0.0,
            ttft_p99_s=v["ttft_p99"],
            itl_p99_s=v["itl_p99"],
        )
