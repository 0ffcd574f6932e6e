"""A service process's serving life: its servers (gRPC, metrics) up on checked ports, down on
a signal (drained first on SIGTERM where the service drains)."""

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
        # stop() only starts the shutdown: wait for it, so the port is free when this raises.
        server.stop(grace=0).wait(timeout=5)
        raise


def stop_on_signals(stop: threading.Event, drain: threading.Event | None = None) -> None:
    """SIGINT and SIGTERM set `stop` (the serving loop then ends). With `drain`, a first
    SIGTERM (what Kubernetes sends a pod it scales in) sets `drain` instead: the service takes
    no new work and ends once its work is done (common/rpc/drain.py); SIGINT, or another
    SIGTERM, still sets `stop`. Only the main thread can install handlers: a service run in a
    thread (the tests) is stopped by `stop` and drained by `drain`."""
    if threading.current_thread() is not threading.main_thread():
        return

    def on_signal(sig: int, _: object) -> None:
        if drain is not None and sig == signal.SIGTERM and not drain.is_set():
            drain.set()
        else:
            stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
