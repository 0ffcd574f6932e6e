"""A service's serving life: its HTTP status port open before it loads, its gRPC server up
once loaded, its records published, down on a signal (drained first on SIGTERM where the
service drains).

Lifecycle: open the status port (common/rpc/status.py: /metrics, /ready) -> load the core
(`loading`: each rank's progress in the log every LOG_EVERY_S, on /ready and the metrics, and
a registry record that says so) -> `serve`: bind and start the gRPC server -> publish the
registry records with heartbeats -> serve until SIGINT / SIGTERM, `stop`, a failure of the
core (exit code 1: its supervisor restarts it) or `drain` -> on a drain: report itself
draining, admit nothing new, wait for the admitted work for at most the drain grace -> stop
the servers, deregister, close the core. The decode leader and the prefill worker both live
this way; each hands `serve` its core as a `Service`.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import grpc
import redis

from common.rpc.drain import wait_drained
from common.rpc.status import Status
from common.runtime.load_meter import metering
from common.runtime.ports import PortUse, bind_grpc
from common.runtime.redis_state import Heartbeat, WorkerRecord, WorkerRegistry, sync_client
from common.runtime.settings import Settings

# While a service loads, its log gets each rank's progress this often.
LOG_EVERY_S = 10.0


@dataclass(frozen=True)
class Lifetime:
    """How a service lives among the others: where it publishes its records (None: nowhere),
    how often, how long a record outlives a silent service, how long a drain may take."""

    redis_url: str | None = None
    heartbeat_s: float = 2.0
    worker_ttl_s: float = 10.0
    drain_grace_s: float = 25.0

    @classmethod
    def from_settings(cls, s: Settings) -> Lifetime:
        return cls(s.redis_url, s.heartbeat_s, s.worker_ttl_s, s.drain_grace_s)


@dataclass(frozen=True)
class Service:
    """A service's core as `serve` runs it: its gRPC server (its servicer added, not started)
    and what the serving loop asks of the core."""

    name: str  # its log lines' subject: "decode leader", "prefill worker"
    work: str  # what its admitted work is called in them: "live requests", "prefills ..."
    server: grpc.Server
    host: str
    grpc_port: PortUse
    status: Status  # its HTTP port, open since before it loaded
    records: Callable[[], Iterable[WorkerRecord]]  # what each heartbeat publishes
    failure: Callable[[], BaseException | None]  # why it can serve no more; checked each poll
    close_admission: Callable[[], object]  # a drain begins: nothing new is admitted
    running: Callable[[], int | None]  # admitted work not ended yet (None: not known now)
    close: Callable[[], None]  # the end: release what the core holds
    poll_s: float = 0.1  # how often the loop looks at the core


def start_serving(server: grpc.Server, host: str, grpc_use: PortUse) -> None:
    """Bind and start `server`; if that fails it is stopped and the error raised: a taken port
    as PortInUse, named with the setting that moves it."""
    try:
        bind_grpc(server, host, grpc_use)
        server.start()
    except BaseException:
        # stop() only starts the shutdown: wait for it, so the port is free when this raises.
        server.stop(grace=0).wait(timeout=5)
        raise


@contextlib.contextmanager
def loading(
    status: Status, life: Lifetime, records: Callable[[], Iterable[WorkerRecord]]
) -> Iterator[None]:
    """While the block loads the service's core (on this thread, its reads metered by the
    status's meter): every LOG_EVERY_S a line of each rank's progress, and `records` (the
    service saying it loads, unhealthy) published with heartbeats; they go when it ends."""
    heartbeat = None
    if life.redis_url:
        registry = WorkerRegistry(sync_client(life.redis_url), ttl_s=life.worker_ttl_s)
        heartbeat = Heartbeat(registry, records, life.heartbeat_s)
        with contextlib.suppress(redis.RedisError, OSError):  # Redis down: load anyway
            heartbeat.start()
    done = threading.Event()

    def log() -> None:
        while not done.wait(LOG_EVERY_S):
            if (reason := status.not_ready_reason()) is not None:
                print(reason, flush=True)

    threading.Thread(target=log, name="loading-log", daemon=True).start()
    try:
        with metering(status.meter):
            yield
        status.meter.finish()  # a group's leader did at its barrier; a worker of one here
        print(f"{status.name} loaded: {status.meter.summary()}", flush=True)
    finally:
        done.set()
        if heartbeat is not None:
            with contextlib.suppress(redis.RedisError, OSError):
                heartbeat.stop()


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


def serve(
    service: Service,
    life: Lifetime,
    banner: str,
    *,
    ready: threading.Event | None = None,
    stop: threading.Event | None = None,
    drain: threading.Event | None = None,
) -> int:
    """Run `service` until SIGINT/SIGTERM (or `stop`, or `drain` and its drain); blocks. Prints
    `banner` once serving, then sets `ready`. The exit code: 0 after a requested stop or a
    drain, 1 when the core failed. A taken port raises PortInUse, the core closed."""
    try:
        start_serving(service.server, service.host, service.grpc_port)
    except BaseException:
        service.close()
        service.status.stop()
        raise
    service.status.serving()
    stop = stop or threading.Event()
    drain = drain or threading.Event()
    heartbeat = None
    if life.redis_url:
        registry = WorkerRegistry(sync_client(life.redis_url), ttl_s=life.worker_ttl_s)
        heartbeat = Heartbeat(registry, service.records, life.heartbeat_s).start()
    stop_on_signals(stop, drain)
    print(banner, flush=True)
    if ready is not None:
        ready.set()
    try:
        return _serve_until_told(service, heartbeat, life.drain_grace_s, stop, drain)
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        service.server.stop(grace=2)
        service.close()
        service.status.stop()


def _serve_until_told(
    service: Service,
    heartbeat: Heartbeat | None,
    grace_s: float,
    stop: threading.Event,
    drain: threading.Event,
) -> int:
    """Watch the core until `stop`, its failure or `drain`; the exit code."""
    while not stop.wait(service.poll_s):
        if (failed := service.failure()) is not None:
            # Unhealthy in the registry at once, then gone: its supervisor restarts it.
            if heartbeat is not None:
                heartbeat.beat_now()
            print(f"{service.name} failed: {failed}; exiting", file=sys.stderr, flush=True)
            return 1
        if drain.is_set():
            return _drain(service, heartbeat, grace_s, stop)
    return 0


def _drain(
    service: Service, heartbeat: Heartbeat | None, grace_s: float, stop: threading.Event
) -> int:
    """Admit nothing more and wait (up to `grace_s`, or until `stop`) for the admitted work
    to end: a router tries elsewhere what is turned away, and moves what is left at the end.
    The exit code: 1 if the core failed meanwhile."""
    service.close_admission()
    if heartbeat is not None:
        heartbeat.beat_now()  # the routers' next refresh sees the service draining
    name, work = service.name, service.work
    print(f"{name} draining: {service.running()} {work}, up to {grace_s:g} s", flush=True)
    drained = wait_drained(lambda: service.running() == 0, grace_s, stop)
    if (failed := service.failure()) is not None:
        print(f"{name} failed while draining: {failed}", file=sys.stderr, flush=True)
        return 1
    if drained:
        print(f"{name} drained", flush=True)
    else:
        print(f"{name}: ending {service.running()} {work}", flush=True)
    return 0
