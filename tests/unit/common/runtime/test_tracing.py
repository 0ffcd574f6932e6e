"""Tracing's set-up from the OTEL_ variables: off when unset, the exporter the protocol names."""

from __future__ import annotations

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

from common.runtime import tracing
from common.runtime.tracing import TracingConfigError, protocol, setup_tracing, tracing_enabled


def test_off_unless_an_endpoint_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*tracing.ENDPOINT_VARIABLES, "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    assert not setup_tracing("tpla-router").on
    assert tracing_enabled({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert tracing_enabled({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"})
    assert not tracing_enabled({"OTEL_EXPORTER_OTLP_ENDPOINT": " "})
    assert not tracing_enabled(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"}
    )


def test_protocol_from_the_variables() -> None:
    assert protocol({}) == "http/protobuf"
    assert protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) == "grpc"
    both = {
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
    }
    assert protocol(both) == "http/protobuf"  # the traces-specific variable wins
    with pytest.raises(TracingConfigError, match="http/json"):
        protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


@pytest.mark.parametrize(("name", "exporter"), [("http/protobuf", Http), ("grpc", Grpc)])
def test_on_exports_with_the_protocols_exporter(
    monkeypatch: pytest.MonkeyPatch, name: str, exporter: type
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", name)
    assert isinstance(tracing._exporter(tracing.protocol(tracing.os.environ)), exporter)
    spans = setup_tracing("tpla-decode")
    assert spans.on
