"""The span helpers: parents passed by hand, traceparent round trips, errors, and off."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from common.runtime.errors import Unavailable
from common.runtime.spans import Spans, end, event, metadata


def _spans() -> tuple[Spans, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Spans(provider.get_tracer("test")), exporter


def test_off_does_nothing() -> None:
    spans = Spans()
    assert not spans.on
    assert spans.start("x", None) is None
    with spans.span("x", None) as span:
        assert span is None
    assert metadata(None) == ()
    assert spans.parent_from({"traceparent": f"00-{'a' * 32}-{'b' * 16}-01"}) is None
    end(None, {"a": 1}, error=ValueError())
    event(None, "e")


def test_traceparent_round_trip_keeps_the_trace_and_the_parent() -> None:
    spans, exporter = _spans()
    client = f"00-{'ab' * 16}-{'cd' * 8}-01"
    root = spans.start("request", spans.parent_from({"traceparent": client}))
    child = spans.start("prefill", root)
    carried = dict(metadata(child))
    remote = spans.start("server", spans.parent_from(tuple(carried.items())))
    for span in (remote, child, root):
        end(span)
    got = {s.name: s for s in exporter.get_finished_spans()}
    assert {s.context.trace_id for s in got.values()} == {int("ab" * 16, 16)}
    assert got["request"].parent.span_id == int("cd" * 8, 16)
    assert got["request"].parent.is_remote
    assert got["prefill"].parent.span_id == got["request"].context.span_id
    assert got["server"].parent.span_id == got["prefill"].context.span_id


def test_errors_are_recorded_and_cancellations_are_not() -> None:
    spans, exporter = _spans()
    try:
        with spans.span("failing", None):
            raise Unavailable("decode group gone")
    except Unavailable:
        pass
    end(spans.start("cancelled", None), error=GeneratorExit())
    got = {s.name: s for s in exporter.get_finished_spans()}
    assert got["failing"].status.status_code is StatusCode.ERROR
    assert got["failing"].status.description == "decode group gone"
    assert got["failing"].events[0].name == "exception"
    assert got["cancelled"].status.status_code is StatusCode.UNSET


def test_interval_keeps_its_times() -> None:
    spans, exporter = _spans()
    spans.interval("ttft", None, 1_000, 5_000, {"tpla.bytes": 3})
    (span,) = exporter.get_finished_spans()
    assert (span.start_time, span.end_time) == (1_000, 5_000)
    assert span.attributes["tpla.bytes"] == 3
