"""A service process's serving life: its servers (gRPC, metrics) up on checked ports, down on
a signal."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

import grpc

from common.runtime.ports import PortUse, bind_grpc, check_ports


def start_serving(
    server: grpc.Server,
    host: str,
    grpc_use: PortUse,
    metrics_use: PortUse,
    serve_metrics: Callable[[int], None],
) -> None:
    """Bind and start `server`, then its metrics endpoint (`serve_metrics(port)`). If either
    fails the server is stopped and the error raised: a taken port as PortInUse, named with
    the setting that moves it."""
    try:
        bind_grpc(server, host, grpc_use)
        server.start()
        try:
            serve_metrics(metrics_use.port)
        except OSError:
            check_ports(host, [metrics_use])
            raise
    except BaseException:
        server.stop(grace=0)
        raise


def stop_on_signals(stop: threading.Event) -> None:
    """SIGINT and SIGTERM set `stop` (the serving loop then drains and exits). Only the main
    thread can install handlers: a service run in a thread (the tests) is stopped by `stop`."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
