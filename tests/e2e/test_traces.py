"""One chat completion through `tpla serve` is one trace across its three services.

A real OTLP receiver (tests/otlp_receiver.py) takes what the services export over
http/protobuf; the client sends its own W3C traceparent, so every span must land under the
client's trace id with the parent links the request took: router -> prefill worker and
router -> decode leader. With the OTEL_ variables unset, a receiver on the default OTLP/HTTP
endpoint gets nothing.
"""

from __future__ import annotations

import errno
import os
import secrets
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.otlp_receiver import ReceivedSpan, otlp_receiver
from tests.stack import MODEL_NAME, start_stack

ROUTER_SPANS = {"request", "queue", "placement", "prefill", "ttft", "decode"}
SERVICE_SPANS = {"reserve", "generate", "prefill.batch", "kv.transfer"}


def _chat(url: str, headers: dict[str, str]) -> dict:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hello traces"}],
        "max_tokens": 4,
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _one(spans: list[ReceivedSpan], name: str, service: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name and s.service == service]
    assert len(found) == 1, (name, service, found)
    return found[0]


def test_one_request_is_one_trace_across_the_services(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with otlp_receiver() as (receiver, port):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_always_on")
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export within the test
        stack = start_stack(tiny_model, "grpc")
        try:
            trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
            answer = _chat(stack.url, {"traceparent": f"00-{trace_id}-{client_span}-01"})
            spans = receiver.wait_for(trace_id, ROUTER_SPANS | SERVICE_SPANS)
        finally:
            stack.stop()
    assert {s.service for s in spans} == {"tpla-router", "tpla-prefill", "tpla-decode"}
    assert not any(s.error for s in spans), [s for s in spans if s.error]

    request = _one(spans, "request", "tpla-router")
    assert request.parent_id == client_span
    assert request.attributes["gen_ai.request.model"] == MODEL_NAME
    assert request.attributes["tpla.prompt_tokens"] == answer["usage"]["prompt_tokens"]
    assert request.attributes["tpla.n"] == 1
    assert request.attributes["tpla.finish_reasons"] == (answer["choices"][0]["finish_reason"],)
    assert "tpla.cached_tokens" in request.attributes
    router = {name: _one(spans, name, "tpla-router") for name in ROUTER_SPANS - {"request"}}
    for span in router.values():
        assert span.parent_id == request.span_id, span
    assert router["decode"].attributes["tpla.tokens"] >= 1

    reserve = _one(spans, "reserve", "tpla-decode")
    assert reserve.parent_id == router["placement"].span_id
    generate = _one(spans, "generate", "tpla-decode")
    assert generate.parent_id == router["decode"].span_id
    assert generate.attributes["tpla.tokens"] == router["decode"].attributes["tpla.tokens"]

    prefill = _one(spans, "prefill", "tpla-prefill")
    assert prefill.parent_id == router["prefill"].span_id
    batch = _one(spans, "prefill.batch", "tpla-prefill")
    assert batch.parent_id == prefill.span_id
    assert batch.attributes["tpla.computed_tokens"] == answer["usage"]["prompt_tokens"]
    transfers = [s for s in spans if s.name == "kv.transfer"]
    assert sorted(s.attributes["tpla.rank"] for s in transfers) == [0, 1]  # tp = 2
    for span in transfers:
        assert span.parent_id == prefill.span_id
        assert span.attributes["tpla.bytes"] > 0


def _default_endpoint_free() -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", 4318))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def test_nothing_is_exported_with_the_variables_unset(tiny_model: Path) -> None:
    """A receiver where the exporter would send by default (localhost:4318) gets nothing."""
    assert not any(k.startswith("OTEL_EXPORTER_OTLP") for k in os.environ)
    if not _default_endpoint_free():
        pytest.skip("the default OTLP/HTTP port 4318 is taken on this machine")
    with otlp_receiver(4318) as (receiver, _):
        stack = start_stack(tiny_model, "grpc")
        try:
            _chat(stack.url, {"traceparent": f"00-{secrets.token_hex(16)}-{'1' * 16}-01"})
            time.sleep(1.0)  # past any batch exporter's schedule delay
        finally:
            stack.stop()
    assert receiver.posts == 0
