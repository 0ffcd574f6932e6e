"""Per-request serving timings and their summary: throughput, TTFT, TPOT and ITL percentiles.

Definitions follow the common serving benchmarks: TTFT is from the request's submission to
its first output token as the client sees it; TPOT is (end-to-end - TTFT) / (tokens - 1),
the mean gap between a request's later tokens; ITL (inter-token latency) is every single gap
between consecutive output chunks as the client received them, pooled over the completed
requests, so a stall in the middle of a stream shows in ITL p99 at its full length where TPOT
spreads it over the request's tokens; throughput is every completed output token of a run
over the run's wall time.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestTiming:
    ttft_s: float
    e2e_s: float
    output_tokens: int
    expected_tokens: int
    error: str = ""
    itl_s: tuple[float, ...] = ()  # gaps between consecutive output chunks (none if unknown)

    @property
    def ok(self) -> bool:
        return not self.error and self.output_tokens == self.expected_tokens

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class LoadSummary:
    requests: int
    completed: int  # finished without error, with exactly the expected token count
    output_tokens: int
    wall_s: float
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    itl_p50_ms: float  # NaN where the configuration does not see single tokens
    itl_p99_ms: float
    itl_max_ms: float
    completion_tokens: tuple[int, ...]
    errors: tuple[str, ...]


def gaps(times: Sequence[float]) -> tuple[float, ...]:
    """Differences between consecutive timestamps."""
    return tuple(b - a for a, b in itertools.pairwise(times))


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(timings: Sequence[RequestTiming], wall_s: float) -> LoadSummary:
    ok = [t for t in timings if t.ok]
    ttft = [1e3 * t.ttft_s for t in ok]
    tpot = [1e3 * s for t in ok if (s := t.tpot_s) is not None]
    itl = [1e3 * gap for t in ok for gap in t.itl_s]
    tokens = sum(t.output_tokens for t in ok)
    return LoadSummary(
        requests=len(timings),
        completed=len(ok),
        output_tokens=tokens,
        wall_s=wall_s,
        output_tok_s=tokens / wall_s if wall_s > 0 else math.nan,
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p99_ms=percentile(ttft, 99),
        tpot_p50_ms=percentile(tpot, 50),
        tpot_p99_ms=percentile(tpot, 99),
        itl_p50_ms=percentile(itl, 50),
        itl_p99_ms=percentile(itl, 99),
        itl_max_ms=max(itl, default=math.nan),
        completion_tokens=tuple(t.output_tokens for t in timings),
        errors=tuple(t.error for t in timings if t.error),
    )
