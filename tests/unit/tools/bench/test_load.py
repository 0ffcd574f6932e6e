"""The serve bench's offered load: closed loops hold at most c requests in flight, and Poisson
arrivals are submitted on their seeded schedule whatever is still running."""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Sequence

import pytest

from tools.bench.load import Arrival, Load, drive, drive_blocking
from tools.bench.stats import RequestTiming, gaps


def test_poisson_schedule_is_seeded_and_has_the_rate() -> None:
    load = Load.poisson(4.0, seed=7)
    times = load.offsets(2000)
    assert times == Load.poisson(4.0, seed=7).offsets(2000)  # every config sees one schedule
    assert times != Load.poisson(4.0, seed=8).offsets(2000)
    assert times[0] == 0.0 and min(gaps(times)) > 0
    assert statistics.fmean(gaps(times)) == pytest.approx(0.25, rel=0.1)


@pytest.mark.parametrize(
    "make", [lambda: Load.closed(0), lambda: Load.poisson(0.0), lambda: Load.poisson(math.inf)]
)
def test_bad_loads_are_refused(make) -> None:
    with pytest.raises(ValueError):
        make()


class _Recorder:
    """A fake service: each request holds for `hold_s`; records submissions and peak load."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.started: list[float] = []
        self.in_flight = self.peak = 0

    async def submit(self, prompt: Sequence[int]) -> RequestTiming:
        self.started.append(time.perf_counter())
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(self.hold_s)
        self.in_flight -= 1
        return RequestTiming(0.0, self.hold_s, len(prompt), len(prompt))


def test_a_closed_loop_never_exceeds_its_clients() -> None:
    svc = _Recorder(0.02)
    prompts = [[1] * (i + 1) for i in range(9)]
    timings, wall = asyncio.run(drive(svc.submit, prompts, Load.closed(3)))
    assert svc.peak == 3 and len(svc.started) == 9
    assert [t.output_tokens for t in timings] == [len(p) for p in prompts]  # prompt order
    assert wall >= 3 * 0.02


def test_poisson_arrivals_do_not_wait_for_running_requests() -> None:
    load = Load.poisson(50.0, seed=3)
    svc = _Recorder(0.5)  # every request outlives the whole schedule (~0.1 s)
    prompts = [[1]] * 6
    t0 = time.perf_counter()
    timings, _ = asyncio.run(drive(svc.submit, prompts, load))
    assert len(timings) == 6 and svc.peak == 6
    for at, started in zip(load.offsets(6), sorted(svc.started), strict=True):
        assert started - t0 >= at - 1e-3  # never early
        assert started - t0 < at + 0.25  # and not held back by the running ones (0.5 s)


def test_blocking_requests_run_on_enough_threads() -> None:
    def request(prompt: Sequence[int], max_tokens: int) -> RequestTiming:
        time.sleep(0.2)
        return RequestTiming(0.0, 0.2, max_tokens, max_tokens)

    t0 = time.perf_counter()
    timings, wall = drive_blocking(request, [[1]] * 5, 4, Load.poisson(100.0))
    assert [t.output_tokens for t in timings] == [4] * 5
    assert wall < 0.2 * 5 / 2 and time.perf_counter() - t0 < 1.0  # ran side by side


def test_load_rows_name_their_kind() -> None:
    assert Load.closed(4).row() == {"arrival": "closed", "concurrency": 4, "request_rate": None}
    assert Load.poisson(1.5).row() == {
        "arrival": "poisson",
        "concurrency": None,
        "request_rate": 1.5,
    }
    assert Load.closed(2).arrival is Arrival.CLOSED and Load.poisson(1.0).arrival == "poisson"
    assert (Load.closed(16).label(), Load.poisson(2.5).label()) == ("c=16", "2.5/s")
