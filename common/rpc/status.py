"""A worker's HTTP port (its gRPC port + METRICS_PORT_OFFSET), open from before it loads:
`/metrics` (its Prometheus registry, with every rank's loading progress) and `/ready` (503
with the reason while it loads, each rank's bytes read of its share; 200 once it serves).

Lifecycle: `Status.open` binds the port before the service loads its model -> `serving()`
once its gRPC port is up -> `stop()`. An operator (or a probe) sees a slow rank while a group
loads, not a silent wait.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from common.runtime.load_meter import LoadMeter
from common.runtime.ports import PortUse, check_ports

LOADING_HELP = {
    "tpla:loading_read_bytes": "checkpoint bytes each rank has read of its share",
    "tpla:loading_share_bytes": "each rank's share of the checkpoint, estimated before reading",
    "tpla:loading_done": "1 once each rank has loaded its share",
}


class LoadingCollector(Collector):
    """Each rank's loading, read from the meter at scrape time."""

    def __init__(self, meter: LoadMeter) -> None:
        self.meter = meter

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            ranks = self.meter.ranks()
        except Exception:  # a group's store gone: nothing rather than a 500
            return
        fields = ("read", "total", "done")
        for (name, help_text), field in zip(LOADING_HELP.items(), fields, strict=True):
            family = GaugeMetricFamily(name, help_text, labels=["rank"])
            for r in ranks:
                family.add_metric([str(r.rank)], float(getattr(r, field)))
            yield family


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """Scrapes and probes are not news."""


class _Threaded(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class Status:
    """The HTTP endpoint; `open` binds it."""

    def __init__(self, registry: CollectorRegistry, meter: LoadMeter, name: str) -> None:
        self.registry, self.meter, self.name = registry, meter, name
        registry.register(LoadingCollector(meter))
        self._metrics = make_wsgi_app(registry)
        self._serving = threading.Event()
        self._server: WSGIServer | None = None

    @classmethod
    def open(
        cls, host: str, use: PortUse, registry: CollectorRegistry, meter: LoadMeter, name: str
    ) -> Status:
        """Bind `use`'s port on `host` and serve in a thread; PortInUse, named with its
        setting, if it is taken."""
        status = cls(registry, meter, name)
        try:
            server = make_server(host, use.port, status._app, _Threaded, handler_class=_Quiet)
        except OSError:
            check_ports(host, [use])
            raise
        status._server = server
        threading.Thread(target=server.serve_forever, name="status-http", daemon=True).start()
        return status

    def serving(self) -> None:
        """The service answers requests: /ready says so."""
        self._serving.set()

    def not_ready_reason(self) -> str | None:
        if self._serving.is_set():
            return None
        try:
            if self.meter.loaded:  # CUDA graphs and kernels still warming up
                return f"{self.name} starting: every rank loaded ({self.meter.summary()})"
            return f"{self.name} loading: {self.meter.summary()}"
        except Exception as exc:  # the group's store is gone: the start is failing
            return f"{self.name} starting: {exc}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _app(self, environ: dict[str, object], start_response: object) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/ready":
            return self._metrics(environ, start_response)
        reason = self.not_ready_reason()
        status = "200 OK" if reason is None else "503 Service Unavailable"
        body = b"serving\n" if reason is None else f"{reason}\n".encode()
        start_response(status, [("Content-Type", "text/plain; charset=utf-8")])  # type: ignore[operator]
        return [body]
