"""Offered load for `tpla bench serve`: a closed loop of clients, or requests arriving at a rate.

* closed  - c clients, each sending its next request when its previous one finished. All c
            start together, and with equal prompt and output lengths they stay in step:
            every request of a wave is prefilled before any of them decodes, so prefill
            never meets a running decode. That measures a burst, not a service.
* poisson - requests submitted at exponentially spaced times (a Poisson process of `rate`
            per second, seeded, so every configuration sees the same schedule), whatever is
            still running: new prompts arrive while others decode, which is where prefill
            and decode interfere and where disaggregation is meant to pay (the load of
            vLLM's `benchmark_serving --request-rate`).

`drive` is the one driver for both: every configuration supplies an async `submit(prompt)`
(an HTTP stream, or a blocking call run on a thread) and gets back per-request timings and
the wall time from the first submission to the last completion.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum

from tools.bench.stats import RequestTiming


class Arrival(StrEnum):
    CLOSED = "closed"
    POISSON = "poisson"


@dataclass(frozen=True)
class Load:
    arrival: Arrival
    concurrency: int = 0  # closed: clients
    rate: float = 0.0  # poisson: requests per second
    seed: int = 0  # poisson: the schedule's seed

    def __post_init__(self) -> None:
        if self.arrival is Arrival.CLOSED and self.concurrency < 1:
            raise ValueError(f"a closed loop needs >= 1 client, got {self.concurrency}")
        if self.arrival is Arrival.POISSON and not (math.isfinite(self.rate) and self.rate > 0):
            raise ValueError(f"a request rate must be a positive number, got {self.rate}")

    @classmethod
    def closed(cls, concurrency: int) -> Load:
        return cls(Arrival.CLOSED, concurrency=concurrency)

    @classmethod
    def poisson(cls, rate: float, seed: int = 0) -> Load:
        return cls(Arrival.POISSON, rate=rate, seed=seed)

    def label(self) -> str:
        return f"c={self.concurrency}" if self.arrival is Arrival.CLOSED else f"{self.rate:g}/s"

    def row(self) -> dict[str, object]:
        """The load's columns in a result row (both keys always present)."""
        closed = self.arrival is Arrival.CLOSED
        return {
            "arrival": self.arrival.value,
            "concurrency": self.concurrency if closed else None,
            "request_rate": None if closed else self.rate,
        }

    def offsets(self, n: int) -> list[float]:
        """Submission times (s from the start) of `n` Poisson arrivals; the first at 0."""
        rng = random.Random(self.seed)
        times, t = [], 0.0
        for _ in range(n):
            times.append(t)
            t += rng.expovariate(self.rate)
        return times

    def max_in_flight(self, n: int) -> int:
        """An upper bound on concurrent requests (sizes thread pools and connection limits)."""
        return self.concurrency if self.arrival is Arrival.CLOSED else n


Submit = Callable[[Sequence[int]], Awaitable[RequestTiming]]


async def drive(
    submit: Submit, prompts: Sequence[Sequence[int]], load: Load
) -> tuple[list[RequestTiming], float]:
    """Serve `prompts` under `load`; timings in prompt order and the run's wall time."""
    results: list[RequestTiming | None] = [None] * len(prompts)
    t0 = time.perf_counter()
    if load.arrival is Arrival.CLOSED:
        pending = list(enumerate(prompts))

        async def client() -> None:
            while pending:
                i, prompt = pending.pop(0)
                results[i] = await submit(prompt)

        await asyncio.gather(*(client() for _ in range(load.concurrency)))
    else:

        async def arrive(i: int, at: float) -> None:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            results[i] = await submit(prompts[i])

        await asyncio.gather(*(arrive(i, at) for i, at in enumerate(load.offsets(len(prompts)))))
    wall = time.perf_counter() - t0
    return [r for r in results if r is not None], wall


def drive_blocking(
    request: Callable[[Sequence[int], int], RequestTiming],
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    load: Load,
) -> tuple[list[RequestTiming], float]:
    """`drive` for in-process configurations whose `request` blocks: one thread per client."""
    with ThreadPoolExecutor(max_workers=load.max_in_flight(len(prompts))) as pool:

        async def submit(prompt: Sequence[int]) -> RequestTiming:
            return await asyncio.get_running_loop().run_in_executor(
                pool, request, prompt, max_tokens
            )

        return asyncio.run(drive(submit, prompts, load))


def level(row: dict) -> float:
    """The load a row ran at: its streams (closed loop) or its request rate (Poisson)."""
    return row["concurrency"] if row["arrival"] == Arrival.CLOSED else row["request_rate"]
