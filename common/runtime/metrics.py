"""Worker-side Prometheus metrics (prefix `tpla:`); the router defines the client-facing ones.

Each worker serves its own registry over HTTP on its gRPC port + METRICS_PORT_OFFSET
(common/runtime/ports.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from common.runtime.kernel_choice import KernelChoice

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class _ReadAtScrape(Collector):
    """Values a service's core keeps (plain numbers), read at scrape time, so the hot path
    never updates a metric."""

    family: type[GaugeMetricFamily] | type[CounterMetricFamily]

    def __init__(self, read: Callable[[], dict[str, float]], help_text: dict[str, str]) -> None:
        self.read = read
        self.help_text = help_text

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        try:
            values = self.read()
        except Exception:  # a failing worker reports nothing rather than a 500
            return
        for name, value in values.items():
            yield self.family(name, self.help_text.get(name, name), value=value)


class GaugeCallback(_ReadAtScrape):
    """Gauges read at scrape time."""

    family = GaugeMetricFamily


class CounterCallback(_ReadAtScrape):
    """Counters read at scrape time; names without the `_total` suffix, which the exposition
    adds."""

    family = CounterMetricFamily


# Prefix caching, per service (decode: blocks reused at Reserve; prefill: latents reused).
PREFIX_CACHE_HELP = {
    "tpla:prefix_cache_queries": "prompt tokens looked up in the prefix cache",
    "tpla:prefix_cache_hits": "prompt tokens found in the prefix cache",
}


class PrefillMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.transfer_bytes = Counter(
            "tpla:kv_transfer_bytes_total",
            "KV shard bytes pushed to decode ranks",
            ["transport"],
            registry=registry,
        )
        self.transfer_seconds = Histogram(
            "tpla:kv_transfer_seconds",
            "time from a request's shards leaving its prefill batch to the last rank's ack",
            ["transport"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.exposed_transfer_seconds = Histogram(
            "tpla:kv_exposed_transfer_seconds",
            "time from the end of a request's last prefill chunk to the last rank's ack (the "
            "transfer time TTFT waits for; earlier chunks ship while later ones compute)",
            ["transport"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.prefill_seconds = Histogram(
            "tpla:prefill_seconds",
            "exact MLA prefill of a batch",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        help_text = PREFIX_CACHE_HELP
        self.prefix_queries = Counter(
            "tpla:prefix_cache_queries", help_text["tpla:prefix_cache_queries"], registry=registry
        )
        self.prefix_hits = Counter(
            "tpla:prefix_cache_hits", help_text["tpla:prefix_cache_hits"], registry=registry
        )


class DecodeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.step_seconds = Histogram(
            "tpla:decode_step_seconds",
            "one decode step of a batch",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.acceptance_length = Histogram(
            "tpla:spec_acceptance_length",
            "drafts a sequence kept of those one speculative step fed it",
            buckets=(0, 1, 2, 3, 4, 5, 6, 8, 12, 16),
            registry=registry,
        )


SPEC_HELP = {
    "tpla:spec_draft_tokens": "draft tokens speculative steps fed",
    "tpla:spec_accepted_tokens": "draft tokens speculative steps kept",
}
# A decode group's leader rank (rank 0).
RANK_HELP = {
    "tpla:decode_eager_steps": "decode steps run without a CUDA graph on a group that replays them",
    "tpla:kv_stale_pushes": "KV pushes dropped: their reservation's blocks were given to another",
}


def kernel_info(registry: CollectorRegistry, choices: Iterable[KernelChoice]) -> None:
    """`tpla:kernel_info{selector, kernel} 1` for each kernel choice the service made at
    start-up (common/runtime/kernel_choice.py)."""
    info = Info(
        "tpla:kernel",
        "the kernel each selector chose at start-up (TPLA_DECODE_KERNEL, ...)",
        ["selector"],
        registry=registry,
    )
    for choice in choices:
        info.labels(choice.selector).info({"kernel": choice.kernel})


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> None:
    start_http_server(port, addr=host, registry=registry)
