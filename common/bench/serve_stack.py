"""The real `tpla serve` stack for `tpla bench serve`, and the HTTP client load against it.

The stack runs exactly as a user starts it (embedded redis-server, decode group, prefill
worker, router), through the project's one local-stack launcher (`services/local_stack.py`:
free loopback ports, SIGINT on stop, SIGKILL after a grace period); only settings select the
configuration. Requests go through the OpenAI API with streaming, so TTFT and TPOT are what
a client sees.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

from common.bench.stats import RequestTiming

REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class StackConfig:
    name: str
    latent_groups: int
    reparam: str  # "" : identity basis (MLA-TP needs none)
    tp: int = 2
    transport: str = "grpc"
    served_name: str = "bench"
    prefill_workers: int = 1

    def settings(self) -> dict[str, str]:
        """TPLA_<KEY> values for the launcher."""
        return {
            "SERVED_MODEL_NAME": self.served_name,
            "PREFILL_WORKERS": str(self.prefill_workers),
            "TP": str(self.tp),
            "LATENT_GROUPS": str(self.latent_groups),
            "REPARAM": self.reparam,
            "TRANSPORT": self.transport,
            "MAX_INFLIGHT": "256",
            # The bounded waits (30 s by default) fail requests queued behind more prefill
            # work than that, as a long-prompt level at high concurrency is on this CPU;
            # raised so overload shows up as latency in the measurement, not as failures.
            "LEASE_SECONDS": "300",
            "QUEUE_TIMEOUT_S": "300",
            "TOKEN_TIMEOUT_S": "300",
        }


@contextmanager
def running_stack(cfg: StackConfig, model: str) -> Iterator[str]:
    """Start `tpla serve` for `cfg`; yields the router URL; stops the stack on exit."""
    from services.local_stack import LocalStack

    with LocalStack.start(model, **cfg.settings()) as stack:
        yield stack.url


async def stream_completion(
    client: httpx.AsyncClient, url: str, model: str, prompt: Sequence[int], max_tokens: int
) -> RequestTiming:
    """One streamed /v1/completions request with exactly `max_tokens` outputs (ignore_eos)."""
    body = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first: float | None = None
    tokens = 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(str(chunk["error"])[:200])
                if first is None and chunk.get("choices"):
                    first = time.perf_counter()
                if chunk.get("usage"):
                    tokens = int(chunk["usage"]["completion_tokens"])
    except (httpx.HTTPError, RuntimeError, ValueError) as exc:
        elapsed = time.perf_counter() - t0
        return RequestTiming(elapsed, elapsed, tokens, max_tokens, f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    return RequestTiming((first or end) - t0, end - t0, tokens, max_tokens)


async def _drive(
    url: str, model: str, prompts: Sequence[Sequence[int]], max_tokens: int, concurrency: int
) -> tuple[list[RequestTiming], float]:
    pending = list(enumerate(prompts))
    results: list[RequestTiming | None] = [None] * len(prompts)
    limits = httpx.Limits(max_connections=concurrency + 4)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def worker() -> None:
            # A closed loop: each of `concurrency` clients sends its next request as soon as
            # the previous one finishes, so the server always holds `concurrency` streams.
            while pending:
                i, prompt = pending.pop(0)
                results[i] = await stream_completion(client, url, model, prompt, max_tokens)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return [r for r in results if r is not None], wall


def drive_http(
    url: str, model: str, prompts: Sequence[Sequence[int]], max_tokens: int, concurrency: int
) -> tuple[list[RequestTiming], float]:
    """Closed-loop load of `concurrency` streaming clients over `prompts`."""
    return asyncio.run(_drive(url, model, prompts, max_tokens, concurrency))
