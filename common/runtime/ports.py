"""Port helpers for the services, the local stack, tests and benchmarks: free ports, the
ports each service binds and a clear error when one is taken, readiness."""

from __future__ import annotations

import errno
import random
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    import grpc

# The ports a service derives from the ones it is given, here and nowhere else.
# A worker serves its Prometheus metrics on its gRPC port + METRICS_PORT_OFFSET.
METRICS_PORT_OFFSET = 1000
# Decode rank k receives KV over gRPC on kv_port_base + k and, for the torch transport, serves
# a TCPStore on kv_port_base + TORCH_PORT_OFFSET + k.
TORCH_PORT_OFFSET = 100


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


# Every port `free_port` handed out in this process, oldest first. A returned port is only
# free at that moment; its service binds it later, so a second call made meanwhile (the next
# service of a test, a second decode group) must not be handed it, or one of its derived ports,
# again. Bounded: a port handed out this many ports ago has long been bound or dropped.
_HANDED_OUT: dict[int, None] = {}
_HANDED_OUT_CAP = 4096
_HANDED_OUT_LOCK = threading.Lock()  # services started in threads pick ports too


def free_port(
    offsets: tuple[int, ...] = (0,), attempts: int = 200, avoid: Collection[int] = ()
) -> int:
    """A port p on 127.0.0.1 with every p + offset free right now (services derive ports:
    metrics on +1000, KV receivers on +rank, their TCPStores on +100 + rank) and none of
    them in `avoid` (ports another process will bind) or handed out by an earlier call of
    this process.

    Chosen below the OS's ephemeral range: a listening port picked from that range (as
    binding port 0 does) can be taken a moment later as the source port of any outgoing
    connection — a gloo pair, a Redis client — and a service that binds it late (a restarted
    decode group) then fails with EADDRINUSE. The search is bounded."""
    low, _ = _ephemeral_range()
    top = max(low - 1 - max(offsets), 10_001)
    for _ in range(attempts):
        base = random.randint(10_000, top)
        ports = [base + off for off in offsets]
        with _HANDED_OUT_LOCK:
            if any(p in avoid or p in _HANDED_OUT for p in ports) or not _all_free(ports):
                continue
            for port in ports:
                _HANDED_OUT[port] = None
            while len(_HANDED_OUT) > _HANDED_OUT_CAP:
                del _HANDED_OUT[next(iter(_HANDED_OUT))]
        return base
    raise RuntimeError(f"no free port with offsets {offsets} in {attempts} tries")


def _all_free(ports: list[int]) -> bool:
    """Whether every one of `ports` can be bound on 127.0.0.1 right now."""
    held: list[socket.socket] = []
    try:
        for port in ports:
            sock = socket.socket()
            held.append(sock)
            sock.bind(("127.0.0.1", port))
        return True
    except OSError:  # taken
        return False
    finally:
        for sock in held:
            sock.close()


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports."""
    return [free_port() for _ in range(count)]


# What a gRPC service binds from its port: the port, and its metrics on +1000.
SERVICE_PORT_OFFSETS = (0, METRICS_PORT_OFFSET)


def kv_port_offsets(ranks: int) -> tuple[int, ...]:
    """The offsets from `kv_port_base` that a decode group of `ranks` ranks binds: each rank's
    KV receiver and its TCPStore (see `kv_receiver_ports`); for `free_port(offsets)`."""
    return tuple(range(ranks)) + tuple(TORCH_PORT_OFFSET + rank for rank in range(ranks))


def wait_ready(url: str, died: Callable[[], str | None], timeout_s: float) -> None:
    """Poll GET {url}/ready until 200. `died()` names a process that exited (then this raises
    RuntimeError at once); TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (reason := died()) is not None:
            raise RuntimeError(reason)
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url}/ready did not answer 200 within {timeout_s:.0f} s")


@dataclass(frozen=True)
class PortUse:
    """A port a service binds: what it is for, and the setting that moves it."""

    port: int
    purpose: str
    setting: str


class PortInUse(ValueError):
    """A port a service must bind is taken. A ValueError, so `tpla` prints the message (one
    line naming the port and the setting that moves it) instead of a traceback."""

    def __init__(self, host: str, use: PortUse) -> None:
        super().__init__(
            f"port {use.port} ({use.purpose}) is in use on {host}; set {use.setting} to move it"
        )
        self.host, self.use = host, use


def port_in_use(host: str, port: int) -> bool:
    """Whether binding host:port fails now because something holds it. Probed as the
    services bind (SO_REUSEADDR: a closed connection's TIME_WAIT does not count), without
    SO_REUSEPORT, so a gRPC server that would share the port still counts as holding it."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror:
        return False  # the service reports an unknown host itself
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def check_ports(host: str, uses: Iterable[PortUse]) -> None:
    """PortInUse for the first of `uses` that is taken on `host`."""
    for use in uses:
        if port_in_use(host, use.port):
            raise PortInUse(host, use)


def bind_grpc(server: grpc.Server, host: str, use: PortUse) -> None:
    """`server.add_insecure_port` on host:use.port. PortInUse if the port is taken: probed
    first, so it is named with its setting rather than in gRPC's words (and log line)."""
    check_ports(host, [use])
    try:
        bound = server.add_insecure_port(f"{host}:{use.port}")
    except RuntimeError:  # grpcio raises where older versions returned 0
        bound = 0
    if not bound:
        check_ports(host, [use])  # taken since the probe
        raise RuntimeError(f"cannot bind {host}:{use.port} ({use.purpose})")


def decode_group_ports(
    port: int, kv_port_base: int | None, dist_port: int, tp: int, group: str = ""
) -> list[PortUse]:
    """Every port a decode group binds: gRPC and metrics (leader), each rank's KV receiver
    and TCPStore, and the rendezvous (tp > 1 only). `group` is appended to each purpose
    (" of group 1") where a stack runs several."""
    uses = [
        PortUse(port, f"decode gRPC{group}", "TPLA_DECODE_PORT"),
        PortUse(port + METRICS_PORT_OFFSET, f"decode metrics{group}", "TPLA_DECODE_PORT"),
    ]
    if kv_port_base is not None:
        for rank in range(tp):
            uses += kv_receiver_ports(kv_port_base, rank, group)
    if tp > 1 and dist_port:  # 0: the engine takes a free one
        uses.append(PortUse(dist_port, f"decode rendezvous{group}", "TPLA_DIST_PORT"))
    return uses


def kv_receiver_ports(
    kv_port_base: int, rank: int, group: str = "", index: int | None = None
) -> list[PortUse]:
    """A decode rank's KV receiver (gRPC) and its TCPStore (the torch transport), on the
    base + `index` (default: the rank; a rank started on its own uses its process's base)."""
    port = kv_port_base + (rank if index is None else index)
    return [
        PortUse(port, f"KV receiver of rank {rank}{group}", "TPLA_KV_PORT_BASE"),
        PortUse(
            port + TORCH_PORT_OFFSET,
            f"KV TCPStore of rank {rank}{group}",
            "TPLA_KV_PORT_BASE",
        ),
    ]


def prefill_worker_ports(
    port: int, worker: str = "", dist_port: int = 0, tp: int = 1
) -> list[PortUse]:
    """A prefill worker's gRPC and metrics ports, and its group's rendezvous (tp > 1)."""
    uses = [
        PortUse(port, f"prefill gRPC{worker}", "TPLA_PREFILL_PORT"),
        PortUse(port + METRICS_PORT_OFFSET, f"prefill metrics{worker}", "TPLA_PREFILL_PORT"),
    ]
    if tp > 1 and dist_port:
        uses.append(PortUse(dist_port, f"prefill rendezvous{worker}", "TPLA_PREFILL_DIST_PORT"))
    return uses


def router_port(port: int) -> PortUse:
    return PortUse(port, "router HTTP", "TPLA_ROUTER_PORT")
