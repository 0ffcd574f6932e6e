"""A service's gRPC server and metrics endpoint start together or not at all."""

from __future__ import annotations

import signal
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from common.rpc.server import start_serving, stop_on_signals
from common.runtime.ports import PortInUse, PortUse, free_port, port_in_use

HOST = "127.0.0.1"


def _uses() -> tuple[PortUse, PortUse]:
    grpc_port, metrics_port = free_port(), free_port()
    return (
        PortUse(grpc_port, "the test's gRPC server", "TPLA_TEST_PORT"),
        PortUse(metrics_port, "the test's metrics", "TPLA_TEST_METRICS_PORT"),
    )


def test_both_start() -> None:
    grpc_use, metrics_use = _uses()
    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    served: list[int] = []
    start_serving(server, HOST, grpc_use, metrics_use, served.append)
    try:
        assert served == [metrics_use.port]
        assert port_in_use(HOST, grpc_use.port)
    finally:
        server.stop(grace=0).wait()


def test_a_taken_metrics_port_stops_the_server_and_names_its_setting() -> None:
    grpc_use, metrics_use = _uses()
    holder = socket.socket()
    holder.bind((HOST, metrics_use.port))
    holder.listen()

    def serve_metrics(port: int) -> None:
        with socket.socket() as s:
            s.bind((HOST, port))  # OSError: the port is held

    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    try:
        with pytest.raises(PortInUse, match="TPLA_TEST_METRICS_PORT"):
            start_serving(server, HOST, grpc_use, metrics_use, serve_metrics)
    finally:
        holder.close()
    # The gRPC server bound its port, then was stopped: nothing is left listening.
    assert not port_in_use(HOST, grpc_use.port)


def test_a_taken_grpc_port_serves_no_metrics() -> None:
    grpc_use, metrics_use = _uses()
    holder = socket.socket()
    holder.bind((HOST, grpc_use.port))
    holder.listen()
    served: list[int] = []
    try:
        with pytest.raises(PortInUse, match="TPLA_TEST_PORT"):
            start_serving(
                grpc.server(ThreadPoolExecutor(max_workers=1)),
                HOST,
                grpc_use,
                metrics_use,
                served.append,
            )
    finally:
        holder.close()
    assert served == []


def test_signals_are_left_alone_off_the_main_thread() -> None:
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            stop_on_signals(stop)  # signal.signal would raise ValueError off the main thread
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert errors == [] and not stop.is_set()


def test_a_first_sigterm_drains_a_second_stops() -> None:
    """SIGTERM (a pod's stop) sets `drain`; SIGINT, or SIGTERM again, sets `stop`. Without
    `drain` both stop at once."""
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        stop, drain = threading.Event(), threading.Event()
        stop_on_signals(stop, drain)
        signal.raise_signal(signal.SIGTERM)
        assert drain.is_set() and not stop.is_set()
        signal.raise_signal(signal.SIGTERM)
        assert stop.is_set()
        stop, drain = threading.Event(), threading.Event()
        stop_on_signals(stop, drain)
        signal.raise_signal(signal.SIGINT)
        assert stop.is_set() and not drain.is_set()
        stop = threading.Event()
        stop_on_signals(stop)
        signal.raise_signal(signal.SIGTERM)
        assert stop.is_set()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
