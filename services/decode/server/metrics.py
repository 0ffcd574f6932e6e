"""The decode leader's Prometheus metrics (prefix `tpla:`), read from its engine, in the
registry its status port (common/rpc/status.py) has served since before the group loaded."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from common.runtime.metrics import (
    PREFIX_CACHE_HELP,
    RANK_HELP,
    SPEC_HELP,
    CounterCallback,
    DecodeMetrics,
    GaugeCallback,
    kernel_info,
)
from services.decode.engine import DecodeEngine


def register_decode_metrics(engine: DecodeEngine, registry: CollectorRegistry) -> None:
    """The group's metrics in `registry`: the step-time and acceptance histograms, the load
    as gauges, the prefix cache's and speculation's counters, the leader rank's kernel
    choices."""
    metrics = DecodeMetrics(registry)
    kernel_info(registry, engine.runtime.kernels)
    histogram = metrics.step_seconds
    engine.probe.on_step = lambda seconds, _batch: histogram.observe(seconds)
    engine.probe.acceptance.on_verify = metrics.acceptance_length.observe

    def read() -> dict[str, float]:
        load = engine.load()
        steps = list(engine.probe.step_seconds)[-20:]
        return {
            "tpla:num_requests_running": load.running,
            "tpla:num_requests_waiting": load.waiting,
            "tpla:kv_cache_usage_ratio": load.usage_ratio,
            "tpla:kv_blocks_total": load.blocks_total,
            "tpla:kv_blocks_used": load.blocks_used,
            "tpla:kv_blocks_cached": load.blocks_cached,
            "tpla:decode_step_seconds_recent": sum(steps) / len(steps) if steps else 0.0,
        }

    registry.register(
        GaugeCallback(
            read,
            {
                "tpla:kv_cache_usage_ratio": "fraction of KV blocks in use on each rank",
                "tpla:decode_step_seconds_recent": "mean time of the last 20 decode steps",
                "tpla:kv_blocks_used": "KV blocks live requests hold",
                "tpla:kv_blocks_cached": "cached prefix blocks no live request holds",
            },
        )
    )

    def counters() -> dict[str, float]:
        load = engine.load(timeout=1.0)
        return {
            "tpla:prefix_cache_queries": load.prefix_queried_tokens,
            "tpla:prefix_cache_hits": load.prefix_hit_tokens,
        }

    registry.register(CounterCallback(counters, PREFIX_CACHE_HELP))

    def spec_counters() -> dict[str, float]:
        acceptance = engine.probe.acceptance
        return {
            "tpla:spec_draft_tokens": acceptance.drafted,
            "tpla:spec_accepted_tokens": acceptance.accepted,
        }

    registry.register(CounterCallback(spec_counters, SPEC_HELP))

    def rank_counters() -> dict[str, float]:
        runtime = engine.runtime  # rank 0's; a follower counts its own (its log says so)
        return {
            "tpla:decode_eager_steps": runtime.eager_steps,
            "tpla:kv_stale_pushes": runtime.epochs.dropped,
        }

    registry.register(CounterCallback(rank_counters, RANK_HELP))
