"""The span helpers every service calls; with tracing off each returns at once.

A `Spans` holds the process's tracer (common/runtime/tracing.py makes it) or none. Spans are
started and ended explicitly, never made the current span: a request's steps run in async
generators that yield across tasks, where a context attached in one place cannot be detached
in another. Parents are passed by hand: a span, or the remote context that `parent_from` reads
from a W3C `traceparent` (an HTTP request's headers, a gRPC call's metadata), and `metadata`
writes a span's `traceparent` for the next hop.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

Attributes = Mapping[str, AttributeValue]
Metadata = tuple[tuple[str, str], ...]
Parent = Span | Context | None

_W3C = TraceContextTextMapPropagator()
_OFF: AbstractContextManager[None] = nullcontext()


def wall_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as nanoseconds since the epoch (spans' clock)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


class Spans:
    def __init__(self, tracer: Tracer | None = None) -> None:
        self._tracer = tracer

    @property
    def on(self) -> bool:
        return self._tracer is not None

    def start(
        self,
        name: str,
        parent: Parent,
        attributes: Attributes | None = None,
        *,
        kind: SpanKind = SpanKind.INTERNAL,
        start_ns: int | None = None,
    ) -> Span | None:
        """A started span under `parent` (None: a new trace); None while tracing is off."""
        if self._tracer is None:
            return None
        context = trace.set_span_in_context(parent) if isinstance(parent, Span) else parent
        return self._tracer.start_span(name, context, kind, attributes, start_time=start_ns)

    def span(
        self,
        name: str,
        parent: Parent,
        attributes: Attributes | None = None,
        *,
        kind: SpanKind = SpanKind.INTERNAL,
    ) -> AbstractContextManager[Span | None]:
        """`start` ... `end` around a block; an exception leaving it is the span's error."""
        if self._tracer is None:
            return _OFF
        return self._block(name, parent, attributes, kind)

    @contextmanager
    def _block(
        self, name: str, parent: Parent, attributes: Attributes | None, kind: SpanKind
    ) -> Iterator[Span | None]:
        span = self.start(name, parent, attributes, kind=kind)
        try:
            yield span
        except BaseException as exc:
            end(span, error=exc)
            raise
        end(span)

    def interval(
        self, name: str, parent: Parent, start_ns: int, end_ns: int, attributes: Attributes
    ) -> None:
        """A span for something already over (measured elsewhere, e.g. on a worker thread)."""
        end(self.start(name, parent, attributes, start_ns=start_ns), end_ns=end_ns)

    def parent_from(self, carrier: Mapping[str, str] | Iterable[tuple[str, str]]) -> Parent:
        """The remote parent a W3C `traceparent` names (HTTP headers or gRPC metadata);
        None (a new trace) when there is none or tracing is off."""
        if self._tracer is None:
            return None
        headers = carrier if isinstance(carrier, Mapping) else dict(carrier)
        return _W3C.extract(headers) if "traceparent" in headers else None


def metadata(span: Span | None) -> Metadata:
    """`span`'s `traceparent` (and `tracestate`) as gRPC metadata; () without a span."""
    if span is None:
        return ()
    carrier: dict[str, str] = {}
    _W3C.inject(carrier, trace.set_span_in_context(span))
    return tuple(carrier.items())


def annotate(span: Span | None, attributes: Attributes) -> None:
    if span is not None:
        span.set_attributes(attributes)


def event(span: Span | None, name: str, attributes: Attributes | None = None) -> None:
    if span is not None:
        span.add_event(name, attributes)


def end(
    span: Span | None,
    attributes: Attributes | None = None,
    *,
    error: BaseException | None = None,
    end_ns: int | None = None,
) -> None:
    """End `span`; an Exception `error` is recorded on it (a cancellation or a consumer
    that went away is not an error)."""
    if span is None:
        return
    if attributes:
        span.set_attributes(attributes)
    if isinstance(error, Exception):
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, _message(error)))
    span.end(end_time=end_ns)


def _message(error: Exception) -> str:
    text = getattr(error, "message", None)
    return text if isinstance(text, str) else f"{type(error).__name__}: {error}"
