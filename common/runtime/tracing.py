"""Tracing's set-up from the standard OpenTelemetry environment variables, once per service.

Off unless `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT` is set (and
`OTEL_SDK_DISABLED` is not true): the service's `Spans` then do nothing. On, a tracer provider
with resource `service.name` (tpla-router, tpla-prefill, tpla-decode) exports its spans in
batches over OTLP, `http/protobuf` (the default) or `grpc` as
`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` / `OTEL_EXPORTER_OTLP_PROTOCOL` say. The SDK reads the
rest of the standard variables itself: `OTEL_TRACES_SAMPLER` (and its argument), the
exporter's headers and timeouts, `OTEL_BSP_*`, `OTEL_RESOURCE_ATTRIBUTES`. The provider is
the service's own (never the process-wide global one), and flushes at exit.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

from common.runtime.spans import Spans

PROTOCOLS = ("http/protobuf", "grpc")
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


class TracingConfigError(ValueError):
    """The OTEL_ variables ask for something this service cannot export."""


def tracing_enabled(environ: Mapping[str, str]) -> bool:
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return any(environ.get(name, "").strip() for name in ENDPOINT_VARIABLES)


def protocol(environ: Mapping[str, str]) -> str:
    """The OTLP protocol the variables name; TracingConfigError for one not supported."""
    chosen = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if chosen not in PROTOCOLS:
        raise TracingConfigError(
            f"OTLP protocol {chosen!r} is not supported for traces: "
            f"set OTEL_EXPORTER_OTLP_PROTOCOL to one of {', '.join(PROTOCOLS)}"
        )
    return chosen


def setup_tracing(service_name: str) -> Spans:
    """The service's Spans: exporting over OTLP when the process's variables switch tracing
    on, else off. TracingConfigError for an unsupported protocol, before anything starts."""
    if not tracing_enabled(os.environ):
        return Spans()
    exporter = _exporter(protocol(os.environ))
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return Spans(provider.get_tracer("tpla-serve"))


def _exporter(chosen: str) -> SpanExporter:
    # Both read the endpoint, headers, timeout and compression from the environment.
    if chosen == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter()
