"""The load a router's `/metrics` shows: one scrape parsed into cumulative totals, and two
scrapes a window apart turned into an Observation (rates, means, percentiles), summed over
every label set (model names, outcomes). Every name the autoscaler reads is listed here; a
scrape without one of them raises MissingMetric naming it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from services.autoscaler.sizing import Observation

REQUESTS = "tpla:requests_total"
PROMPT_TOKENS = "tpla:prompt_tokens_total"
OUTPUT_TOKENS = "tpla:generation_tokens_total"
TTFT = "tpla:time_to_first_token_seconds"
ITL = "tpla:inter_token_latency_seconds"
WAITING = "tpla:num_requests_waiting"
RUNNING = "tpla:num_requests_running"
TOTALS = (REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS, f"{TTFT}_sum", f"{TTFT}_count")
TOTALS += (f"{ITL}_sum", f"{ITL}_count")
GAUGES = (WAITING, RUNNING)
HISTOGRAMS = (TTFT, ITL)
REQUIRED = (*TOTALS, *GAUGES, *(f"{h}_bucket" for h in HISTOGRAMS))


class MissingMetric(ValueError):
    def __init__(self, name: str, where: str) -> None:
        super().__init__(f"{where} does not export {name}, which the autoscaler reads")
        self.name = name


Buckets = tuple[tuple[float, float], ...]  # (upper bound, cumulative count), by bound


@dataclass(frozen=True)
class Scrape:
    at: float  # seconds, the caller's monotonic clock
    totals: dict[str, float]  # counters and gauges, summed over label sets
    buckets: dict[str, Buckets]  # per histogram


def parse_scrape(text: str, at: float, where: str = "the router") -> Scrape:
    sums: dict[str, float] = {}
    by_le: dict[str, dict[float, float]] = {h: {} for h in HISTOGRAMS}
    seen: set[str] = set()
    for family in text_string_to_metric_families(text):
        # A labelled histogram nothing was observed in yet has its family and no samples.
        seen.add(family.name)
        for sample in family.samples:
            seen.add(sample.name)
            if sample.name.endswith("_bucket") and sample.name[: -len("_bucket")] in by_le:
                le = float(sample.labels["le"])
                hist = by_le[sample.name[: -len("_bucket")]]
                hist[le] = hist.get(le, 0.0) + sample.value
            else:
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    for name in REQUIRED:
        if name not in seen and _family(name) not in seen:
            raise MissingMetric(name, where)
    buckets = {h: tuple(sorted(by_le[h].items())) for h in HISTOGRAMS}
    return Scrape(at, {n: sums.get(n, 0.0) for n in (*TOTALS, *GAUGES)}, buckets)


def _family(sample: str) -> str:
    for suffix in ("_total", "_sum", "_count", "_bucket"):
        if sample.endswith(suffix):
            return sample[: -len(suffix)]
    return sample


def histogram_quantile(q: float, buckets: Buckets) -> float | None:
    """Prometheus's histogram_quantile over cumulative buckets (linear within a bucket, the
    lowest bucket from 0, the +Inf bucket answered by the highest finite bound)."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


def _delta(new: float, old: float) -> float:
    """A counter's increase; a router that restarted in between counts from zero."""
    return new - old if new >= old else new


def _delta_buckets(new: Buckets, old: Buckets) -> Buckets:
    before = dict(old)
    return tuple((le, _delta(count, before.get(le, 0.0))) for le, count in new)


def _mean(total: float, count: float) -> float | None:
    return total / count if count > 0 else None


def observe(scrapes: Sequence[Scrape], first: Sequence[Scrape]) -> Observation:
    """The load between `first` and `scrapes` (one scrape of each router, in the same order)."""
    if not scrapes or len(scrapes) != len(first):
        raise ValueError("one earlier scrape per router")
    window = min(b.at - a.at for a, b in zip(first, scrapes, strict=True))
    if window <= 0:
        raise ValueError("the scrapes must be a window apart")
    d: dict[str, float] = {n: 0.0 for n in TOTALS}
    hist: dict[str, dict[float, float]] = {h: {} for h in HISTOGRAMS}
    for a, b in zip(first, scrapes, strict=True):
        for name in TOTALS:
            d[name] += _delta(b.totals[name], a.totals[name])
        for h in HISTOGRAMS:
            for le, count in _delta_buckets(b.buckets[h], a.buckets[h]):
                hist[h][le] = hist[h].get(le, 0.0) + count
    merged = {h: tuple(sorted(hist[h].items())) for h in HISTOGRAMS}
    requests = d[REQUESTS]
    return Observation(
        window_s=window,
        request_rate=requests / window,
        prompt_tokens=_mean(d[PROMPT_TOKENS], requests) or 0.0,
        output_tokens=_mean(d[OUTPUT_TOKENS], requests) or 0.0,
        ttft_mean_s=_mean(d[f"{TTFT}_sum"], d[f"{TTFT}_count"]),
        itl_mean_s=_mean(d[f"{ITL}_sum"], d[f"{ITL}_count"]),
        queued=sum(s.totals[WAITING] for s in scrapes),
        running=sum(s.totals[RUNNING] for s in scrapes),
        ttft_p99_s=histogram_quantile(0.99, merged[TTFT]),
        itl_p99_s=histogram_quantile(0.99, merged[ITL]),
    )
