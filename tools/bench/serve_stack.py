"""The real `tpla serve` stack for `tpla bench serve`, and the HTTP client load against it.

The stack runs exactly as a user starts it (embedded redis-server, decode group, prefill
worker, router), through the project's one local-stack launcher (`tools/local_stack.py`:
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

from tools.bench.load import Load, drive
from tools.bench.stats import RequestTiming, gaps

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
    speculative: str = "none"  # TPLA_SPECULATIVE of its decode group
    spec_tokens: int | None = None  # its TPLA_SPEC_TOKENS (None: the setting's default)
    disagg_policy: str = "always"  # its router's TPLA_DISAGG_POLICY

    def settings(self) -> dict[str, str]:
        """TPLA_<KEY> values for the launcher."""
        return {
            "SERVED_MODEL_NAME": self.served_name,
            "PREFILL_WORKERS": str(self.prefill_workers),
            "TP": str(self.tp),
            "LATENT_GROUPS": str(self.latent_groups),
            "REPARAM": self.reparam,
            "TRANSPORT": self.transport,
            "SPECULATIVE": self.speculative,
            "DISAGG_POLICY": self.disagg_policy,
            **({"SPEC_TOKENS": str(self.spec_tokens)} if self.spec_tokens else {}),
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
    from tools.local_stack import LocalStack

    with LocalStack.start(model, **cfg.settings()) as stack:
        yield stack.url


def spec_counts(url: str) -> tuple[float, float]:
    """The stack's decode leader's drafts fed and kept so far (its metrics endpoint)."""
    from prometheus_client.parser import text_string_to_metric_families

    from common.runtime.ports import METRICS_PORT_OFFSET

    workers = httpx.get(f"{url}/admin/workers", timeout=10).json()
    leader = next(w for w in workers if w["role"] == "decode" and w["rank"] == 0)
    host, port = leader["address"].rsplit(":", 1)
    text = httpx.get(f"http://{host}:{int(port) + METRICS_PORT_OFFSET}/metrics", timeout=10).text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return values["tpla:spec_draft_tokens_total"], values["tpla:spec_accepted_tokens_total"]


@dataclass(frozen=True)
class Streamed:
    """One streamed completion as the client saw it."""

    timing: RequestTiming
    text: str = ""
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens
    request_id: str = ""  # the router's id: its record is /admin/requests/<id>


async def stream_completion(
    client: httpx.AsyncClient, url: str, model: str, prompt: Sequence[int], max_tokens: int
) -> Streamed:
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
    chunks: list[float] = []  # arrival of each chunk that carries output text
    text: list[str] = []
    tokens = cached = 0
    request_id = ""
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
                request_id = chunk.get("id", request_id)
                choices = chunk.get("choices")
                if choices and choices[0].get("finish_reason") is None:
                    chunks.append(time.perf_counter())
                    text.append(choices[0].get("text", ""))
                if usage := chunk.get("usage"):
                    tokens = int(usage["completion_tokens"])
                    details = usage.get("prompt_tokens_details") or {}
                    cached = int(details.get("cached_tokens", 0))
    except (httpx.HTTPError, RuntimeError, ValueError) as exc:
        elapsed = time.perf_counter() - t0
        error = f"{type(exc).__name__}: {exc}"
        return Streamed(RequestTiming(elapsed, elapsed, tokens, max_tokens, error))
    end = time.perf_counter()
    first = chunks[0] if chunks else end
    timing = RequestTiming(first - t0, end - t0, tokens, max_tokens, itl_s=gaps(chunks))
    return Streamed(timing, "".join(text), cached, request_id)


def drive_http(
    url: str, model: str, prompts: Sequence[Sequence[int]], max_tokens: int, load: Load
) -> tuple[list[RequestTiming], float]:
    """`prompts` as streaming requests to the stack at `url`, under `load`."""

    async def run() -> tuple[list[RequestTiming], float]:
        limits = httpx.Limits(max_connections=load.max_in_flight(len(prompts)) + 4)
        async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(REQUEST_TIMEOUT_S)) as c:

            async def one(prompt: Sequence[int]) -> RequestTiming:
                return (await stream_completion(c, url, model, prompt, max_tokens)).timing

            return await drive(one, prompts, load)

    return asyncio.run(run())
