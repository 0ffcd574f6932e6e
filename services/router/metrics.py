"""The router's Prometheus metrics (prefix `tpla:`), held in a per-app CollectorRegistry so
several apps in one process (tests, `tpla serve`) never share or collide on counters."""

from __future__ import annotations

import enum

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from services.router.disagg_policy import ROUTES

# Latency buckets in seconds: sub-millisecond inter-token gaps up to multi-minute requests.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Request sizes in tokens, powers of two: a performance profile is indexed by prompt length.
_LENGTH_BUCKETS = tuple(float(2**k) for k in range(18))  # 1 .. 131072
_LABELS = ["model_name"]


class Outcome(enum.Enum):
    FINISHED = "finished"
    FAILED = "failed"
    ABORTED = "aborted"
    REJECTED = "rejected"


class RouterMetrics:
    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self._model = model_name
        self.ttft = self._histogram(
            "tpla:time_to_first_token_seconds",
            "Time from request arrival to the first token (prefill returned).",
            _TTFT_BUCKETS,
        )
        self.itl = self._histogram(
            "tpla:inter_token_latency_seconds",
            "Time between consecutive generated tokens.",
            _ITL_BUCKETS,
        )
        self.e2e = self._histogram(
            "tpla:e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            _E2E_BUCKETS,
        )
        self.requests = Counter(
            "tpla:requests", "Requests by outcome.", [*_LABELS, "outcome"], registry=self.registry
        )
        self.running = self._gauge(
            "tpla:num_requests_running", "Requests admitted by this router and not yet finished."
        )
        self.waiting = self._gauge(
            "tpla:num_requests_waiting", "Requests waiting in this router for an in-flight slot."
        )
        self.migrations = self._counter(
            "tpla:request_migrations", "Streams moved to another decode group after theirs failed."
        )
        self.prompt_tokens = self._counter("tpla:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = self._counter("tpla:generation_tokens", "Tokens generated.")
        self.request_prompt_tokens = self._histogram(
            "tpla:request_prompt_tokens",
            "Prompt length of each finished request, in tokens.",
            _LENGTH_BUCKETS,
        )
        self.request_generation_tokens = self._histogram(
            "tpla:request_generation_tokens",
            "Tokens generated for each finished request (all its choices).",
            _LENGTH_BUCKETS,
        )
        self.queue = self._histogram(
            "tpla:request_queue_seconds",
            "Time a request waited in this router for an in-flight slot (0: none).",
            _QUEUE_BUCKETS,
        )
        self.errors = Counter(
            "tpla:request_errors",
            "Failed requests by error type (the OpenAI error body's `type`).",
            [*_LABELS, "error_type"],
            registry=self.registry,
        )
        self.prefill_routes = Counter(
            "tpla:prefill_route",
            "Prompts by where they were prefilled (local: by their decode group; remote: by a "
            "prefill worker) and why (services/router/disagg_policy.py).",
            [*_LABELS, "route", "reason"],
            registry=self.registry,
        )
        self.prefill_degraded = self._gauge(
            "tpla:prefill_degraded",
            "1 while no prefill worker can be used (none healthy, or the prefill circuit "
            "open) and the decode groups prefill every prompt.",
        )
        # Every series of the model exists from the start (errors come by type), so that
        # dashboards and the autoscaler see zeros instead of missing series on an idle router.
        for outcome in Outcome:
            self.requests.labels(model_name, outcome.value)
        for route, reason in ROUTES:
            self.prefill_routes.labels(model_name, route.value, reason.value)

    # The metrics labelled by the model alone, their series created with them.
    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        metric = Histogram(name, doc, _LABELS, buckets=buckets, registry=self.registry)
        metric.labels(self._model)
        return metric

    def _counter(self, name: str, doc: str) -> Counter:
        metric = Counter(name, doc, _LABELS, registry=self.registry)
        metric.labels(self._model)
        return metric

    def _gauge(self, name: str, doc: str) -> Gauge:
        metric = Gauge(name, doc, _LABELS, registry=self.registry)
        metric.labels(self._model)
        return metric

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

    def prefill_routed(self, route: str, reason: str) -> None:
        self.prefill_routes.labels(self._model, route, reason).inc()

    def set_degraded(self, degraded: bool) -> None:
        self.prefill_degraded.labels(self._model).set(int(degraded))

    def migrated(self) -> None:
        self.migrations.labels(self._model).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
