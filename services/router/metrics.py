"""The router's Prometheus metrics (prefix `tpla:`), held in a per-app CollectorRegistry so
several apps in one process (tests, `tpla serve`) never share or collide on counters."""

from __future__ import annotations

import enum

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Latency buckets in seconds: sub-millisecond inter-token gaps up to multi-minute requests.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Request sizes in tokens, powers of two: a performance profile is indexed by prompt length.
_LENGTH_BUCKETS = tuple(float(2**k) for k in range(18))  # 1 .. 131072


class Outcome(enum.Enum):
    FINISHED = "finished"
    FAILED = "failed"
    ABORTED = "aborted"
    REJECTED = "rejected"


class RouterMetrics:
    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self._model = model_name
        self.ttft = Histogram(
            "tpla:time_to_first_token_seconds",
            "Time from request arrival to the first token (prefill returned).",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "tpla:inter_token_latency_seconds",
            "Time between consecutive generated tokens.",
            labels,
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "tpla:e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            labels,
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "tpla:requests",
            "Requests by outcome.",
            [*labels, "outcome"],
            registry=self.registry,
        )
        self.running = Gauge(
            "tpla:num_requests_running",
            "Requests admitted by this router and not yet finished.",
            labels,
            registry=self.registry,
        )
        self.waiting = Gauge(
            "tpla:num_requests_waiting",
            "Requests waiting in this router for an in-flight slot.",
            labels,
            registry=self.registry,
        )
        self.migrations = Counter(
            "tpla:request_migrations",
            "Streams moved to another decode group after theirs failed.",
            labels,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "tpla:prompt_tokens", "Prompt tokens processed.", labels, registry=self.registry
        )
        self.generation_tokens = Counter(
            "tpla:generation_tokens", "Tokens generated.", labels, registry=self.registry
        )
        self.request_prompt_tokens = Histogram(
            "tpla:request_prompt_tokens",
            "Prompt length of each finished request, in tokens.",
            labels,
            buckets=_LENGTH_BUCKETS,
            registry=self.registry,
        )
        self.request_generation_tokens = Histogram(
            "tpla:request_generation_tokens",
            "Tokens generated for each finished request (all its choices).",
            labels,
            buckets=_LENGTH_BUCKETS,
            registry=self.registry,
        )
        self.queue = Histogram(
            "tpla:request_queue_seconds",
            "Time a request waited in this router for an in-flight slot (0: none).",
            labels,
            buckets=_QUEUE_BUCKETS,
            registry=self.registry,
        )
        self.errors = Counter(
            "tpla:request_errors",
            "Failed requests by error type (the OpenAI error body's `type`).",
            [*labels, "error_type"],
            registry=self.registry,
        )
        # Pre-create every series of the model (errors come by type) so that dashboards and the
        # autoscaler see zeros instead of missing series on an idle router.
        for outcome in Outcome:
            self.requests.labels(model_name, outcome.value)
        for metric in (
            self.ttft,
            self.itl,
            self.e2e,
            self.running,
            self.waiting,
            self.migrations,
            self.prompt_tokens,
            self.generation_tokens,
            self.request_prompt_tokens,
            self.request_generation_tokens,
            self.queue,
        ):
            metric.labels(model_name)

    def outcome(self, outcome: Outcome, error_type: str = "") -> None:
        """A request's end; `error_type` (the OpenAI error body's `type`) when it failed."""
        self.requests.labels(self._model, outcome.value).inc()
        if error_type:
            self.errors.labels(self._model, error_type).inc()

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.labels(self._model).observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self.itl.labels(self._model).observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        self.e2e.labels(self._model).observe(seconds)

    def finished(self, outcome: Outcome, prompt: int, generated: int, error_type: str = "") -> None:
        """A request that was admitted has ended: its outcome, its tokens and, when it finished,
        its sizes; `error_type` when it failed."""
        self.outcome(outcome, error_type)
        self.prompt_tokens.labels(self._model).inc(prompt)
        self.generation_tokens.labels(self._model).inc(generated)
        if outcome is Outcome.FINISHED:
            self.request_prompt_tokens.labels(self._model).observe(prompt)
            self.request_generation_tokens.labels(self._model).observe(generated)

    def observe_queue(self, seconds: float) -> None:
        self.queue.labels(self._model).observe(seconds)

    def set_load(self, running: int, waiting: int) -> None:
        self.running.labels(self._model).set(running)
        self.waiting.labels(self._model).set(waiting)

    def migrated(self) -> None:
        self.migrations.labels(self._model).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
