"""A channel with the project's options reaches a server restarted on the same address within
about a second, however long the address was down (gRPC's default reconnect backoff grows to
minutes and fails every call meanwhile)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from common.rpc.clients import CHANNEL_OPTIONS
from common.runtime.ports import free_port

METHOD = "/tpla.test.Echo/Call"


def _server(address: str) -> grpc.Server:
    def call(request: bytes, context: grpc.ServicerContext) -> bytes:
        return request

    handler = grpc.unary_unary_rpc_method_handler(call)
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("tpla.test.Echo", {"Call": handler}),)
    )
    assert server.add_insecure_port(address) != 0
    server.start()
    return server


def test_a_restarted_server_is_reached_within_a_second() -> None:
    address = f"127.0.0.1:{free_port()}"
    server = _server(address)
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        call = channel.unary_unary(METHOD)
        assert call(b"up", timeout=5) == b"up"
        server.stop(grace=None).wait()
        # Down for 6 s of calls: with the default backoff the channel would now wait several
        # seconds before its next connect attempt.
        failures = 0
        down_until = time.monotonic() + 6
        while time.monotonic() < down_until:
            try:
                call(b"x", timeout=1)
            except grpc.RpcError as exc:
                assert exc.code() in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                )
                failures += 1
            time.sleep(0.1)
        assert failures > 0
        server = _server(address)
        try:
            back = time.monotonic()
            deadline = back + 10
            while True:
                try:
                    assert call(b"back", timeout=1) == b"back"
                    break
                except grpc.RpcError:
                    assert time.monotonic() < deadline, "never reconnected"
                    time.sleep(0.05)
            assert time.monotonic() - back < 2.0
        finally:
            server.stop(grace=None)
