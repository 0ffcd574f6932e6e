"""A service's gRPC server starts on its port or names it; its loading is metered and logged;
its serving loop (`serve`, both services') ends on a stop, a failure of its core or a drain,
with the exit code each calls for, and always closes the core and frees its ports."""

from __future__ import annotations

import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from prometheus_client import CollectorRegistry

from common.rpc.server import Lifetime, Service, loading, serve, start_serving, stop_on_signals
from common.rpc.status import Status
from common.runtime.load_meter import LoadMeter, current_meter
from common.runtime.ports import PortInUse, PortUse, free_port, port_in_use
from common.runtime.settings import load_settings

HOST = "127.0.0.1"


def _uses() -> tuple[PortUse, PortUse]:
    grpc_port, metrics_port = free_port(), free_port()
    return (
        PortUse(grpc_port, "the test's gRPC server", "TPLA_TEST_PORT"),
        PortUse(metrics_port, "the test's metrics", "TPLA_TEST_METRICS_PORT"),
    )


def test_the_grpc_server_starts_on_its_port() -> None:
    grpc_use, _ = _uses()
    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    start_serving(server, HOST, grpc_use)
    try:
        assert port_in_use(HOST, grpc_use.port)
    finally:
        server.stop(grace=0).wait()


def test_a_taken_grpc_port_is_named_and_nothing_is_left_listening() -> None:
    grpc_use, _ = _uses()
    holder = socket.socket()
    holder.bind((HOST, grpc_use.port))
    holder.listen()
    try:
        with pytest.raises(PortInUse, match="TPLA_TEST_PORT"):
            start_serving(grpc.server(ThreadPoolExecutor(max_workers=1)), HOST, grpc_use)
    finally:
        holder.close()
    assert not port_in_use(HOST, grpc_use.port)


def test_loading_meters_the_reads_logs_and_ends_loaded(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The block's reads count in the status's meter (the current one on this thread); at
    its end the meter says loaded and the log has one line of it."""
    status = Status.open(HOST, _uses()[1], CollectorRegistry(), LoadMeter(), "test service")
    try:
        with loading(status, Lifetime(), list):
            meter = current_meter()
            assert meter is status.meter
            meter.expect(4 * 2**30)
            meter.add(2**30)
            assert status.not_ready_reason() == (
                "test service loading: rank 0 1.00 GiB of ~4.00 GiB (25%)"
            )
        assert current_meter() is None and status.meter.done
        assert "test service loaded: rank 0 loaded (1.00 GiB)" in capsys.readouterr().out
    finally:
        status.stop()


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


class Core:
    """A service's core as the loop sees it: `inside` admitted calls, a failure to report."""

    def __init__(self, inside: int = 0) -> None:
        self.inside = inside
        self.admitting = True
        self.closed = 0
        self.error: BaseException | None = None

    def service(self, uses: tuple[PortUse, PortUse]) -> Service:
        return Service(
            name="test service",
            work="calls",
            server=grpc.server(ThreadPoolExecutor(max_workers=1)),
            host=HOST,
            grpc_port=uses[0],
            status=Status.open(HOST, uses[1], CollectorRegistry(), LoadMeter(), "test service"),
            records=list,
            failure=lambda: self.error,
            close_admission=self.close_admission,
            running=lambda: self.inside,
            close=self.close,
            poll_s=0.01,
        )

    def close_admission(self) -> None:
        self.admitting = False

    def close(self) -> None:
        self.closed += 1


def _serving(core: Core, **events: threading.Event) -> tuple[threading.Thread, list[int], int]:
    """`serve` in a thread (its exit code lands in the list once it returns), serving."""
    uses = _uses()
    ready, codes = threading.Event(), []
    life = Lifetime(drain_grace_s=30.0)
    thread = threading.Thread(
        target=lambda: codes.append(
            serve(core.service(uses), life, "test service up", ready=ready, **events)
        )
    )
    thread.start()
    assert ready.wait(10)
    return thread, codes, uses[0].port


def test_a_stop_ends_it_with_0(capsys: pytest.CaptureFixture[str]) -> None:
    core, stop = Core(), threading.Event()
    thread, codes, port = _serving(core, stop=stop)
    assert port_in_use(HOST, port)
    stop.set()
    thread.join(10)
    assert codes == [0] and core.closed == 1 and not port_in_use(HOST, port)
    assert "test service up" in capsys.readouterr().out


def test_a_failed_core_ends_it_with_1(capsys: pytest.CaptureFixture[str]) -> None:
    core = Core()
    thread, codes, port = _serving(core)
    core.error = RuntimeError("rank 1 died")
    thread.join(10)
    assert codes == [1] and core.closed == 1 and not port_in_use(HOST, port)
    assert "test service failed: rank 1 died; exiting" in capsys.readouterr().err


def test_a_drain_admits_nothing_new_and_waits_for_what_is_inside(
    capsys: pytest.CaptureFixture[str],
) -> None:
    core, drain = Core(inside=2), threading.Event()
    thread, codes, _ = _serving(core, drain=drain)
    drain.set()
    deadline = time.monotonic() + 10
    while core.admitting and time.monotonic() < deadline:
        time.sleep(0.01)
    thread.join(0.1)
    assert thread.is_alive() and not core.admitting  # two calls still inside
    core.inside = 0
    thread.join(10)
    assert codes == [0] and core.closed == 1
    out = capsys.readouterr().out
    assert "test service draining: 2 calls, up to 30 s" in out
    assert "test service drained" in out


def test_a_stop_ends_a_drain_and_a_failure_during_one_ends_it_with_1() -> None:
    core, drain, stop = Core(inside=1), threading.Event(), threading.Event()
    thread, codes, _ = _serving(core, drain=drain, stop=stop)
    drain.set()
    stop.set()
    thread.join(10)
    assert codes == [0] and core.closed == 1
    core, drain = Core(inside=1), threading.Event()
    thread, codes, _ = _serving(core, drain=drain)
    drain.set()
    thread.join(0.2)
    core.error = RuntimeError("rank 1 died")
    core.inside = 0
    thread.join(10)
    assert codes == [1]


def test_a_taken_port_closes_the_core() -> None:
    core = Core()
    uses = _uses()
    holder = socket.socket()
    holder.bind((HOST, uses[0].port))
    holder.listen()
    try:
        with pytest.raises(PortInUse, match="TPLA_TEST_PORT"):
            serve(core.service(uses), Lifetime(), "never printed")
    finally:
        holder.close()
    assert core.closed == 1


def test_the_lifetime_from_the_settings() -> None:
    s = load_settings(redis_url="redis://h:1", heartbeat_s=0.5, worker_ttl_s=3, drain_grace_s=4)
    assert Lifetime.from_settings(s) == Lifetime("redis://h:1", 0.5, 3.0, 4.0)
